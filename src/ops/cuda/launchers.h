// Kernel launchers of the CUDA backend: raw pointers, counts, row strides and a stream; no tessera types, so
// .cu files compile without the C++ core headers (only the plain host/device row headers: core/mix64.h,
// ops/router_rows.h, ops/attention_tiles.h). Each returns the launch status. Matrices are row-major
// [rows, cols] with row stride ld (in elements). T is float or double: the f64 instantiations run the golden
// checks at the CPU oracle's f64 tolerance.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attention_tiles.h"
#include "ops/router_rows.h"

namespace tessera::ops::cuda {

// The scalars of one AdamW step, precomputed on the host (see ops/adamw.h for the math), in the tensors' type.
template <class T>
struct AdamWScalars {
    T decay;  // 1 - lr * weight_decay
    T one_minus_beta1;
    T beta2;
    T one_minus_beta2;
    T step_size;              // lr / (1 - beta1^step)
    T bias_correction2_sqrt;  // sqrt(1 - beta2^step)
    T eps;
};

template <class T>
cudaError_t launch_adamw(T* param, const T* grad, T* m, T* v, int64_t n, AdamWScalars<T> s, cudaStream_t stream);
// The optimizer's vector passes (ops/adamw.h): out[k] = Σ x² over chunk k in double (a block per chunk, fixed tree
// order); x *= factor; dst += src.
cudaError_t launch_sum_squares(const float* x, int64_t n, int64_t chunk, double* out, cudaStream_t stream);
cudaError_t launch_scale_vector(float* x, int64_t n, float factor, cudaStream_t stream);
cudaError_t launch_add_vector(const float* src, float* dst, int64_t n, cudaStream_t stream);
// The reductions of the communication API (parallel/comm.h): out[i] = Σ_r parts[r·count + i] over r = 0, 1, ... in
// order (accumulate: out[i] + parts[i] + ...), the CPU's order exactly.
template <class T>
cudaError_t launch_sum_blocks(const T* parts, int blocks, int64_t count, T* out, bool accumulate, cudaStream_t stream);

// The weight and bias gradients' column sums run over slabs of this many rows, then add the slabs in order
// (kernel_util.cuh: column_sums_in_slabs); the caller gives column_slab_elements(rows, cols, terms) elements of
// device scratch for the slabs' sums.
constexpr int64_t kColumnSlabRows = 256;
inline int64_t column_slabs(int64_t rows) { return rows < 1 ? 1 : (rows + kColumnSlabRows - 1) / kColumnSlabRows; }
inline int64_t column_slab_elements(int64_t rows, int64_t cols, int terms) { return column_slabs(rows) * cols * terms; }

// A row-major matrix view: element (r, c) at data[r * ld + c].
template <class T>
struct RowsArg {
    T* data;
    int64_t rows, cols, ld;
};

// RMSNorm (ops/rmsnorm.h): one block per row, the row's sum of squares in double, reduced in a fixed order.
template <class T>
cudaError_t launch_rmsnorm_forward(
    RowsArg<const T> x, const T* w, RowsArg<T> y, T* rstd, double eps, cudaStream_t stream);
// dx += ... (dx.data may be null: skipped); dw += Σ_n dy∘x̂ (dw may be null), each column summed over row slabs
// (column_slab_elements(rows, cols, 1) of scratch in `slabs`).
template <class T>
cudaError_t launch_rmsnorm_backward(RowsArg<const T> dy,
                                    RowsArg<const T> x,
                                    const T* w,
                                    const T* rstd,
                                    RowsArg<T> dx,
                                    T* dw,
                                    T* slabs,
                                    cudaStream_t stream);

// LayerNorm (ops/layernorm.h): forward writes mean and rstd per row; backward dx += ... (dx.data may be null),
// dw += Σ_n dy∘x̂ and db += Σ_n dy (both null: frozen), each column summed over row slabs (column_slab_elements(rows,
// cols, 2) of scratch in `slabs`).
template <class T>
cudaError_t launch_layernorm_forward(
    RowsArg<const T> x, const T* w, const T* b, RowsArg<T> y, T* mean, T* rstd, double eps, cudaStream_t stream);
template <class T>
cudaError_t launch_layernorm_backward(RowsArg<const T> dy,
                                      RowsArg<const T> x,
                                      const T* w,
                                      const T* mean,
                                      const T* rstd,
                                      RowsArg<T> dx,
                                      T* dw,
                                      T* db,
                                      T* slabs,
                                      cudaStream_t stream);

// L2 normalisation of rows (ops/l2norm.h); backward accumulates into dx.
template <class T>
cudaError_t launch_l2norm_forward(RowsArg<const T> x, RowsArg<T> y, double eps, cudaStream_t stream);
template <class T>
cudaError_t launch_l2norm_backward(
    RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx, double eps, cudaStream_t stream);

// Gated RMSNorm (ops/gated_rmsnorm.h), act = silu when `silu`, else σ. Backward accumulates into dx, dz (null
// data: skipped) and dw (null: frozen); rstd_work holds x.rows values (each row's rstd, for the dw pass), slabs
// column_slab_elements(rows, cols, 1) (dw's row slabs).
template <class T>
cudaError_t launch_gated_rmsnorm_forward(
    RowsArg<const T> x, RowsArg<const T> z, const T* w, RowsArg<T> y, double eps, bool silu, cudaStream_t stream);
template <class T>
cudaError_t launch_gated_rmsnorm_backward(RowsArg<const T> dy,
                                          RowsArg<const T> x,
                                          RowsArg<const T> z,
                                          const T* w,
                                          RowsArg<T> dx,
                                          RowsArg<T> dz,
                                          T* dw,
                                          T* rstd_work,
                                          T* slabs,
                                          double eps,
                                          bool silu,
                                          cudaStream_t stream);

// SwiGLU (ops/swiglu.h): y = silu(g)·u; backward accumulates dgate and dup.
template <class T>
cudaError_t launch_swiglu_forward(RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream);
template <class T>
cudaError_t launch_swiglu_backward(
    RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du, cudaStream_t stream);

// SiTU-GLU (ops/situ_glu.h): y = G(g)·U(u); backward accumulates dgate and dup.
template <class T>
cudaError_t launch_situ_glu_forward(
    double beta, double linear_beta, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream);
template <class T>
cudaError_t launch_situ_glu_backward(double beta,
                                     double linear_beta,
                                     RowsArg<const T> dy,
                                     RowsArg<const T> g,
                                     RowsArg<const T> u,
                                     RowsArg<T> dg,
                                     RowsArg<T> du,
                                     cudaStream_t stream);

// The KDA forget gate (ops/kda_gate.h) on contiguous [N, HV, K] f, g; A_log [HV], dt_bias [HV·K]. Backward
// accumulates into df, dA_log and ddt_bias (each may be null), both summed over token slabs in double in a fixed
// order; slabs_work holds column_slab_elements(N, HV·K, 2) doubles.
template <class T>
cudaError_t launch_kda_gate_forward(const T* f,
                                    const T* A_log,
                                    const T* dt_bias,
                                    T* g,
                                    int64_t N,
                                    int64_t HV,
                                    int64_t K,
                                    double lower_bound,
                                    cudaStream_t stream);
template <class T>
cudaError_t launch_kda_gate_backward(const T* dg,
                                     const T* f,
                                     const T* A_log,
                                     const T* dt_bias,
                                     T* df,
                                     T* dA_log,
                                     T* ddt_bias,
                                     int64_t N,
                                     int64_t HV,
                                     int64_t K,
                                     double lower_bound,
                                     double* slabs_work,
                                     cudaStream_t stream);

// A [B, T, H, D] view with D contiguous: element (b, t, h, d) at data[b·sb + t·st + h·sh + d].
template <class T>
struct HeadsArg {
    T* data;
    int64_t sb, st, sh;
};

// RoPE (ops/rope.h): dst (+)= m·R(sign·angle)·src with angle = (offset + t)·inv_freq[i] (inv_freq: D/2 values in
// device memory).
struct RopeShape {
    int64_t B, T, H, D, offset;
    bool interleaved, accumulate;
    double m, sign;
};
template <class T>
cudaError_t launch_rope(
    RopeShape s, const double* inv_freq, HeadsArg<const T> src, HeadsArg<T> dst, cudaStream_t stream);

// Flash-style attention (ops/attention.h, plan: ops/attention_tiles.h). lse and delta are [B, H, T] contiguous;
// q, o, dout, dq [B, T, H, D]; k, v, dk, dv [B, T, HKV, D]. A plan is the tile list (device memory), its length,
// the rows per block, the other side's chunk and the block's dynamic shared memory: chunk 0 runs the scalar kernels
// (a thread per row, T = f32 or f64), a chunk > 0 the tensor-core ones of that AttnTcLayout (f32 data, bf16
// operands: train.precision = bf16). Backward accumulates into dq, dk, dv; delta is its scratch (B·H·T values).
struct AttnShape {
    int64_t B, T, H, HKV, D;
    double scale;
    bool causal;
};
struct AttnPlan {
    const AttnTile* list;
    int64_t tiles, rows, chunk;
    size_t smem;
};
template <class T>
cudaError_t launch_attention_forward(AttnShape s,
                                     AttnPlan plan,
                                     HeadsArg<const T> q,
                                     HeadsArg<const T> k,
                                     HeadsArg<const T> v,
                                     HeadsArg<T> o,
                                     T* lse,
                                     cudaStream_t stream);
template <class T>
cudaError_t launch_attention_backward(AttnShape s,
                                      AttnPlan queries,
                                      AttnPlan keys,
                                      HeadsArg<const T> dout,
                                      HeadsArg<const T> q,
                                      HeadsArg<const T> k,
                                      HeadsArg<const T> v,
                                      HeadsArg<const T> o,
                                      const T* lse,
                                      T* delta,
                                      HeadsArg<T> dq,
                                      HeadsArg<T> dk,
                                      HeadsArg<T> dv,
                                      cudaStream_t stream);

// DSA's lightning indexer with its top-k (ops/dsa.h): q [B, T, HI, DI], k [B, T, DI], w [B, T, HI], indices and
// scores [B, T, topk], contiguous; cu: the `segments` + 1 sequence offsets of a packed row (device memory), or
// null. The block's candidate list holds P = indexer_list_size(topk) entries. Without `keys` the scores are exact;
// with it (f32 only: device memory of indexer_bf16_keys_bytes for the rounded keys) they run on tensor cores with q
// and k rounded to bf16, f32 sums.
struct IndexerShape {
    int64_t B, T, HI, DI, topk, P, segments;
};
int64_t indexer_list_size(int64_t topk);
size_t indexer_smem(int64_t HI, int64_t DI, int64_t topk, size_t elem, bool tensor_cores);
size_t indexer_bf16_keys_bytes(int64_t B, int64_t T, int64_t DI);
template <class T>
cudaError_t launch_dsa_indexer(IndexerShape s,
                               const int64_t* cu,
                               const T* q,
                               const T* k,
                               const T* w,
                               void* keys,
                               int32_t* indices,
                               T* scores,
                               cudaStream_t stream);

// The dense warm-up's selection (ops/dsa.h dsa_all_candidates): indices [B, T, K] i32, every s <= t of t's sequence
// ascending, then −1; cu as for the indexer.
cudaError_t launch_dsa_all_candidates(
    int32_t* indices, int64_t B, int64_t T, int64_t K, const int64_t* cu, int64_t segments, cudaStream_t stream);

// The indexer's KL loss (ops/dsa.h): q [B, T, HI, DI], k [B, T, DI], w [B, T, HI]; p [B, T, K] over the selected
// entries idx [B, T, K] (K > 0), or p [B, T, T] over every candidate (K = 0, idx null; cu: the `segments` + 1
// offsets of a packed row in device memory, or null). The row pass writes per query its KL, lse and Σp (double)
// and whether it has support; backward (g = dloss / rows) accumulates into dq, dk, dw, with acc the dk slabs'
// scratch (slabs·B·T·DI values).
struct KlShape {
    int64_t B, T, HI, DI, K, segments;
    bool bf16 = false;  // the head dots on tensor cores, q and k rounded to bf16 (f32 only)
};
struct KlRows {
    double *kl, *lse, *psum;
    int32_t* has;
};
size_t indexer_kl_smem(KlShape s, size_t elem);  // the gradient kernels' dynamic shared memory
template <class T>
cudaError_t launch_indexer_kl_rows(KlShape s,
                                   const int64_t* cu,
                                   const T* q,
                                   const T* k,
                                   const T* w,
                                   const T* p,
                                   const int32_t* idx,
                                   KlRows rows,
                                   cudaStream_t stream);
template <class T>
cudaError_t launch_indexer_kl_backward(KlShape s,
                                       int64_t slabs,
                                       const int64_t* cu,
                                       const T* q,
                                       const T* k,
                                       const T* w,
                                       const T* p,
                                       const int32_t* idx,
                                       KlRows rows,
                                       double g,
                                       T* acc,
                                       T* dq,
                                       T* dk,
                                       T* dw,
                                       cudaStream_t stream);

// DSA's sparse MQA attention (ops/dsa.h): q [B, T, H, DK], kv [B, T, DK], indices [B, T, K] i32, o [B, T, H, DV],
// lse [B, T, H], all contiguous; DV <= 512 and DK <= 640. Backward accumulates into dq and dkv; its scratch: delta
// (B·T·H values), acc (slabs·B·T·DK values) and sorted (B·T bytes). bf16 (f32 only): every kernel on tensor cores,
// operands rounded to bf16 (the forward's probabilities too, for P·V), f32 sums.
struct SparseShape {
    int64_t B, T, H, DK, DV, K;
    double scale;
};
constexpr int64_t kSparseMaxDV = 512, kSparseMaxDK = 640;
size_t sparse_attention_smem(SparseShape s, size_t elem);  // the most shared memory one of its kernels takes
template <class T>
cudaError_t launch_sparse_attention_forward(
    SparseShape s, const T* q, const T* kv, const int32_t* idx, T* o, T* lse, bool bf16, cudaStream_t stream);
template <class T>
cudaError_t launch_sparse_attention_probs(
    SparseShape s, const T* q, const T* kv, const int32_t* idx, const T* lse, T* probs, bool bf16, cudaStream_t stream);
template <class T>
cudaError_t launch_sparse_attention_backward(SparseShape s,
                                             int64_t slabs,
                                             const T* dout,
                                             const T* q,
                                             const T* kv,
                                             const int32_t* idx,
                                             const T* o,
                                             const T* lse,
                                             T* delta,
                                             T* acc,
                                             uint8_t* sorted,
                                             T* dq,
                                             T* dkv,
                                             bool bf16,
                                             cudaStream_t stream);

// Decoding (ops/decode.h). cached_attention: q [B, H, D], keys/values [B, L, HKV, D|DV] and o [B, H, DV] by their
// strides (elements; last dims contiguous), rows [B, n] i32 or null (every s < len); z: B·H·n doubles of scratch,
// cached_index_topk: q [B, HI, DI], w [B, HI], keys [B, L, DI] by strides, rows [B, topk] i32; score, pos and
// score2, pos2 (the merge levels alternate between them): B·tiles·tile values of scratch each.
struct CachedAttentionArgs {
    const float *q, *keys, *values;
    const int32_t* rows;
    float* o;
    int64_t B, H, HKV, D, DV, n, len;
    int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1;
    double scale;
};
// part: B·H·cached_attention_splits(n)·(2 + DV) doubles of scratch (each split's max, sum and weighted values).
constexpr int64_t kSplitEntries = 512;  // entries per split
int64_t cached_attention_splits(int64_t n);
cudaError_t launch_cached_attention(const CachedAttentionArgs& a, double* z, double* part, cudaStream_t stream);
struct CachedIndexArgs {
    const float *q, *w, *keys;
    int32_t* rows;
    int64_t B, HI, DI, len, topk;
    int64_t tile, tiles;  // 2·(the power of two ≥ topk) positions a tile; the power of two ≥ len / tile of them
    int64_t qs0, qs1, ws0, ws1, ks0, ks1;
};
cudaError_t launch_cached_index_topk(
    const CachedIndexArgs& a, float* score, int32_t* pos, float* score2, int32_t* pos2, cudaStream_t stream);

// KDA (ops/kda.h) as a fused token recurrence: one block per (sequence, value head) unit = seq·HV + i. Tensors
// contiguous as ops/kda.h shapes them; the sequences as a table in device memory (first token in the flattened
// B·T axis, length, index of its first chunk of C tokens among all sequences'). saved (forward, may be null): the
// states entering every chunk [total chunks, HV, K, V]; backward reads them from ckpt and needs `states` scratch
// of units·((C + 1)·K·V + C·V) values (a chunk's states and its tokens' u); its dq, dk are per value head
// ([tokens, HV, K]) when HV > H. Backward accumulates into the gradients that are not null.
struct KdaShape {
    int64_t H, HV, K, V, C;
    double scale;
    bool bf16 = false;  // the chunked kernels' block products on tensor cores, operands rounded to bf16 (f32 only)
};
struct KdaSeq {
    int64_t first, len, chunk0;
};
template <class T>
struct KdaTensors {
    const T *q, *k, *v, *g, *beta, *h0;
};
template <class T>
struct KdaGradPtrs {
    T *dq, *dk, *dv, *dg, *dbeta, *dh0;
};
// Dynamic shared memory per block (the caller checks it against the device's limit). Backward runs a thread per
// value column: V <= kKdaBackwardMaxV (its registers bound the block).
constexpr int64_t kKdaBackwardMaxV = 256;
size_t kda_forward_smem(int64_t K, int64_t V, size_t elem);
size_t kda_backward_smem(int64_t K, int64_t V, size_t elem);
template <class T>
cudaError_t launch_kda_forward(
    KdaShape s, const KdaSeq* seqs, int64_t units, KdaTensors<T> in, T* o, T* ht, T* saved, cudaStream_t stream);
template <class T>
cudaError_t launch_kda_backward(KdaShape s,
                                const KdaSeq* seqs,
                                int64_t units,
                                KdaTensors<T> in,
                                const T* dout,
                                const T* dht,
                                const T* ckpt,
                                T* states,
                                KdaGradPtrs<T> gr,
                                cudaStream_t stream);

// dst[t, h] += Σ_{i in h's group, ascending} src[t, i] over [tokens, HV = H·G, K] src (the CPU's reduce_value_heads):
// the dq, dk of GVA, computed per value head first.
template <class T>
cudaError_t launch_kda_sum_value_heads(
    int64_t tokens, int64_t H, int64_t G, int64_t K, const T* src, T* dst, cudaStream_t stream);

// KDA's chunked algorithm (ops/cuda/kda_chunk.cu). The geometry: the sequence table as above, each global chunk's
// sequence (chunk_seq, [total_chunks] in device memory) and the window: how many global chunks are in flight at once.
// `slots` holds window·HV·kda_chunk_slot_elements(C, K, V, backward) values; `states` the states entering every
// chunk [total_chunks, HV, K, V] (forward writes them; backward reads them when states_known, else writes them).
// Backward's carry holds sequences·HV·K·V values; dq, dk are per value head when qk_heads = HV > H (then summed by
// launch_kda_sum_value_heads) and otherwise rows of H heads. o may be null (states only).
struct KdaChunkGeometry {
    const KdaSeq* seqs;
    const int64_t* chunk_seq;
    int64_t sequences, total_chunks, window;
};
int64_t kda_chunk_slot_elements(int64_t C, int64_t K, int64_t V, bool backward);
// Dynamic shared memory of the scans' blocks.
size_t kda_chunk_scan_smem(int64_t K, int64_t V, size_t elem);
template <class T>
cudaError_t launch_kda_chunk_forward(
    KdaShape s, const KdaChunkGeometry& geo, KdaTensors<T> in, T* o, T* ht, T* states, T* slots, cudaStream_t stream);
template <class T>
cudaError_t launch_kda_chunk_backward(KdaShape s,
                                      const KdaChunkGeometry& geo,
                                      KdaTensors<T> in,
                                      const T* dout,
                                      const T* dht,
                                      T* states,
                                      bool states_known,
                                      KdaGradPtrs<T> gr,
                                      int64_t qk_heads,
                                      T* slots,
                                      T* carry,
                                      cudaStream_t stream);

// Causal depthwise conv1d (ops/causal_conv1d.h) on contiguous [tokens, C] rows, w [C, W]. Sequences: batch rows of
// T tokens (cu null) or the `segments` packed sequences of cu ([segments + 1] offsets in device memory).
// Backward accumulates into dx and dw (either null: skipped); it needs W <= kConvMaxWidth, and for dw
// column_slab_elements(tokens, C, W) elements of scratch in `slabs`.
constexpr int64_t kConvMaxWidth = 16;
struct ConvShape {
    int64_t tokens, T, C, W;
    const int64_t* cu;
    int64_t segments;
    bool silu;
};
template <class T>
cudaError_t launch_conv1d_forward(ConvShape s, const T* x, const T* w, T* y, cudaStream_t stream);
template <class T>
cudaError_t launch_conv1d_backward(
    ConvShape s, const T* dy, const T* x, const T* w, T* dx, T* dw, T* slabs, cudaStream_t stream);
// One decoding step (ops/causal_conv1d.h, causal_conv1d_step), f32: x, y [B, C], window [B, W−1, C].
cudaError_t launch_conv1d_step(int64_t B,
                               int64_t C,
                               int64_t W,
                               bool silu,
                               const float* x,
                               const float* w,
                               float* window,
                               float* y,
                               cudaStream_t stream);

// LoRA's dropout (ops/lora.h): the mask of (seed, stream) at drop probability p, counter n·cols + i per element.
struct DropoutArg {
    uint64_t seed, stream;
    double p, scale;  // scale: 1 / (1 − p)
};
// xd [rows, cols] (contiguous) = x ⊙ m · scale
template <class T>
cudaError_t launch_dropout_rows(RowsArg<const T> x, T* xd, DropoutArg d, cudaStream_t stream);
// dx += g ⊙ m · scale, g [rows, cols] contiguous
template <class T>
cudaError_t launch_masked_add(const T* g, RowsArg<T> dx, DropoutArg d, cudaStream_t stream);

// Attention Residuals mixing (ops/attn_res.h): S <= kAttnResMaxSources sources [N, C] (contiguous), by pointer.
// Backward accumulates into the source gradients and into dg and dw (both null: frozen); ds_rs holds 2·N·S values
// (each token's ds_i, then its r_i), slabs column_slab_elements(N, C, 1) (dg's and dw's row slabs).
constexpr int64_t kAttnResMaxSources = 64;
template <class T>
struct MixArg {
    const T* src[kAttnResMaxSources];
    int64_t S, N, C;
};
template <class T>
struct MixGradArg {
    T* dsrc[kAttnResMaxSources];
};
template <class T>
cudaError_t launch_attn_res_forward(
    MixArg<T> m, const T* g, const T* w, T* out, T* probs, double eps, cudaStream_t stream);
template <class T>
cudaError_t launch_attn_res_backward(MixArg<T> m,
                                     const T* dout,
                                     const T* g,
                                     const T* w,
                                     const T* probs,
                                     MixGradArg<T> dm,
                                     T* dg,
                                     T* dw,
                                     T* ds_rs,
                                     T* slabs,
                                     double eps,
                                     cudaStream_t stream);

// The MoE router (ops/router.h), one thread per token: scores = softmax or σ of the logits; top-k selection with
// gate weights and counts per expert (zeroed first); the gate weights of given indices; dscores += through the
// gate weights; dlogits += through the score function. scores, indices, weights contiguous.
template <class T>
cudaError_t launch_router_scores(RowsArg<const T> logits, RowsArg<T> scores, bool softmax, cudaStream_t stream);
template <class T>
cudaError_t launch_router_select(RouterRowParams p,
                                 const T* scores,
                                 const T* bias,
                                 int64_t N,
                                 int64_t E,
                                 int32_t* indices,
                                 T* weights,
                                 int32_t* counts,
                                 cudaStream_t stream);
template <class T>
cudaError_t launch_router_weights(RouterRowParams p,
                                  const T* scores,
                                  const int32_t* indices,
                                  T* weights,
                                  int64_t N,
                                  int64_t E,
                                  int64_t K,
                                  cudaStream_t stream);
template <class T>
cudaError_t launch_router_weights_backward(RouterRowParams p,
                                           const T* dweights,
                                           const T* scores,
                                           const int32_t* indices,
                                           T* dscores,
                                           int64_t N,
                                           int64_t E,
                                           int64_t K,
                                           cudaStream_t stream);
template <class T>
cudaError_t launch_router_score_backward(
    RowsArg<const T> scores, RowsArg<const T> dscores, RowsArg<T> dlogits, bool softmax, cudaStream_t stream);

// The router's aux losses (ops/router.h), in double. scores [N, E] and indices [N, K] contiguous; starts: the
// sequences' (or, for the balance statistics, {0, N}) token offsets in device memory; z: N doubles of scratch.
template <class T>
struct RouterAuxArgs {
    const T* scores;
    const int32_t* indices;
    const int64_t* starts;
    double* z;
    int64_t N, E, K;
};
// choices[e] += the choices of e, prob_sums[e] += Σ_t ŝ_e (device copies of the host sums)
template <class T>
cudaError_t launch_router_balance_stats(RouterAuxArgs<T> a, double* choices, double* prob_sums, cudaStream_t stream);
template <class T>
cudaError_t launch_router_balance_backward(RouterAuxArgs<T> a, const double* grad, T* dscores, cudaStream_t stream);
// Per sequence q: f, P [nseq, E] (contiguous, P right after f) and ls[q] = Σ_e f·P; dscores (may be null) += the
// gradient of α·mean_q ls.
template <class T>
cudaError_t launch_router_seq_aux(
    RouterAuxArgs<T> a, int64_t nseq, double alpha, double* f, double* P, double* ls, T* dscores, cudaStream_t stream);
// lse[t] of each row; dlogits (may be null) += the z-loss's gradient.
template <class T>
cudaError_t launch_router_z_loss(RowsArg<const T> logits, double beta, double* lse, T* dlogits, cudaStream_t stream);

// y[r, :] += b; db += Σ_r dy[r, :] (each column over row slabs: column_slab_elements(rows, cols, 1) in `slabs`).
template <class T>
cudaError_t launch_add_bias(RowsArg<T> y, const T* b, cudaStream_t stream);
template <class T>
cudaError_t launch_column_sums(RowsArg<const T> dy, T* db, T* slabs, cudaStream_t stream);

// Integer ids (i32 when ids32, else i64) checked against [0, limit), except those equal to `except`: the first bad
// position is written to *bad (which must hold INT64_MAX before the launch).
cudaError_t launch_check_ids(
    const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad, cudaStream_t stream);

// Embedding (ops/embedding.h). Forward copies rows of `row_bytes`; the bf16 variant widens to f32. Backward:
// dtable[ids[n]] += dy[n] by the tokens sorted by id (stable, on the host): segs holds `segments` ids, then their
// segments + 1 starts in pos (the token positions); a thread per (segment, column) adds its tokens' rows in token
// order, the CPU's order, so the same bits.
cudaError_t launch_embedding_forward(
    const void* ids, bool ids32, int64_t n, const void* table, int64_t row_bytes, void* y, cudaStream_t stream);
cudaError_t launch_embedding_forward_bf16(
    const void* ids, bool ids32, int64_t n, const uint16_t* table, int64_t d, float* y, cudaStream_t stream);
// Narrow values widened to f32 (exactly): a frozen weight's rows for the f32 GEMMs (linear). bf16: n values; MXFP4:
// the held values index..index+n-1 of `blocks` (core/mxfp4.h).
cudaError_t launch_widen_bf16(const uint16_t* src, int64_t n, float* dst, cudaStream_t stream);
// n f32 values rounded to bf16 as launch_round_bf16 rounds (ops::cast: saved activations held narrow); in place, kept
// f32 (ops::round_to_bf16).
cudaError_t launch_narrow_bf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream);
cudaError_t launch_round_to_bf16(float* x, int64_t n, cudaStream_t stream);
// (MXFP4: into f32 values, or bf16 ones, exactly too)
cudaError_t launch_widen_mxfp4(
    const uint8_t* blocks, int64_t index, int64_t n, bool to_bf16, void* dst, cudaStream_t stream);
