// The CUDA backend's op entry points (built with -DTESSERA_CUDA=ON). The backend-neutral entry points
// (the functions the op headers declare) check their arguments and dispatch here when the tensors live on
// Device::cuda (ops/backend.h); the CPU implementations in ops/cpu/ are the oracle these are tested
// against. Work goes to the calling thread's current stream (core/device.h). Plain C++: no CUDA types.
#pragma once

#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/attn_res.h"
#include "ops/causal_conv1d.h"
#include "ops/cross_entropy.h"
#include "ops/decode.h"
#include "ops/dsa.h"
#include "ops/embedding.h"
#include "ops/gated_rmsnorm.h"
#include "ops/kda.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/layernorm.h"
#include "ops/linear.h"
#include "ops/lora.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "ops/moe_balance.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/rows.h"
#include "ops/situ_glu.h"
#include "ops/swiglu.h"
#include "ops/vision.h"

namespace tessera::ops::cuda {

void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v);
void sum_squares_by_chunk(TensorView x, int64_t chunk, std::span<double> out);
void scale_vector(TensorView x, float factor);
void add_vector(TensorView src, TensorView dst);
// out = Σ_r parts[r] (blocks of `count` elements, summed in block order; accumulate: out + parts[0] + ...), for the
// communication API's reductions on device memory (f32, f64, i32, i64).
void sum_blocks(DType dtype, const void* parts, int blocks, int64_t count, void* out, bool accumulate);

// GEMMs through cuBLAS (f32 without TF32, or f64), the bias add and its gradient by own kernels.
void linear_forward(const LinearParams& p, TensorView x, TensorView w, TensorView b, TensorView y);
void linear_backward(TensorView dy, TensorView x, TensorView w, TensorView dx, TensorView dw, TensorView db);

// One strided-batched cuBLAS GEMM over the heads.
void matmul_heads(Trans ta, Trans tb, double alpha, TensorView a, TensorView b, double beta, TensorView c);

void rmsnorm_forward(const RmsNormParams& p, TensorView x, TensorView w, TensorView y, TensorView rstd);
void rmsnorm_backward(
    const RmsNormParams& p, TensorView dy, TensorView x, TensorView w, TensorView rstd, TensorView dx, TensorView dw);

void layernorm_forward(
    const LayerNormParams& p, TensorView x, TensorView w, TensorView b, TensorView y, TensorView mean, TensorView rstd);
void layernorm_backward(const LayerNormParams& p,
                        TensorView dy,
                        TensorView x,
                        TensorView w,
                        TensorView mean,
                        TensorView rstd,
                        TensorView dx,
                        TensorView dw,
                        TensorView db);

void l2norm_forward(const L2NormParams& p, TensorView x, TensorView y);
void l2norm_backward(const L2NormParams& p, TensorView dy, TensorView x, TensorView dx);

void gated_rmsnorm_forward(const GatedRmsNormParams& p, TensorView x, TensorView gate, TensorView weight, TensorView y);
void gated_rmsnorm_backward(const GatedRmsNormParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView gate,
                            TensorView weight,
                            TensorView dx,
                            TensorView dgate,
                            TensorView dweight);

// Flash-style kernels (ops/cuda/attention.cu); the host workspace is not used (the kernels keep their tiles in
// shared memory; backward's Δ and the tile lists live in the thread's device scratch).
void attention_forward(const AttentionParams& p,
                       TensorView q,
                       TensorView k,
                       TensorView v,
                       TensorView o,
                       TensorView lse,
                       std::span<std::byte> workspace,
                       std::span<const int64_t> cu_seqlens);
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
                        std::span<const int64_t> cu_seqlens);

// DSA's lightning indexer and top-k (ops/cuda/dsa_indexer.cu): cu_seqlens copied to the device per call.
void dsa_all_candidates(TensorView indices, std::span<const int64_t> cu_seqlens);
void dsa_indexer_forward(const DsaIndexerParams& p,
                         TensorView q,
                         TensorView k,
                         TensorView w,
                         TensorView indices,
                         TensorView scores,
                         std::span<std::byte> workspace,
                         std::span<const int64_t> cu_seqlens);

// The indexer's KL loss (ops/cuda/indexer_kl.cu): the per-row KL values are read back to sum them on the host in
// row order (one synchronisation per call, as the loss is returned).
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
                           int64_t dk_slabs);

