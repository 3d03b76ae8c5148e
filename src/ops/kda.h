// KDA (Kimi Delta Attention) core: the gated delta rule with a per-channel decay (Kimi Linear,
// arXiv 2510.26692; math and backward: ../shared/spec/kda.md). Semantics are those of fla's
// naive_recurrent_kda: per sequence and value head i (q/k head h = i / (HV/H)), S starts at h0 and
//   S ← Diag(exp g_t)·S;  u = v_t − Sᵀk_t;  S ← S + β_t·k_t·uᵀ;  o_t = Sᵀ(scale·q_t)
// (o_t is read after the write of token t). q and k are used as given (the layer L2-normalises them).
//
// Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, ≤ 0, not cumsummed);
// beta [B, T, HV]; h0, ht [N, HV, K, V] with N = B sequences, or, with cu_seqlens (B = 1), N
// variable-length sequences packed in the row: sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]).
// All contiguous, one float dtype (f32 or f64); the state is kept in that dtype.
//
// mode chunk: the chunkwise-parallel algorithm (WY form, chunk_size 64 or 32), O(T); work is split
// over (sequence, head) pairs and over chunks within a window, so even B·HV = 1 keeps every thread
// busy in the intra-chunk phases. mode recurrent: the token-by-token reference (and its BPTT).
// Backward accumulates into dq, dk, dv, dg, dbeta, dh0 (any may be absent); do and dht may be absent
// (zero). Determinism: fixed reduction orders; GVA sums over value heads in ascending order.
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

enum class KdaMode : uint8_t { chunk, recurrent };

struct KdaParams {
    double scale = 0.0;  // 0: K^-0.5
    int64_t chunk_size = 64;
    KdaMode mode = KdaMode::chunk;
};

struct KdaInputs {
    TensorView q, k;                      // [B, T, H, K]
    TensorView v;                         // [B, T, HV, V]
    TensorView g;                         // [B, T, HV, K]
    TensorView beta;                      // [B, T, HV]
    TensorView h0;                        // [N, HV, K, V] or absent (zero)
    std::span<const int64_t> cu_seqlens;  // [N + 1] or empty (each batch row is a sequence)
};

struct KdaGrads {
    TensorView dq, dk, dv, dg, dbeta, dh0;  // shaped like the inputs; absent ones are skipped
};

// The states entering every chunk (chunk mode): [total chunks over all sequences, HV, K, V]. A
// forward that saves them spares its backward the recomputed forward state pass.
Shape kda_saved_states_shape(const KdaParams& p, const KdaInputs& in);

// backward_with_saved_states: the backward will be given the forward's saved states.
size_t kda_workspace_bytes(
    const KdaParams& p, const KdaInputs& in, bool backward, int num_threads, bool backward_with_saved_states = false);

// A bound of kda_workspace_bytes over every packing of the B·T tokens into sequences of at most
// max_len tokens (for callers that size memory before they know the document boundaries).
size_t kda_workspace_bound(const KdaParams& p,
                           const KdaInputs& shapes,
                           int64_t max_len,
                           bool backward,
                           int num_threads,
                           bool backward_with_saved_states = false);

// o: [B, T, HV, V]; ht: [N, HV, K, V] or absent; saved_states: see above, or absent.
void kda_forward(const KdaParams& p,
                 const KdaInputs& in,
                 TensorView o,
                 TensorView ht,
                 std::span<std::byte> ws,
                 TensorView saved_states = {});
// dout: [B, T, HV, V] or absent; dht: [N, HV, K, V] or absent; saved_states: from kda_forward, or absent
// (then recomputed).
void kda_backward(const KdaParams& p,
                  const KdaInputs& in,
                  TensorView dout,
                  TensorView dht,
                  const KdaGrads& grads,
                  std::span<std::byte> ws,
                  TensorView saved_states = {});

// Forward FLOPs per value head of the chunk algorithm, as the Kimi Linear paper counts them
// (Eq. 13, K = V = d): T·(6d² + 3Cd + C²).
double kda_forward_flops(int64_t tokens, int64_t value_heads, int64_t d, int64_t chunk_size);

}  // namespace tessera::ops