// f32 matrices rounded to bf16 (to nearest even, as core/dtype.h's float_to_bf16; NaN stays NaN) into copies, one
// launch for a table of them in device memory: piece i's `cols` runs of `len` values, apart by `ld` in src, go to
// dst[c·dst_ld + r] (a GEMM operand at bf16 precision; ops/gemm.h, GemmPrecision).
struct Bf16Piece {
    const float* src;
    uint16_t* dst;
    int64_t cols, len, ld, dst_ld;
};
cudaError_t launch_round_bf16(const Bf16Piece* pieces, int64_t count, int64_t max_elements, cudaStream_t stream);
template <class T>
cudaError_t launch_embedding_backward(
    const T* dy, const int64_t* pos, const int64_t* segs, int64_t segments, int64_t d, T* dtable, cudaStream_t stream);

// Cross-entropy (ops/cross_entropy.h). Forward: lse per row and, in `totals` ([2] doubles: the loss sum over
// counted rows, the count), reduced in a fixed order. Backward accumulates into dx with scale = dloss / count.
template <class T>
cudaError_t launch_cross_entropy_forward(RowsArg<const T> x,
                                         const void* targets,
                                         bool targets32,
                                         int64_t ignore_index,
                                         T* lse,
                                         double* row_loss,
                                         double* totals,
                                         cudaStream_t stream);
