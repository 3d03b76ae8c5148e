// LoRA's low-rank update of a linear layer y = x·Wᵀ (Hu et al., arXiv 2106.09685; PEFT's Linear layer):
//   y += s·(x·Aᵀ)·Bᵀ,  A [r, IN], B [OUT, r], s the adapter's scale (alpha / r; rsLoRA alpha / √r).
// x [N, IN] and y [N, OUT] may be row-strided (column blocks of a fused projection); u [N, r] is contiguous
// scratch that forward leaves holding x·Aᵀ. Backward recomputes u (r columns: cheaper than keeping them) and
//   dB += s·dyᵀ·u,  du = s·dy·B,  dA += duᵀ·x,  dx += du·A
// where an undefined dA, dB or dx is skipped (dx: nothing below wants it).
// Grouped (routed experts, rows laid out expert-contiguously as ops/grouped_gemm.h): expert e's rows use
// A_e = A[e] [r, IN] and B_e = B[e] [OUT, r]; the same formulas per expert, through grouped GEMMs.
// Dropout (PEFT's lora_dropout, dense form only): with dropout p > 0 and a seed, the adapter reads x̃ = x ⊙ m / (1 − p)
// instead of x, m[n, i] = 1 unless a counter-based draw of (seed, stream, n·IN + i) falls below p (the same mask in
// forward, backward and a recomputed forward); xd [N, IN] is the scratch that holds x̃ (and the masked input
// gradient in backward). Seed 0: no dropout (evaluation, inference).
#pragma once

#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace tessera::ops {

struct LoraParams {
    double scale = 1.0;
    double dropout = 0.0;  // p in [0, 1)
    uint64_t seed = 0;     // the pass's (0: no dropout)
    uint64_t stream = 0;   // the adapter's
    bool drops() const { return dropout > 0.0 && seed != 0; }
};
// Whether element `index` of a dropout mask survives (counter-based: a pure function of its arguments).
bool lora_keep(const LoraParams& p, uint64_t index);

void lora_forward(
    const LoraParams& p, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y, TensorView xd = {});
void lora_backward(const LoraParams& p,
                   TensorView x,
                   TensorView dy,
                   TensorView a,
                   TensorView b,
                   TensorView u,
                   TensorView du,
                   TensorView dx,
                   TensorView da,
                   TensorView db,
                   TensorView xd = {});

// x [R, IN], y [R, OUT] (row-strided), u, du [R, r]; a [E, r, IN], b [E, OUT, r], da, db like them.
void lora_grouped_forward(
    const LoraParams& p, const ExpertRows& g, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y);
void lora_grouped_backward(const LoraParams& p,
                           const ExpertRows& g,
                           TensorView x,
                           TensorView dy,
                           TensorView a,
                           TensorView b,
                           TensorView u,
                           TensorView du,
                           TensorView dx,
                           TensorView da,
                           TensorView db);

// The merged weight out = w + s·B·A [OUT, IN] (out may be w itself), and the adapter's gradients from the merged
// weight's gradient G [OUT, IN]: dA += s·Bᵀ·G, dB += s·G·Aᵀ (each skipped when undefined). For a weight used in a
// form the two thin GEMMs cannot follow (MLA's absorbed kv_b_proj) and for exporting merged weights.
void lora_merge(const LoraParams& p, TensorView w, TensorView a, TensorView b, TensorView out);
void lora_weight_backward(const LoraParams& p, TensorView dw, TensorView a, TensorView b, TensorView da, TensorView db);

double lora_forward_flops(int64_t tokens, int64_t in, int64_t out, int64_t rank);

}  // namespace tessera::ops
