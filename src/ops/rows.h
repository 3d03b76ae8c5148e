// Row-wise glue ops of the model code: copies, adds and zero-fills of row-strided buffers (a column block of a
// fused projection is a view with the projection's row stride: TensorView::columns), the sigmoid of a gate, a gate
// broadcast over groups and its gradient's sum, and the sigmoid output gate of gated attention. They are ops, with
// one entry point per backend like the others (ops/backend.h), so the blocks hold no loops over tensor data and
// run unchanged on either device. All views are [N, W] with a contiguous last dim (leading dims collapse into rows,
// ops/views.h), f32 unless said.
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

// dst = scale · src (scale 1: a plain copy). src and dst the same shape.
void copy_rows(TensorView src, TensorView dst, float scale = 1.f);
// dst += src.
void add_rows(TensorView src, TensorView dst);
// Block copies between two flat f32 views on one device: block i moves blocks[i].n floats from src[blocks[i].from] to
// dst[blocks[i].to] (every block inside its view; the destinations apart). On the GPU one launch does them all: expert
// parallelism regroups its exchanged rows with it (parallel/ep.cpp).
struct CopyBlock {
    int64_t from, to, n;
};
void copy_blocks(TensorView src, TensorView dst, std::span<const CopyBlock> blocks);
// dst = src in dst's dtype, contiguous views of one element count: f32 -> bf16 rounds to nearest even (core/dtype.h's
// float_to_bf16), bf16 -> f32 widens exactly, one dtype copies the bytes (any dtype). The activations a block saves,
// held in bf16 between its forward and its backward (train.activation_dtype; model/model.h).
void cast(TensorView src, TensorView dst);
// t's values rounded to the nearest bf16 in place, kept f32 (contiguous f32): what a cast to bf16 and back gives.
void round_to_bf16(TensorView t);
// Zero-fills the first `rows` rows of t (any dtype; row-strided views too).
void zero_rows(TensorView t, int64_t rows);
// dst[at[i]] = src[i] for i < at.size() (src [at.size(), W], dst [N, W]; the positions distinct, in [0, N)), and
// the rows `at` of t zeroed: image rows spliced into the embedding's output and kept out of its gradient.
void scatter_rows(TensorView src, std::span<const int64_t> at, TensorView dst);
void zero_rows_at(TensorView t, std::span<const int64_t> at);

// y = σ(x); backward accumulates dx += dy · y(1 − y) from the forward's output y.
void sigmoid_forward(TensorView x, TensorView y);
void sigmoid_backward(TensorView dy, TensorView y, TensorView dx);

// Group broadcast: dst[n, g·K + k] = src[n, g] for src [N, G], dst [N, G·K]; its adjoint sums each group,
// dst[n, g] = Σ_k src[n, g·K + k] (written, k in order).
void expand_groups(TensorView src, TensorView dst);
void sum_groups(TensorView src, TensorView dst);

// The sigmoid output gate of gated attention (arXiv 2505.06708, "G1"): y = o ⊙ σ(z), one gate per `per`
// consecutive values of o (per = 1: elementwise; per = head dim: headwise). z, gate [N, G]; o, y, dy, dov
// [N, G·per]. Backward: dov = dy ⊙ γ, dz = γ(1−γ)·Σ dy ⊙ o (both written).
void output_gate_forward(TensorView z, TensorView o, TensorView gate, TensorView y);
void output_gate_backward(TensorView dy, TensorView o, TensorView gate, TensorView dov, TensorView dz);

}  // namespace tessera::ops