// The rows that count (targets not ignore_index) into totals[1] (totals[0] = 0), as forward counts them.
cudaError_t launch_count_targets(
    const void* targets, bool targets32, int64_t ignore_index, int64_t rows, double* totals, cudaStream_t stream);
template <class T>
cudaError_t launch_cross_entropy_backward(RowsArg<const T> x,
                                          const void* targets,
                                          bool targets32,
                                          int64_t ignore_index,
                                          const T* lse,
                                          T scale,
                                          RowsArg<T> dx,
                                          cudaStream_t stream);

// The row glue ops (ops/rows.h), f32: d = scale·s; d += s; y = σ(x); dx += dy·y(1−y); d[n, g·K + k] = s[n, g];
// d[n, g] = Σ_k s[n, g·K + k]; the output gate y = o·σ(z) per group of `per` and its backward.
cudaError_t launch_scale_rows(RowsArg<const float> s, float scale, RowsArg<float> d, cudaStream_t stream);
cudaError_t launch_add_rows(RowsArg<const float> s, RowsArg<float> d, cudaStream_t stream);
// Block copies (ops/rows.h: copy_blocks): `table` on the device, (from, to, n) per block; a CUDA block per copy block.
cudaError_t launch_copy_blocks(const float* src, float* dst, const int64_t* table, int64_t blocks, cudaStream_t stream);
cudaError_t launch_sigmoid_forward(RowsArg<const float> x, RowsArg<float> y, cudaStream_t stream);
cudaError_t launch_sigmoid_backward(RowsArg<const float> dy,
                                    RowsArg<const float> y,
                                    RowsArg<float> dx,
                                    cudaStream_t stream);
