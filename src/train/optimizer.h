// AdamW over the parameter group: first and second moments are buffer groups with the parameters'
// specs (kind optimizer), so they are sized, allocated and checkpointed like everything else.
// Weight decay applies to parameters whose spec says so (matrices, not norms). Global-norm gradient
// clipping reduces in a fixed order (fixed 64K-element chunks, chunk sums added in order).
#pragma once

#include <vector>

#include "core/buffer_spec.h"
#include "train/config.h"

namespace tessera::train {

class AdamW {
  public:
    explicit AdamW(const std::vector<BufferSpec>& param_specs);

    BufferGroup& m() { return m_; }
    BufferGroup& v() { return v_; }
    int64_t step() const { return step_; }
    void set_step(int64_t s) { step_ = s; }

    // L2 norm of all gradients (double accumulation, deterministic order).
    double grad_norm(const BufferGroup& grads);
    // Scales gradients by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_).
    void clip(const BufferGroup& grads, double norm, double max_norm);
    // One AdamW step of every trainable parameter at learning rate lr (all, when `trainable` is empty;
    // frozen ones are left alone: no update, no decay, moments unchanged).
    void update(const TrainConfig& c,
                const BufferGroup& params,
                const BufferGroup& grads,
                double lr,
                const std::vector<bool>& trainable = {});

  private:
    BufferGroup m_, v_;
    std::vector<double> partial_;  // per-chunk sums of squares, sized once
    int64_t step_ = 0;
};

}  // namespace tessera::train
