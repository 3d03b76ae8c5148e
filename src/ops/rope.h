// Rotary position embedding (Su et al. 2021, "RoFormer"). For pair i < D/2 at position t = offset +
// time index, angle = t · f_i, the pair (a, b) = (x[i], x[i+D/2]) in the rotate-half layout of Llama /
// GPT-NeoX (default), or (x[2i], x[2i+1]) in the interleaved layout of MLA (DeepSeek-V2/V3), is
// rotated and scaled by the attention factor m: a' = m·(a·cos − b·sin), b' = m·(b·cos + a·sin).
// Plain RoPE: f_i = theta^(−2i/D), m = 1. YaRN (Peng et al. 2023, arXiv 2309.00071), as transformers 5
// computes it (modeling_rope_utils.py, _compute_yarn_parameters), with s = factor, L0 = original_max_position:
//   f_i = theta^(−2i/D) · ((1 − r_i) + r_i / s)        (extrapolated below the ramp, interpolated above it)
//   r_i = clamp((i − lo) / (hi − lo), 0, 1)            (hi += 0.001 when hi == lo)
//   lo = max(⌊c(beta_fast)⌋, 0), hi = min(⌈c(beta_slow)⌉, D − 1),  c(n) = D·ln(L0 / (2π n)) / (2 ln theta)
//        (no ⌊⌋ / ⌈⌉ when truncate is false)
//   m = attention_factor if set, else g(s, mscale) / g(s, mscale_all_dim) when both are non-zero, else g(s, 1);
//   g(s, μ) = 0.1·μ·ln s + 1 for s > 1, else 1.
// Frequencies and angles are computed in double, then rounded to the tensor dtype.
// Shapes: x, y, dx, dy [B, T, H, D], strided over B, T and H allowed (D contiguous, D even).
// y may alias x in forward. Backward (the transposed map) accumulates into dx; dx must not alias dy.
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

// Context-extension scaling of the rotary frequencies; factor = 0 (or type none): plain RoPE.
struct RopeScaling {
    enum class Type : uint8_t { none, yarn };
    Type type = Type::none;
    double factor = 1.0;                // s: the context extension
    int64_t original_max_position = 0;  // L0: the pre-training context
    double beta_fast = 32.0;            // rotations that bound the extrapolated pairs
    double beta_slow = 1.0;             // rotations that bound the interpolated pairs
    double mscale = 0.0;                // 0 = unset (transformers' None)
    double mscale_all_dim = 0.0;        // 0 = unset; DeepSeek's MLA also scales its softmax by g(s, this)²
    double attention_factor = 0.0;      // 0 = derived from factor, mscale, mscale_all_dim
    bool truncate = true;               // round the correction range outwards to whole pairs
    bool enabled() const { return type != Type::none; }
    double cos_sin_factor() const;                  // m
    void validate(const std::string& where) const;  // throws naming the bad field
};

// g(s, μ) above: YaRN's magnitude correction for a context extension s
double yarn_mscale(double factor, double mscale);

struct RopeParams {
    double theta = 10000.0;
    int64_t offset = 0;
    bool interleaved = false;  // pairs (2i, 2i+1) instead of (i, i + D/2)
    RopeScaling scaling = {};
};

// f_i for the D/2 pairs of a rotation of width D (out.size() == D/2)
void rope_inv_freq(const RopeParams& p, int64_t D, std::span<double> out);

void rope_forward(const RopeParams& p, TensorView x, TensorView y);
void rope_backward(const RopeParams& p, TensorView dy, TensorView dx);

}  // namespace tessera::ops
