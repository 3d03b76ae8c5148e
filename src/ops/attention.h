// Scaled dot-product attention with grouped K/V heads (GQA when HKV < H; head h reads K/V head
// h / (H/HKV)), causal or not, computed flash-style (Dao et al. 2022/2023, FlashAttention-1/2):
// tiles of queries × keys with an online softmax, so no [T, T] matrix exists beyond one tile.
// Shapes: q, o, dq, do [B, T, H, D]; k, v, dk, dv [B, T, HKV, D] (strided over B, T, H allowed,
// D contiguous); lse [B, H, T] contiguous (log-sum-exp of each query's scaled scores; written by
// forward, read by backward). With cu_seqlens (B = 1) the row holds packed sequences and a query
// sees only keys of its own sequence (document masking).
// Backward recomputes the probabilities tile by tile from lse and accumulates into dq, dk, dv.
// Work is split over (sequence, kv head) in backward, so no two threads add into the same row:
// results do not depend on the thread count. Tiles multiply with the register-blocked small GEMM.
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

struct AttentionParams {
    double scale = 0.0;  // 0: D^-0.5
    bool causal = true;
};

// Bytes of workspace forward and backward need with `num_threads` threads for head dim D, length T.
size_t attention_workspace_bytes(DType dtype, int64_t T, int64_t D, int num_threads);

void attention_forward(const AttentionParams& p,
                       TensorView q,
                       TensorView k,
                       TensorView v,
                       TensorView o,
                       TensorView lse,
                       std::span<std::byte> workspace,
                       std::span<const int64_t> cu_seqlens = {});
void attention_backward(const AttentionParams& p,
                        TensorView dout,
                        TensorView q,
                        TensorView k,
                        TensorView v,
                        TensorView o,
                        TensorView lse,
                        TensorView dq,
                        TensorView dk,
                        TensorView dv,
                        std::span<std::byte> workspace,
                        std::span<const int64_t> cu_seqlens = {});

// FLOPs of the forward (2 GEMMs) counting only the causal half when causal: 4·B·H·D·pairs.
double attention_forward_flops(int64_t B, int64_t T, int64_t H, int64_t D, bool causal);

}  // namespace tessera::ops