cudaError_t launch_expand_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream);
cudaError_t launch_sum_groups(RowsArg<const float> s, RowsArg<float> d, int64_t K, cudaStream_t stream);
cudaError_t launch_output_gate_forward(RowsArg<const float> z,
                                       RowsArg<const float> o,
                                       RowsArg<float> gate,
                                       RowsArg<float> y,
                                       int64_t per,
                                       cudaStream_t stream);
cudaError_t launch_output_gate_backward(RowsArg<const float> dy,
                                        RowsArg<const float> o,
                                        RowsArg<const float> gate,
                                        RowsArg<float> dov,
                                        RowsArg<float> dz,
                                        int64_t per,
                                        cudaStream_t stream);

// The MoE layer's row kernels (ops/cuda/moe.cu): rows [R, W] contiguous in the expert-contiguous layout, row [N, K]
// each (token, slot) pair's row (−1: dropped). dispatch: rows[row(n, j)] = src[n]; combine: dst[n] (+)= Σ_j
// rows[row(n, j)] in slot order; row_gate: zeroed over R rows, then row_gate[row(i)] = gates[i]; gated_act:
// a = row_gate·act(h) for h [R, 2F] = [gate | up] (act SiTU-GLU with β, β_lin when situ_act, else SwiGLU) and its
// backward (dot[r] = ⟨act(h_r), da_r⟩, dh written); gate_grads: dg[i] = dot[row(i)] or 0; the shared-expert gate
// g = σ(g) in place then a[n] *= g[n], and its backward du[n] = (1 − g[n])⟨da_n, a_n⟩, da_n *= g[n]; each token's
// routing entropy −Σ p log p (p = s / Σ s) in double.
template <class T>
cudaError_t launch_moe_dispatch(RowsArg<const T> src, const int32_t* row, int64_t K, T* rows, cudaStream_t stream);
template <class T>
cudaError_t launch_moe_combine(
    const T* rows, const int32_t* row, int64_t K, RowsArg<T> dst, bool accumulate, cudaStream_t stream);