// DSA's sparse attention (ops/cuda/sparse_attention.cu); backward's Δ and dkv slabs live in the thread's device
// scratch, the host workspace is not used.
void sparse_attention_forward(const SparseAttentionParams& p,
                              TensorView q,
                              TensorView kv,
                              TensorView indices,
                              TensorView o,
                              TensorView lse,
                              std::span<std::byte> workspace);
void sparse_attention_probs(const SparseAttentionParams& p,
                            TensorView q,
                            TensorView kv,
                            TensorView indices,
                            TensorView lse,
                            TensorView probs,
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

// The frequencies are computed on the host and copied to the device (scratch) per call.
void rope_forward(const RopeParams& p, TensorView x, TensorView y);
void rope_backward(const RopeParams& p, TensorView dy, TensorView dx);

// Decoding over the caches (ops/cuda/decode.cu): the scores and selection in the thread's device scratch.
void cached_attention(
    double scale, TensorView q, TensorView keys, TensorView values, TensorView rows, int64_t len, TensorView o);
void cached_index_topk(TensorView q, TensorView w, TensorView keys, int64_t len, TensorView rows);

// Mode chunk: the chunked kernels (ops/cuda/kda_chunk.cu); mode recurrent: the fused token recurrence
// (ops/cuda/kda.cu). The host workspace is not used: the sequence and chunk tables, the states entering the chunks
// (unless saved_states holds them), the chunk slots, backward's carried dS and GVA's per-value-head dq, dk live in
// the thread's device scratch.
void kda_forward(
    const KdaParams& p, const KdaInputs& in, TensorView o, TensorView ht, std::span<std::byte> ws, TensorView saved);
void kda_backward(const KdaParams& p,
                  const KdaInputs& in,
                  TensorView dout,
                  TensorView dht,
                  const KdaGrads& grads,
                  std::span<std::byte> ws,
                  TensorView saved);

void kda_gate_forward(const KdaGateParams& p, TensorView f, TensorView A_log, TensorView dt_bias, TensorView g);
void kda_gate_backward(const KdaGateParams& p,
                       TensorView dg,
                       TensorView f,
                       TensorView A_log,
                       TensorView dt_bias,
                       TensorView df,
                       TensorView dA_log,
                       TensorView ddt_bias);

// cu_seqlens stay on the host (checked there) and are copied to the device per call.
void causal_conv1d_forward(
    const CausalConv1dParams& p, TensorView x, TensorView w, TensorView y, std::span<const int64_t> cu_seqlens);
void causal_conv1d_backward(const CausalConv1dParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView w,
                            TensorView dx,
                            TensorView dw,
                            std::span<const int64_t> cu_seqlens);
void causal_conv1d_step(const CausalConv1dParams& p, TensorView x, TensorView w, TensorView window, TensorView y);

// LoRA's dense form: cuBLAS GEMMs, the dropout mask by a kernel (the CPU's bits).
void lora_forward(
    const LoraParams& p, TensorView x, TensorView a, TensorView b, TensorView u, TensorView y, TensorView xd);
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
                   TensorView xd);
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
void lora_merge(const LoraParams& p, TensorView w, TensorView a, TensorView b, TensorView out);
void lora_weight_backward(const LoraParams& p, TensorView dw, TensorView a, TensorView b, TensorView da, TensorView db);

// Sources by pointer, at most 64 (the CPU's limit); scratch as the CPU lays it out.
void attn_res_mix_forward(const AttnResParams& p,
                          std::span<const TensorView> sources,
                          TensorView gamma,
                          TensorView w,
                          TensorView out,
                          TensorView probs,
                          TensorView scratch);
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

// The MoE router, one thread per token; selection through ops/router_rows.h (the CPU's row code).
void router_score_function(const RouterParams& p, TensorView logits, TensorView scores);
void router_select(const RouterParams& p,
                   TensorView scores,
                   TensorView bias,
                   TensorView indices,
                   TensorView weights,
                   TensorView counts);
void router_weights(const RouterParams& p, TensorView scores, TensorView indices, TensorView weights);
void router_weights_backward(
    const RouterParams& p, TensorView dweights, TensorView scores, TensorView indices, TensorView dscores);
void router_score_backward(const RouterParams& p, TensorView scores, TensorView dscores, TensorView dlogits);
// The aux losses: per-row and per-sequence values read back and summed on the host in the CPU's order (one
// synchronisation per call, as the loss is returned); the balance statistics' host sums copied over and back.
double router_seq_aux_loss(double alpha,
                           TensorView scores,
                           TensorView indices,
                           std::span<const int64_t> starts,
                           TensorView dscores,
                           std::span<double> scratch);
