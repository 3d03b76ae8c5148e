// One description of every buffer: name, dtype, shape, kind. Buffers are packed into groups (all
// parameters, all gradients, each optimizer state, activations, workspace); each group is one arena
// block. The memory prediction and the allocation both come from these lists, so they cannot disagree.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"

namespace tessera {

enum class BufferKind : uint8_t { param, grad, optimizer, activation, workspace };
std::string_view buffer_kind_name(BufferKind k);

// How a parameter (and its gradient and optimizer state) is spread over ranks (parallel/mesh.h):
//   replicated  the same values on every rank of the data group, always whole there (ZeRO shards only its
//               optimizer state): what is read outside its block's compute, e.g. the MoE selection bias
//   data        the same values on every rank of the data group; with FSDP (train/fsdp.h) each rank holds a
//               range and a block's parameters are gathered for its compute, without it like replicated
//   expert      one slice of the experts per rank of the expert group, the same on every rank of the
//               expert-data group
enum class Sharding : uint8_t { replicated, data, expert };

struct BufferSpec {
    std::string name;
    DType dtype = DType::f32;
    Shape shape;
    BufferKind kind = BufferKind::activation;
    bool weight_decay = false;           // parameters only: AdamW decays it
    Sharding sharding = Sharding::data;  // parameters only
    bool trainable = true;               // parameters only: false = frozen (no gradient, no optimizer state)
    // parameters: its ops also read it in bf16 (a frozen base's dtype); f32 activations a block saves: held in bf16
    // between its forward and its backward under train.activation_dtype = bf16 (model/model.h)
    bool narrowable = false;
    bool fused_next = false;  // parameters only: read with the next one as one tensor (back to back)
    size_t nbytes() const;    // throws when the size does not fit in 2^62 bytes
};

constexpr size_t kBufferAlign = 64;

// Buffers packed back to back at kBufferAlign-aligned offsets, bound to one block of memory.
class BufferGroup {
  public:
    BufferGroup() = default;
    BufferGroup(std::string name, std::vector<BufferSpec> specs);
    // Buffers at given (kBufferAlign-aligned) offsets in a block of nbytes; they may share bytes (FSDP's
    // gather slots hold one block's parameters at a time, train/fsdp.h). An offset kOutside: the buffer lives
    // outside the block, where place_outside puts it.
    static constexpr size_t kOutside = SIZE_MAX;
    BufferGroup(std::string name, std::vector<BufferSpec> specs, std::vector<size_t> offsets, size_t nbytes);

    const std::string& name() const { return name_; }
    size_t nbytes() const { return nbytes_; }
    const std::vector<BufferSpec>& specs() const { return specs_; }
    size_t size() const { return specs_.size(); }
    size_t offset(size_t i) const { return offsets_[i]; }
    int index_of(const std::string& name) const;  // -1 if absent

    // Allocates the group's block from the arena (zero-filled) and binds the views.
    void allocate(const std::shared_ptr<Arena>& arena);
    // Binds the views into memory the caller holds (nbytes() at base, on device, kBufferAlign-aligned) instead: a
    // group laid out inside another group's buffer (model/layers/tensor_slice.h: one rank's slices of a block's
    // parameters).
    void bind(std::byte* base, Device device);
    // Buffer i (offset kOutside) lives at where: one address for all of it, or one per dimension-0 slice (its view
    // then has its slices stored apart, core/tensor.h; an mxfp4 one two a slice, its packed values and its scales). A
    // frozen weight read in place from a mapped file: the weight budget, train/weight_budget.h.
    void place_outside(size_t i, std::vector<std::byte*> where);
    // These buffers, but those `copies` holds (by name, of the same shape) read there instead, in its dtype: the views
    // a model binds when its GEMM weights are read from bf16 copies (train/weight_copies.h). It allocates nothing: a
    // group of views into both, alive no longer than they are.
    BufferGroup reading(const BufferGroup& copies) const;
    std::byte* base() const { return borrowed_ ? borrowed_ : block_.data(); }
    Device device() const { return borrowed_ ? borrowed_device_ : block_.device(); }  // where its block lives
    void zero() const;                                                                // all buffers to zero bytes
    TensorView view(size_t i) const;
    TensorView view(const std::string& name) const;  // throws if absent
    TensorView find(const std::string& name) const;  // undefined if absent

  private:
    std::string name_;
    std::vector<BufferSpec> specs_;
    std::vector<size_t> offsets_;
    std::unordered_map<std::string, size_t> index_;
    struct Outside {
        std::vector<void*> at;
        Device device = Device::cpu;  // (place_outside: a mapped file's host memory)
    };
    // per buffer: where it lives when not in the block (empty: in it), shared so that views outlive copies
    std::vector<std::shared_ptr<const Outside>> outside_;
    size_t nbytes_ = 0;
    ArenaBlock block_;
    std::byte* borrowed_ = nullptr;  // bind(): the caller's memory
    Device borrowed_device_ = Device::cpu;
};

// Throws "<where>: tensor \"name\" holds NaN at index i (...)" for the first non-finite value of a float buffer:
// loaded weights are checked, so a diverged checkpoint is never scored or trained on without a word.
void check_finite(const BufferGroup& g, const std::string& where);

// Arena capacity that holds the groups when allocated largest first (buddy_capacity_for).
size_t predict_arena_bytes(const std::vector<const BufferGroup*>& groups, size_t min_block);
// Allocates the groups largest first.
void allocate_groups(const std::shared_ptr<Arena>& arena, const std::vector<BufferGroup*>& groups);

}  // namespace tessera
