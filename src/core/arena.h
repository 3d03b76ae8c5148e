// Memory arena: one region, managed by a buddy-system allocator (power-of-two blocks, split on
// allocate, coalesce on free, O(log n) each), with water-level statistics. All allocator metadata
// lives in arrays sized once at construction, so allocate/free never touch the system heap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace tessera {

struct ArenaStats {
    size_t capacity = 0;
    size_t bytes_in_use = 0;       // allocated bytes (requests rounded up to min_block)
    size_t bytes_requested = 0;    // sum of the sizes asked for
    size_t peak_bytes_in_use = 0;  // water level: highest bytes_in_use seen
    size_t peak_bytes_requested = 0;
    size_t num_allocations = 0;
    size_t num_free_blocks = 0;
    size_t largest_free_block = 0;
    // 1 - largest_free_block / free bytes: 0 when all free memory is one block
    double fragmentation() const;
};

// Offsets into a region [0, capacity), in units of min_block (a power of two >= 64). The region is
// seeded as the binary decomposition of aligned power-of-two blocks, so capacity need not be a
// power of two. A request for n units takes the smallest free block of 2^k >= n units (splitting
// larger ones into buddies), keeps its first n units as the power-of-two sub-blocks of n's binary
// decomposition and returns the tail as free blocks (as Linux's alloc_pages_exact does), so memory
// use is the request rounded up to min_block, not to a power of two. Freeing frees each sub-block,
// coalescing it with its buddy while the buddy is free and whole. Every step is O(log n).
class BuddyAllocator {
  public:
    BuddyAllocator(size_t capacity, size_t min_block);

    // Throws tessera::Error when no free block is large enough.
    size_t allocate(size_t bytes);
    void free(size_t offset);
    size_t rounded_size(size_t bytes) const;  // what allocate(bytes) takes
    const ArenaStats& stats() const { return stats_; }
    void reset_peak();
    size_t min_block() const { return min_block_; }

  private:
    static constexpr uint32_t kNone = 0xffffffffu;
    static constexpr int8_t kNotStart = -1;
    void push_free(uint32_t idx, int order);
    void unlink_free(uint32_t idx, int order);
    void free_block(uint32_t idx, int order);
    void refresh_largest_free();

    size_t min_block_;
    int num_orders_;
    // per unit index (meaningful at block starts only)
    std::vector<int8_t> order_;  // order of the block starting here, kNotStart otherwise
    std::vector<uint8_t> is_free_;
    std::vector<uint32_t> next_, prev_;  // free-list links
    std::vector<uint32_t> span_;         // at an allocation's first unit: its length in units, else 0
    std::vector<size_t> requested_;      // at an allocation's first unit: the bytes asked for
    std::vector<uint32_t> head_;         // per order: first free block
    std::vector<size_t> num_free_;       // per order
    ArenaStats stats_;
};

// The smallest arena capacity (a multiple of min_block) into which allocations of these sizes, made
// largest first, fit: found by replaying them on the allocator's bookkeeping (no memory touched).
size_t buddy_capacity_for(std::vector<size_t> sizes, size_t min_block);

// One region of a device's memory (host memory by default; core/device.h) plus its buddy allocator: the CUDA
// backend's arena is the same allocator over one cudaMalloc'ed region.
class Arena {
  public:
    explicit Arena(size_t capacity, size_t min_block = 256, Device device = Device::cpu);
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    void* allocate(size_t bytes);
    void free(void* p);
    TensorView allocate_tensor(DType dtype, Shape shape);
    const ArenaStats& stats() const { return buddy_.stats(); }
    void reset_peak() { buddy_.reset_peak(); }
    size_t rounded_size(size_t bytes) const { return buddy_.rounded_size(bytes); }
    std::byte* base() const { return base_.get(); }
    Device device() const { return base_.get_deleter().device; }

  private:
    struct Free {
        Device device;  // value-initialised (Device::cpu) by unique_ptr's default constructor
        void operator()(std::byte* p) const;
    };
    std::unique_ptr<std::byte, Free> base_;
    BuddyAllocator buddy_;
};

// A block of an arena, freed when the handle dies. The handle keeps its arena alive, so blocks and
// arenas may be destroyed in any order.
class ArenaBlock {
  public:
    ArenaBlock() = default;
    ArenaBlock(std::shared_ptr<Arena> arena, size_t bytes)
        : arena_(std::move(arena)), ptr_(arena_->allocate(bytes)), bytes_(bytes) {}
    ArenaBlock(ArenaBlock&& o) noexcept { *this = std::move(o); }
    ArenaBlock& operator=(ArenaBlock&& o) noexcept;
    ~ArenaBlock() { release(); }
    void release();
    std::byte* data() const { return static_cast<std::byte*>(ptr_); }
    size_t size() const { return bytes_; }
    Device device() const { return arena_ ? arena_->device() : Device::cpu; }

  private:
    std::shared_ptr<Arena> arena_;
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

}  // namespace tessera
