// DeepSeek Sparse Attention ops (spec/dsa.md §2–§3): the lightning indexer with streaming top-k,
// sparse attention in MLA's MQA mode, and the indexer's KL loss.
//
// dsa_indexer: I[t,s] = Σ_j w[t,j]·relu(q[t,j]·k[s]) for the candidates s of t (s ≤ t, within t's
//   sequence when cu_seqlens packs several, B = 1). Selection: the min(topk, candidates) best under the
//   total order (higher I first, ties to the larger s), written in ascending s, padded with −1; scores
//   holds the selected I (0 at padding). Key blocks stream through a running top-k, so no [T, T]
//   matrix exists; I is a pure function of (t, s) (fixed tiles, fixed sums), so the selection does not
//   depend on the thread count. At GemmPrecision::bf16 (ops/gemm.h) f32 scores are a bf16 GEMM's: q and k
//   rounded to bf16, f32 sums (tensor cores on the GPU). Shapes: q [B,T,HI,DI], k [B,T,DI], w [B,T,HI],
//   indices/scores [B,T,K].
// sparse_attention: for each query t and head h over the valid entries s of indices[t] (−1 or ≥ T
//   are skipped): z = scale·q[t,h]·kv[s], o[t,h] = Σ softmax(z)·kv[s][:dv], lse = ln Σ exp z (natural
//   log); a query with no valid entry gets o = 0 and lse = +inf. The value is the first dv dims of
//   the same entry (MQA mode). Shapes: q [B,T,H,DK], kv [B,T,DK], indices [B,T,K] i32, o [B,T,H,DV],
//   lse [B,T,H]; all contiguous. Backward (FlashAttention restricted to the selected set) accumulates
//   dq and dkv; the scatter into dkv goes to a fixed number of query slabs (`dkv_slabs`, each a private
//   [T, DK] accumulator) reduced in slab order, so it is deterministic and independent of the thread
//   count (spec/dsa.md §3.7 scheme B).
// indexer_kl: loss = mean over rows with support of KL(p_t ‖ softmax(I_t)) over the support: the
//   valid selected entries (p, indices [B,T,K]) or, without indices, every candidate s ≤ t
//   (p [B,T,T], the dense warm-up). Backward: dI = dloss/N·(π·Σp − p) on the support, then through
//   relu and the weights into dq, dk, dw (accumulated; dk in fixed query slabs like dkv).
// Workspace: each op takes its scratch from the caller (`workspace`, at least `<op>_workspace_bytes` for
// the shapes and the number of OpenMP threads it will run on) and allocates nothing: per-thread tiles
// and candidate lists (the indexer's running top-k holds at most 2·topk per query), and the shared
// slab accumulators of the backward scatters (slabs·B·T·DK for dkv, slabs·B·T·DI for dk).
#pragma once

#include <span>

#include "core/tensor.h"

namespace tessera::ops {

// The selection order (spec/dsa.md §2.2): a higher score first, ties to the more recent (larger) s.
inline bool dsa_ranks_before(double score_a, int64_t s_a, double score_b, int64_t s_b) {
    return score_a > score_b || (score_a == score_b && s_a > s_b);
}

struct DsaIndexerParams {
    int64_t topk = 2048;
};

// q [B, T, HI, DI]
size_t dsa_indexer_workspace_bytes(
    DType dtype, int64_t B, int64_t T, int64_t HI, int64_t DI, int64_t topk, int threads);

void dsa_indexer_forward(const DsaIndexerParams& p,
                         TensorView q,
                         TensorView k,
                         TensorView w,
                         TensorView indices,
                         TensorView scores,
                         std::span<std::byte> workspace,
                         std::span<const int64_t> cu_seqlens = {});

// The dense warm-up's selection (spec/dsa.md §3.1, §3.6): every candidate s of t (s ≤ t within t's sequence),
// ascending, padded with −1, into indices [B, T, K] i32 (K at least the longest sequence). cu_seqlens as for the
// indexer.
void dsa_all_candidates(TensorView indices, std::span<const int64_t> cu_seqlens = {});

struct SparseAttentionParams {
    double scale = 0.0;     // 0: DK^-0.5
    int64_t dv = 0;         // value dims (the first dv of each entry); 0 = DK
    int64_t dkv_slabs = 4;  // backward: fixed query slabs for the dkv scatter (memory slabs·T·DK)
};

// Enough for forward, backward and probs on q [B, T, H, DK], indices [B, T, K].
size_t sparse_attention_workspace_bytes(
    DType dtype, const SparseAttentionParams& p, int64_t B, int64_t T, int64_t H, int64_t DK, int64_t K, int threads);

void sparse_attention_forward(const SparseAttentionParams& p,
                              TensorView q,
                              TensorView kv,
                              TensorView indices,
                              TensorView o,
                              TensorView lse,
                              std::span<std::byte> workspace);
void sparse_attention_backward(const SparseAttentionParams& p,
                               TensorView dout,
                               TensorView q,
                               TensorView kv,
                               TensorView indices,
                               TensorView o,
                               TensorView lse,
                               TensorView dq,
                               TensorView dkv,
                               std::span<std::byte> workspace);

// The indexer's teacher (spec/dsa.md §3.2): p[t, i] = (1/H) Σ_h exp(scale·q[t,h]·kv[s] − lse[t,h]) for the
// valid entries s = indices[t, i] (the head mean of the attention probabilities recomputed from lse),
// 0 at −1 padding and for lonely rows. Shapes as sparse_attention; p [B, T, K].
void sparse_attention_probs(const SparseAttentionParams& p,
                            TensorView q,
                            TensorView kv,
                            TensorView indices,
                            TensorView lse,
                            TensorView probs,
                            std::span<std::byte> workspace);

struct IndexerKlResult {
    double loss = 0.0;  // mean KL over the rows with support
    int64_t rows = 0;   // those rows (N)
};

// q [B, T, HI, DI]; support: the entries per row (TOPK with indices, T dense).
size_t indexer_kl_workspace_bytes(
    DType dtype, int64_t B, int64_t T, int64_t HI, int64_t DI, int64_t support, int64_t dk_slabs, int threads);

// Computes the loss; when dq is given, also accumulates dloss·∂loss/∂(q, k, w) into dq, dk, dw.
IndexerKlResult indexer_kl(TensorView q,
                           TensorView k,
                           TensorView w,
                           TensorView p,
                           TensorView indices,
                           std::span<const int64_t> cu_seqlens,
                           double dloss,
                           TensorView dq,
                           TensorView dk,
                           TensorView dw,
                           std::span<std::byte> workspace,
                           int64_t dk_slabs = 4);

// Forward FLOPs of sparse attention over `pairs` (query, selected key) pairs: 2·H·pairs·(DK + DV).
inline double sparse_attention_flops(int64_t pairs, int64_t H, int64_t DK, int64_t DV) {
    return 2.0 * double(pairs) * double(H) * double(DK + DV);
}

}  // namespace tessera::ops