template <class T>
cudaError_t launch_moe_row_gate(
    const int32_t* row, const T* gates, int64_t pairs, T* row_gate, int64_t R, cudaStream_t stream);
template <class T>
cudaError_t launch_moe_gated_act(bool situ_act,
                                 double beta,
                                 double linear_beta,
                                 const T* h,
                                 const T* row_gate,
                                 T* a,
                                 int64_t R,
                                 int64_t F,
                                 cudaStream_t stream);
template <class T>
cudaError_t launch_moe_gated_act_backward(bool situ_act,
                                          double beta,
                                          double linear_beta,
                                          const T* h,
                                          const T* da,
                                          const T* row_gate,
                                          T* dot,
                                          T* dh,
                                          int64_t R,
                                          int64_t F,
                                          cudaStream_t stream);
template <class T>
cudaError_t launch_moe_gate_grads(const int32_t* row, const T* dot, T* dg, int64_t pairs, cudaStream_t stream);
template <class T>
cudaError_t launch_moe_shared_scale_forward(T* g, T* a, int64_t N, int64_t F, cudaStream_t stream);
template <class T>
cudaError_t launch_moe_shared_scale_backward(
    const T* g, const T* a, T* da, T* du, int64_t N, int64_t F, cudaStream_t stream);
template <class T>
cudaError_t launch_routing_entropy(RowsArg<const T> scores, double* out, cudaStream_t stream);

