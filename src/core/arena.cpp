// Buddy-system allocator and the host arena built on it. Knuth, TAOCP vol. 1, 2.5 ("buddy system").
#include "core/arena.h"

#include "core/device.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <functional>

namespace tessera {

double ArenaStats::fragmentation() const {
    size_t free_bytes = capacity - bytes_in_use;
    if (free_bytes == 0) return 0.0;
    return 1.0 - double(largest_free_block) / double(free_bytes);
}

BuddyAllocator::BuddyAllocator(size_t capacity, size_t min_block) : min_block_(min_block) {
    TESSERA_CHECK(min_block >= 64 && std::has_single_bit(min_block), "arena: min_block {} must be a power of two >= 64",
                  min_block);
    const size_t n = capacity / min_block;
    TESSERA_CHECK(n >= 1, "arena: capacity {} is smaller than one block of {}", capacity, min_block);
    TESSERA_CHECK(n < kNone, "arena: {} blocks of {} bytes exceed the index range; use a larger min_block", n,
                  min_block);
    num_orders_ = std::bit_width(n);  // orders 0 .. bit_width(n)-1
    order_.assign(n, kNotStart);
    is_free_.assign(n, 0);
    next_.assign(n, kNone);
    prev_.assign(n, kNone);
    span_.assign(n, 0);
    requested_.assign(n, 0);
    head_.assign(num_orders_, kNone);
    num_free_.assign(num_orders_, 0);
    stats_.capacity = n * min_block;
    // Seed the free lists with the binary decomposition of n, largest block first (keeps alignment).
    size_t idx = 0;
    for (int k = num_orders_ - 1; k >= 0; --k) {
        if (n & (size_t(1) << k)) {
            push_free(uint32_t(idx), k);
            idx += size_t(1) << k;
        }
    }
    refresh_largest_free();
}

void BuddyAllocator::push_free(uint32_t idx, int order) {
    order_[idx] = int8_t(order);
    is_free_[idx] = 1;
    prev_[idx] = kNone;
    next_[idx] = head_[order];
    if (head_[order] != kNone) prev_[head_[order]] = idx;
    head_[order] = idx;
    num_free_[order]++;
}

void BuddyAllocator::unlink_free(uint32_t idx, int order) {
    if (prev_[idx] != kNone) {
        next_[prev_[idx]] = next_[idx];
    } else {
        head_[order] = next_[idx];
    }
    if (next_[idx] != kNone) prev_[next_[idx]] = prev_[idx];
    is_free_[idx] = 0;
    num_free_[order]--;
}

void BuddyAllocator::refresh_largest_free() {
    stats_.largest_free_block = 0;
    stats_.num_free_blocks = 0;
    for (int k = num_orders_ - 1; k >= 0; --k) {
        stats_.num_free_blocks += num_free_[k];
        if (num_free_[k] && stats_.largest_free_block == 0) stats_.largest_free_block = min_block_ << k;
    }
}

size_t BuddyAllocator::rounded_size(size_t bytes) const {
    return std::max<size_t>(1, (bytes + min_block_ - 1) / min_block_) * min_block_;
}

size_t BuddyAllocator::allocate(size_t bytes) {
    const size_t units = rounded_size(bytes) / min_block_;
    const int want = int(std::bit_width(units - 1));  // smallest k with 2^k >= units
    int k = want;
    while (k < num_orders_ && head_[k] == kNone) ++k;
    TESSERA_CHECK(k < num_orders_,
                  "arena: out of memory: {} bytes requested, {} of {} in use, largest free block {} bytes", bytes,
                  stats_.bytes_in_use, stats_.capacity, stats_.largest_free_block);
    const uint32_t idx = head_[k];
    unlink_free(idx, k);
    while (k > want) {  // split: keep the lower half, free the upper half
        --k;
        push_free(idx + (uint32_t(1) << k), k);
    }
    // Keep the sub-blocks of units' binary decomposition (largest first), free the tail.
    uint32_t at = idx;
    for (int j = want; j >= 0; --j) {
        if (units & (size_t(1) << j)) {
            order_[at] = int8_t(j);
            is_free_[at] = 0;
            at += uint32_t(1) << j;
        }
    }
    const uint32_t end = idx + (uint32_t(1) << want);
    while (at < end) {  // the tail [at, end): aligned blocks, each as large as alignment allows
        int j = std::countr_zero(at | (uint32_t(1) << 31));
        while (at + (uint32_t(1) << j) > end) --j;
        push_free(at, j);
        at += uint32_t(1) << j;
    }
    span_[idx] = uint32_t(units);
    requested_[idx] = bytes;
    stats_.bytes_in_use += units * min_block_;
    stats_.bytes_requested += bytes;
    stats_.num_allocations++;
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
    stats_.peak_bytes_requested = std::max(stats_.peak_bytes_requested, stats_.bytes_requested);
    refresh_largest_free();
    return size_t(idx) * min_block_;
}

void BuddyAllocator::free_block(uint32_t idx, int k) {
    const size_t n = order_.size();
    while (k + 1 < num_orders_) {  // coalesce with the buddy while it is free and whole
        uint32_t buddy = idx ^ (uint32_t(1) << k);
        if (buddy >= n || !is_free_[buddy] || order_[buddy] != k) break;
        unlink_free(buddy, k);
        order_[std::max(idx, buddy)] = kNotStart;
        idx = std::min(idx, buddy);
        ++k;
    }
    push_free(idx, k);
}

void BuddyAllocator::free(size_t offset) {
    TESSERA_CHECK(offset % min_block_ == 0 && offset / min_block_ < order_.size(), "arena: free of a bad offset {}",
                  offset);
    const uint32_t idx = uint32_t(offset / min_block_);
    TESSERA_CHECK(span_[idx] != 0, "arena: free of offset {} that is not an allocation", offset);
    const size_t units = span_[idx];
    stats_.bytes_in_use -= units * min_block_;
    stats_.bytes_requested -= requested_[idx];
    stats_.num_allocations--;
    span_[idx] = 0;
    requested_[idx] = 0;
    uint32_t at = idx;
    for (int j = std::bit_width(units) - 1; j >= 0; --j) {
        if (units & (size_t(1) << j)) {
            const uint32_t sub = at;
            at += uint32_t(1) << j;
            free_block(sub, j);
        }
    }
    refresh_largest_free();
}

void BuddyAllocator::reset_peak() {
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
    stats_.peak_bytes_requested = stats_.bytes_requested;
}

size_t buddy_capacity_for(std::vector<size_t> sizes, size_t min_block) {
    std::sort(sizes.begin(), sizes.end(), std::greater<>());
    // NOTES: the allocator indexes units with uint32; with at most 2^30 units, the doublings below stay in range
    // (sizes beyond it ended in an endless loop of candidates that could never be built).
    constexpr size_t kMaxUnits = size_t(1) << 30;
    size_t units = 0, bound = 0;
    for (size_t s : sizes) {
        TESSERA_CHECK(s / min_block < kMaxUnits, "arena: an allocation of {} bytes exceeds 2^30 blocks of {} bytes", s,
                      min_block);
        const size_t u = std::max<size_t>(1, (s + min_block - 1) / min_block);
        units += u;
        bound += std::bit_ceil(u);
        TESSERA_CHECK(bound <= kMaxUnits, "arena: allocations of {} bytes in all exceed 2^30 blocks of {} bytes",
                      units * min_block, min_block);
    }
    auto fits = [&](size_t cap_units) {
        BuddyAllocator sim(cap_units * min_block, min_block);
        try {
            for (size_t s : sizes) sim.allocate(s);
        } catch (const Error&) {
            return false;
        }
        return true;
    };
    // NOTES: candidates from tight to loose: the exact total, the total rounded up to coarser powers
    // of two, then one power-of-two block per request (and doublings of that, which always fit).
    // Each candidate is checked by replaying the allocations, so the prediction is never wrong.
    for (size_t align = 1; (units + align - 1) / align * align < bound; align *= 2) {
        const size_t cap = (units + align - 1) / align * align;
        if (fits(cap)) return cap * min_block;
    }
    size_t cap = std::max<size_t>(bound, 1);
    while (!fits(cap)) cap *= 2;
    return cap * min_block;
}

void Arena::Free::operator()(std::byte* p) const { device_free(device, p); }

Arena::Arena(size_t capacity, size_t min_block, Device device)
    : buddy_((capacity + min_block - 1) / min_block * min_block, min_block) {
    const size_t cap = buddy_.stats().capacity;
    try {
        base_ = std::unique_ptr<std::byte, Free>(static_cast<std::byte*>(device_alloc(device, cap)), Free{device});
    } catch (const Error& e) {
        TESSERA_FAIL("arena: cannot reserve {} bytes of {} memory: {}", cap, device == Device::cpu ? "host" : "CUDA",
                     e.what());
    }
}

void* Arena::allocate(size_t bytes) { return base_.get() + buddy_.allocate(bytes); }

void Arena::free(void* p) { buddy_.free(size_t(static_cast<std::byte*>(p) - base_.get())); }

TensorView Arena::allocate_tensor(DType dtype, Shape shape) {
    return TensorView(allocate(dtype_bytes(dtype, shape.numel())), dtype, shape, device());
}

ArenaBlock& ArenaBlock::operator=(ArenaBlock&& o) noexcept {
    if (this != &o) {
        release();
        arena_ = std::move(o.arena_);
        ptr_ = o.ptr_;
        bytes_ = o.bytes_;
        o.ptr_ = nullptr;
        o.bytes_ = 0;
    }
    return *this;
}

void ArenaBlock::release() {
    if (arena_ && ptr_) arena_->free(ptr_);
    arena_.reset();
    ptr_ = nullptr;
    bytes_ = 0;
}

}  // namespace tessera
