// LoRA's low-rank update of a linear layer y = x·Wᵀ (Hu et al., arXiv 2106.09685; PEFT's Linear layer):
//   y += s·(x·Aᵀ)·Bᵀ,  A [r, IN], B [OUT, r], s the adapter's scale (alpha / r; rsLoRA alpha / √r).
// x [N, IN] and y [N, OUT] may be row-strided (column blocks of a fused projection); u [N, r] is contiguous
// scratch that forward leaves holding x·Aᵀ. Backward recomputes u (r columns: cheaper than keeping them) and
//   dB += s·dyᵀ·u,  du = s·dy·B,  dA += duᵀ·x,  dx += du·A
// where an undefined dA, dB or dx is skipped (dx: nothing below wants it).
// Grouped (routed experts, rows laid out expert-contiguously as ops/grouped_gemm.h): expert e's rows use
// A_e = A[e] [r, IN] and B_e = B[e] [OUT, r]; the same formulas per expert, through grouped GEMMs.
#pragma once

#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace tessera::ops {

struct LoraParams {
    double scale = 1.0;
};

void lora_forward(const LoraParams& p, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y);
void lora_backward(const LoraParams& p,
                   TensorView x,
                   TensorView dy,
                   TensorView a,
                   TensorView b,
                   TensorView u,
                   TensorView du,
                   TensorView dx,
                   TensorView da,
                   TensorView db);

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