void router_balance_stats(TensorView scores,
                          TensorView indices,
                          std::span<double> choices,
                          std::span<double> prob_sums);
void router_balance_backward(std::span<const double> grad, TensorView scores, TensorView dscores);
double router_z_loss(double beta, TensorView logits, TensorView dlogits);

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y);
void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup);

void swiglu_forward(TensorView gate, TensorView up, TensorView y);
void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup);

void embedding_forward(TensorView ids, TensorView table, TensorView y);
void embedding_backward(TensorView dy, TensorView ids, TensorView dtable);

// The loss is read back to the host (one synchronisation per call).
CrossEntropyResult cross_entropy_forward(const CrossEntropyParams& p,
                                         TensorView logits,
                                         TensorView targets,
                                         TensorView lse);
void cross_entropy_backward(const CrossEntropyParams& p,
                            double dloss,
                            TensorView logits,
                            TensorView targets,
                            TensorView lse,
                            TensorView dlogits);

// The row glue ops (ops/rows.h). zero_rows and the plain copy are 2-D memsets and memcpys.
void copy_rows(TensorView src, TensorView dst, float scale);
void add_rows(TensorView src, TensorView dst);
void copy_blocks(TensorView src, TensorView dst, std::span<const CopyBlock> blocks);
void cast(TensorView src, TensorView dst);
void round_to_bf16(TensorView t);
void zero_rows(TensorView t, int64_t rows);
void sigmoid_forward(TensorView x, TensorView y);
void sigmoid_backward(TensorView dy, TensorView y, TensorView dx);
void expand_groups(TensorView src, TensorView dst);
void sum_groups(TensorView src, TensorView dst);
void output_gate_forward(TensorView z, TensorView o, TensorView gate, TensorView y);
void output_gate_backward(TensorView dy, TensorView o, TensorView gate, TensorView dov, TensorView dz);

// The MoE layer (ops/cuda/moe_ops.cpp, kernels in moe.cu): capacity and layout on the host from the routing read
// back (ops/moe_layout.h), rows moved by kernels, the experts as grouped-batched cuBLAS GEMMs on offsets read back.
std::pair<int64_t, int64_t> moe_apply_capacity(
    const MoeParams& p, const MoeSaved& s, int64_t N, int64_t uniform, TensorView bias, const int64_t* share);
void moe_build_layout(const MoeSaved& s, int64_t tokens);
void moe_dispatch(const MoeSaved& s, TensorView src, TensorView rows);
void moe_combine(const MoeSaved& s, TensorView rows, TensorView dst, bool accumulate);
void moe_experts_forward(const MoeParams& p, const MoeWeights& w, const MoeSaved& s, const MoeScratch& t);
void moe_experts_backward(
    const MoeParams& p, const MoeWeights& w, const MoeWeights& g, const MoeSaved& s, const MoeScratch& t);
void moe_gate_grads(const MoeSaved& s, TensorView row_dot, TensorView dg, int64_t N);
void moe_shared_scale_forward(TensorView ss, TensorView sa);
void moe_shared_scale_backward(TensorView ss, TensorView sa, TensorView dsa, TensorView du);
double routing_entropy_sum(TensorView scores);

// The image tower's ops (ops/vision.h; vision_ops.cpp, vision.cu): the per-patch positions, the position table's
// taps and the merge's source rows computed on the host (the CPU's own arithmetic) and uploaded per call; every
// output element written by one thread, sums in the CPU's order.
void gelu_forward(Gelu kind, TensorView x, TensorView y);
void gelu_backward(Gelu kind, TensorView dy, TensorView x, TensorView dx);
void rope_2d_forward(double theta, std::span<const PatchGrid> grids, TensorView x, TensorView y);
void rope_2d_backward(double theta, std::span<const PatchGrid> grids, TensorView dy, TensorView dx);
void pos_embed_forward(std::span<const PatchGrid> grids, TensorView table, TensorView x);
void pos_embed_backward(std::span<const PatchGrid> grids, TensorView dx, TensorView dtable);
void patch_merge_forward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView x, TensorView y);
void patch_merge_backward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView dy, TensorView dx);
void scatter_rows(TensorView src, std::span<const int64_t> at, TensorView dst);
void zero_rows_at(TensorView t, std::span<const int64_t> at);

}  // namespace tessera::ops::cuda