// The image tower's ops (ops/vision.h; vision.cu).
// GELU, exact (erf) or PyTorch's tanh form; backward dx += gelu'(x)·dy.
template <class T>
cudaError_t launch_gelu_forward(bool tanh_form, RowsArg<const T> x, RowsArg<T> y, cudaStream_t stream);
template <class T>
cudaError_t launch_gelu_backward(
    bool tanh_form, RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx, cudaStream_t stream);
// 2-D RoPE over [N, H, D] views (src.st / dst.st: the patch stride, .sh: the head stride; sb unused): pair i of patch n
// turns by sign·(i even ? col : row)·freq[i / 2], colrow [N, 2] (column, row of each patch), freq D/4 values.
template <class T>
cudaError_t launch_rope_2d(HeadsArg<const T> src,
                           HeadsArg<T> dst,
                           int64_t N,
                           int64_t H,
                           int64_t D,
                           const int32_t* colrow,
                           const double* freq,
                           double sign,
                           bool accumulate,
                           cudaStream_t stream);
// The position table's four taps of each patch (cells of the [Ht·Wt, C] table and their weights, in the CPU's order:
// (r0, c0), (r0, c1), (r1, c0), (r1, c1)). Forward x[n] += Σ w·table[cell]; backward dtable[cell] += w·dx[n], one
// thread per column walking the patches in order.
struct PosTaps {
    int64_t cell[4];
    double w[4];
};
template <class T>
cudaError_t launch_pos_embed_forward(const PosTaps* taps, const T* table, RowsArg<T> x, cudaStream_t stream);
template <class T>
cudaError_t launch_pos_embed_backward(const PosTaps* taps, RowsArg<const T> dx, T* dtable, cudaStream_t stream);
// Rows moved by an index: segment i of `wide` is row i / per of it at column (i % per)·cols (per = 1: whole rows).
// gather: wide segment i = narrow row idx[i]; scatter_add: narrow row idx[i] += wide segment i (idx distinct);
// scatter: narrow row idx[i] = wide segment i; zero: narrow row idx[i] = 0. n segments of `cols` values.
enum class RowMove : int { gather, scatter_add, scatter, zero };
template <class T>
cudaError_t launch_move_rows(RowMove how,
                             RowsArg<T> narrow,
                             RowsArg<T> wide,
                             int64_t per,
                             const int64_t* idx,
                             int64_t n,
                             int64_t cols,
                             cudaStream_t stream);

}  // namespace tessera::ops::cuda
