// The mixing operator of Attention Residuals (Kimi K3's block AttnRes, spec/kimi_k3.md §2.2; concept:
// arXiv 2603.15031): a softmax mix over depth of S source vectors per token, scored by a learned
// pseudo-query against the RMS-normalised sources.
//   r_i = (mean_d v_i² + eps)^-1/2,  x̂_i = r_i v_i,  score_i = Σ_d w_d γ_d x̂_{i,d},  p = softmax_i(score),
//   out = Σ_i p_i v_i   (the raw sources, not x̂)
// Shapes: S sources [N, C] each (separate buffers: the model mixes stored activations in place), gamma, w
// [C], out [N, C], p [N, S] (written by forward, read by backward). Backward (spec §2.2): dp_i = ⟨dout, v_i⟩, ds_i =
// p_i (dp_i − Σ_j p_j dp_j), a_i = ds_i (w ⊙ γ),
//   dv_i += p_i dout + r_i (a_i − x̂_i mean_d(a_i ⊙ x̂_i)),  dγ += Σ ds_i (w ⊙ x̂_i),  dw += Σ ds_i (γ ⊙ x̂_i),
// with dγ and dw reduced over tokens in token order (deterministic). Mixing runs along depth only.
// At most 64 sources per mix.
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

struct AttnResParams {
    double eps = 1e-6;
};

// scratch: at least attn_res_mix_scratch(N, S, C) elements of the tensors' dtype (the caller's memory:
// the op allocates nothing)
int64_t attn_res_mix_scratch(int64_t N, int64_t S, int64_t C);

void attn_res_mix_forward(const AttnResParams& p,
                          std::span<const TensorView> sources,
                          TensorView gamma,
                          TensorView w,
                          TensorView out,
                          TensorView probs,
                          TensorView scratch);
// dsources[i] += dL/dsources[i]; dgamma, dw += their gradients (both undefined: frozen, skipped)
void attn_res_mix_backward(const AttnResParams& p,
                           TensorView dout,
                           std::span<const TensorView> sources,
                           TensorView gamma,
                           TensorView w,
                           TensorView probs,
                           std::span<const TensorView> dsources,
                           TensorView dgamma,
                           TensorView dw,
                           TensorView scratch);

}  // namespace tessera::ops
