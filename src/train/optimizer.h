// AdamW over the parameter group, sharded ZeRO-style over the data group: each rank keeps the first and
// second moments of one range of the group's flat f32 elements (parallel/shard.h; all of them on one
// rank) and updates that range of the parameters from the same range of the summed gradient. The
// moments are buffer groups (kind optimizer), so they are sized, allocated and checkpointed like
// everything else. Weight decay applies to parameters whose spec says so (matrices, not norms).
// Global-norm gradient clipping reduces in a fixed order: Σ g² per fixed chunk of kChunk flat elements,
// the chunk sums added in order (gathered from every rank first), so the norm has the same bits on any
// thread count and any number of ranks.
#pragma once

#include <span>
#include <vector>

#include "core/buffer_spec.h"
#include "parallel/comm.h"
#include "parallel/shard.h"
#include "train/config.h"

namespace tessera::train {

class AdamW {
  public:
    static constexpr int64_t kChunk = int64_t(1) << 16;

    // The moments of this rank's range of the parameter group (comm null or one rank: all of it).
    AdamW(const std::vector<BufferSpec>& param_specs, parallel::Comm* comm = nullptr);

    BufferGroup& m() { return m_; }
    BufferGroup& v() { return v_; }
    const BufferGroup& m() const { return m_; }
    const BufferGroup& v() const { return v_; }
    const parallel::FlatShard& shard() const { return shard_; }
    int64_t step() const { return step_; }
    void set_step(int64_t s) { step_ = s; }

    // L2 norm of the whole gradient from this rank's range of it (grad: shard().size() floats, the summed
    // gradient of the range); collective over the communicator.
    double grad_norm(std::span<const float> grad);
    // Scales the range's gradient by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_).
    void clip(std::span<float> grad, double norm, double max_norm) const;
    // One AdamW step of this rank's range of every trainable parameter at learning rate lr (all, when
    // `trainable` is empty; frozen ones are left alone: no update, no decay, moments unchanged). Other
    // ranges of params are the other ranks' to update (share_params brings them here).
    void update(const TrainConfig& c,
                const BufferGroup& params,
                std::span<const float> grad,
                double lr,
                const std::vector<bool>& trainable = {});
    // After update on every rank: each rank's range of the parameters to every other rank (collective).
    void share_params(const BufferGroup& params) const;

  private:
    parallel::Comm* comm_;
    parallel::FlatShard shard_;
    std::vector<BufferSpec> specs_;
    std::vector<size_t> offsets_;  // flat element offset of each parameter
    BufferGroup m_, v_;
    std::vector<double> mine_, partial_;  // Σ g² per chunk: this rank's, every rank's (sized once)
    int64_t step_ = 0;
};

}  // namespace tessera::train
