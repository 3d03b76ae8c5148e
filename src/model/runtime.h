// A model bound to memory: its buffer groups (parameters, gradients, activations, workspace, plus
// any extra groups such as optimizer state) allocated from one arena whose capacity is the
// prediction from the buffer specs. The memory report puts prediction and measurement side by side.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/model.h"

namespace tessera::model {

struct MemoryReport {
    struct Group {
        std::string name;
        size_t bytes = 0;        // packed tensor bytes
        size_t block_bytes = 0;  // what it takes in the arena (rounded to the allocation unit)
    };
    std::vector<Group> groups;
    size_t predicted_bytes = 0;         // peak bytes in use, from the buffer specs (sum of block_bytes)
    size_t arena_peak_bytes = 0;        // measured: the arena's high-water mark
    size_t capacity_bytes = 0;          // address space the arena reserves (pages never touched cost nothing)
    size_t outside_arena_bytes = 0;     // predicted too: the GEMM copy buffers, one per thread
    size_t device_scratch_bytes = 0;    // measured (a CUDA run): the backend's scratch outside the arena so far
    size_t process_peak_rss_bytes = 0;  // the whole process (libraries, files, allocator caches)
    std::string str() const;            // a small table
};

// The parameter and gradient groups when they are not simply the parameter specs packed back to back:
// FSDP places each block's parameters in a gather slot (train/fsdp.h).
struct ParamPlacement {
    BufferGroup params, grads;
};

// The groups a runtime allocates, built without allocating: the parameters (placed, or the specs packed back to
// back), the activations at `max`, the workspace of `threads` threads and, with_grads, the gradients. The planner
// (plan/memory.h) predicts a rank's memory from the same lists the runtime allocates.
struct RuntimeGroups {
    BufferGroup params, grads, acts, workspace;
    bool with_grads = false;
    // every group the arena holds, in allocation order: these, then extra
    std::vector<BufferGroup*> all(const std::vector<BufferGroup*>& extra);
};
RuntimeGroups runtime_groups(const Model& model,
                             StepShape max,
                             bool with_grads,
                             const Recompute& recompute,
                             ParamPlacement* placement,
                             int threads);

// What each group takes in the arena that holds them all: its bytes rounded up to the arena's allocation unit.
std::vector<size_t> arena_block_bytes(const std::vector<const BufferGroup*>& groups);

class ModelRuntime {
  public:
    // device: where the arena lives (Device::cuda: one cudaMalloc'ed region; the ops run there, with the host's
    // workspace sized for one thread, which the CUDA kernels do not use)
    ModelRuntime(Model& model,
                 StepShape max,
                 bool with_grads,
                 const Recompute& recompute,
                 std::vector<BufferGroup*> extra = {},
                 ParamPlacement* placement = nullptr,
                 Device device = Device::cpu);

    Model& model() { return model_; }
    BufferGroup& params() { return params_; }
    BufferGroup& grads() { return grads_; }
    BufferGroup& activations() { return acts_; }
    const Arena& arena() const { return *arena_; }
    Device device() const { return arena_->device(); }
    Arena& arena() { return *arena_; }
    StepShape max_shape() const { return max_; }
    MemoryReport memory_report() const;

  private:
    ModelRuntime(Model& model,
                 StepShape max,
                 const Recompute& recompute,
                 std::vector<BufferGroup*> extra,
                 RuntimeGroups groups,
                 Device device);
    Model& model_;
    StepShape max_;
    RuntimeGroups g_;
    BufferGroup &params_, &grads_, &acts_, &workspace_;
    std::vector<BufferGroup*> groups_;  // everything allocated, extras included
    std::shared_ptr<Arena> arena_;
};

// Parameter specs re-labelled as gradients (same names, shapes and order).
std::vector<BufferSpec> grad_specs(const std::vector<BufferSpec>& params);

}  // namespace tessera::model
