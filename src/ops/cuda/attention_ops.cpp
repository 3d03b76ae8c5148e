// The CUDA entry points of attention (ops/attention.h) and DSA's indexer, its KL loss and sparse attention
// (ops/dsa.h). The neutral
// entry points (ops/cpu/attention.cpp, dsa_indexer.cpp, sparse_attention.cpp) have checked shapes, dtypes, strides and
// cu_seqlens already; here attention's tile plan is made on the host (ops/attention_tiles.h) and copied with
// backward's Δ scratch into one device scratch request.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"
#include "ops/gemm.h"

namespace tessera::ops::cuda {

namespace {

AttnShape shape_of(const AttentionParams& p, const TensorView& q, const TensorView& k) {
    const int64_t D = q.size(3);
    return {q.size(0), q.size(1), q.size(2), k.size(2), D, p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(D)),
            p.causal};
}

// The plan of `kernel` for this call: rows per block, the chunk (tensor cores) and shared memory, and the tiles in
// `host` (uploaded later). At train.precision = bf16 (f32 data) the tensor-core kernels run, as GEMMs there do.
AttnPlan plan_for(
    AttnKernel kernel, const AttnShape& s, DType dtype, std::span<const int64_t> cu, std::vector<AttnTile>& host) {
    const size_t limit = max_shared_memory(), elem = dtype_size(dtype);
    AttnPlan plan{};
    if (dtype == DType::f32 && gemm_precision() == GemmPrecision::bf16) {
        const AttnTcLayout at = attention_tc_layout(kernel, s.D, limit);
        TESSERA_CHECK(at.warps > 0,
                      "attention (CUDA, bf16): head dim {} needs {} bytes of shared memory per block; the device "
                      "allows {}",
                      s.D, AttnTcLayout(kernel, 1, 16, s.D).bytes, limit);
        plan = {nullptr, 0, 16 * at.warps, at.chunk, size_t(at.bytes)};
    } else {
        const int64_t rows = attention_block_rows(kernel, s.D, elem, limit);
        TESSERA_CHECK(rows > 0,
                      "attention (CUDA): head dim {} needs {} bytes of shared memory per block; the device allows {}",
                      s.D, attention_smem_bytes(kernel, 32, s.D, elem), limit);
        plan = {nullptr, 0, rows, 0, attention_smem_bytes(kernel, rows, s.D, elem)};
    }
    attention_tiles(s.B, s.T, cu.data(), cu.size(), plan.rows, host);
    plan.tiles = int64_t(host.size());
    return plan;
}
}  // namespace

void attention_forward(const AttentionParams& p,
                       TensorView q,
                       TensorView k,
                       TensorView v,
                       TensorView o,
                       TensorView lse,
                       std::span<std::byte> /*workspace*/,
                       std::span<const int64_t> cu_seqlens) {
    const AttnShape s = shape_of(p, q, k);
    thread_local std::vector<AttnTile> tiles;
    dispatch_float(q.dtype, "attention", [&]<class T>(T) {
        AttnPlan plan = plan_for(AttnKernel::forward, s, q.dtype, cu_seqlens, tiles);
        plan.list = to_scratch(std::span<const AttnTile>(tiles));
        check_launch(launch_attention_forward<T>(s, plan, cheads<T>(q), cheads<T>(k), cheads<T>(v), heads<T>(o),
                                                 lse.ptr<T>(), stream()),
                     "attention");
    });
}

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
                        std::span<std::byte> /*workspace*/,
                        std::span<const int64_t> cu_seqlens) {
    const AttnShape s = shape_of(p, q, k);
    thread_local std::vector<AttnTile> qtiles, ktiles;
    dispatch_float(q.dtype, "attention", [&]<class T>(T) {
        AttnPlan queries = plan_for(AttnKernel::dq, s, q.dtype, cu_seqlens, qtiles);
        AttnPlan keys = plan_for(AttnKernel::dkv, s, q.dtype, cu_seqlens, ktiles);
        // one scratch request: Δ [B, H, T], then the query tiles, then the key tiles
        const size_t delta_bytes = scratch_part(sizeof(T) * size_t(s.B * s.H * s.T));
        const size_t qbytes = scratch_part(sizeof(AttnTile) * qtiles.size());
        auto* base = static_cast<std::byte*>(scratch(delta_bytes + qbytes + sizeof(AttnTile) * ktiles.size()));
        queries.list = upload(base + delta_bytes, std::span<const AttnTile>(qtiles));
        keys.list = upload(base + delta_bytes + qbytes, std::span<const AttnTile>(ktiles));
        check_launch(launch_attention_backward<T>(s, queries, keys, cheads<T>(dout), cheads<T>(q), cheads<T>(k),
                                                  cheads<T>(v), cheads<T>(o), lse.ptr<T>(), reinterpret_cast<T*>(base),
                                                  heads<T>(dq), heads<T>(dk), heads<T>(dv), stream()),
                     "attention backward");
    });
}

namespace {
// The query slabs of a backward scatter (sparse attention's dkv, the indexer KL's dk), each a private [B·T, width]
// accumulator walked by one column of blocks: the config's count (the CPU's) at least, and more while every slab keeps
// 4 queries and all of them fit 512 MiB, up to 256 — so a batch of short rows spreads over many blocks instead of
// batch × config slabs (the demo's dkv: 16 × 4 blocks, 41% of its GPU step on the H200 with the dk scatter). The count
// depends on the shapes only: bitwise run to run, on every GPU.
int64_t scatter_slabs(int64_t config_slabs, int64_t T, size_t slab_bytes) {
    const int64_t fit = int64_t((size_t(512) << 20) / std::max<size_t>(1, slab_bytes));
    return std::max(config_slabs, std::min({T / 4, fit, int64_t(256)}));
}

SparseShape sparse_shape(const SparseAttentionParams& p, const TensorView& q, const TensorView& indices) {
    const int64_t DK = q.size(3), DV = p.dv > 0 ? p.dv : DK;
    TESSERA_CHECK(DV <= kSparseMaxDV && DK <= kSparseMaxDK,
                  "sparse_attention (CUDA): entries up to {} dims with values up to {}, not {} and {}", kSparseMaxDK,
                  kSparseMaxDV, DK, DV);
    const SparseShape s{
        q.size(0), q.size(1), q.size(2), DK, DV, indices.size(2), p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(DK))};
    TESSERA_CHECK(sparse_attention_smem(s, dtype_size(q.dtype)) <= max_shared_memory(),
                  "sparse_attention (CUDA): {} heads of {} dims need more shared memory than the device allows", s.H,
                  DK);
    return s;
}
}  // namespace

void sparse_attention_forward(const SparseAttentionParams& p,
                              TensorView q,
                              TensorView kv,
                              TensorView indices,
                              TensorView o,
                              TensorView lse,
                              std::span<std::byte> /*workspace*/) {
    const SparseShape s = sparse_shape(p, q, indices);
    dispatch_float(q.dtype, "sparse_attention", [&]<class T>(T) {
        check_launch(
            launch_sparse_attention_forward<T>(s, q.ptr<T>(), kv.ptr<T>(), indices.ptr<int32_t>(), o.ptr<T>(),
                                               lse.ptr<T>(), gemm_precision() == GemmPrecision::bf16, stream()),
            "sparse_attention");
    });
}

void sparse_attention_probs(const SparseAttentionParams& p,
                            TensorView q,
                            TensorView kv,
                            TensorView indices,
                            TensorView lse,
                            TensorView probs,
                            std::span<std::byte> /*workspace*/) {
    const SparseShape s = sparse_shape(p, q, indices);
    dispatch_float(q.dtype, "sparse_attention", [&]<class T>(T) {
        check_launch(
            launch_sparse_attention_probs<T>(s, q.ptr<T>(), kv.ptr<T>(), indices.ptr<int32_t>(), lse.ptr<T>(),
                                             probs.ptr<T>(), gemm_precision() == GemmPrecision::bf16, stream()),
            "sparse_attention_probs");
    });
}

void sparse_attention_backward(const SparseAttentionParams& p,
                               TensorView dout,
                               TensorView q,
                               TensorView kv,
                               TensorView indices,
                               TensorView o,
                               TensorView lse,
                               TensorView dq,
                               TensorView dkv,
                               std::span<std::byte> /*workspace*/) {
    const SparseShape s = sparse_shape(p, q, indices);
    dispatch_float(q.dtype, "sparse_attention", [&]<class T>(T) {
        // one scratch request: Δ [B·T·H], the dkv slabs [slabs, B·T, DK], then a byte per row (sorted or not)
        const size_t delta_bytes = scratch_part(sizeof(T) * size_t(s.B * s.T * s.H));
        const int64_t slabs = scatter_slabs(p.dkv_slabs, s.T, sizeof(T) * size_t(s.B * s.T * s.DK));
        const size_t slab_bytes = scratch_part(sizeof(T) * size_t(slabs * s.B * s.T * s.DK));
        auto* base = static_cast<std::byte*>(scratch(delta_bytes + slab_bytes + size_t(s.B * s.T)));
        check_launch(launch_sparse_attention_backward<T>(
                         s, slabs, dout.ptr<T>(), q.ptr<T>(), kv.ptr<T>(), indices.ptr<int32_t>(), o.ptr<T>(),
                         lse.ptr<T>(), reinterpret_cast<T*>(base), reinterpret_cast<T*>(base + delta_bytes),
                         reinterpret_cast<uint8_t*>(base + delta_bytes + slab_bytes), dq.ptr<T>(), dkv.ptr<T>(),
                         gemm_precision() == GemmPrecision::bf16, stream()),
                     "sparse_attention backward");
    });
}

void dsa_all_candidates(TensorView indices, std::span<const int64_t> cu_seqlens) {
    const int64_t* cu = cu_seqlens.empty() ? nullptr : to_scratch(cu_seqlens);
    check_launch(launch_dsa_all_candidates(indices.ptr<int32_t>(), indices.size(0), indices.size(1), indices.size(2),
                                           cu, cu_seqlens.empty() ? 0 : int64_t(cu_seqlens.size()) - 1, stream()),
                 "dsa_all_candidates");
}

void dsa_indexer_forward(const DsaIndexerParams& p,
                         TensorView q,
                         TensorView k,
                         TensorView w,
                         TensorView indices,
                         TensorView scores,
                         std::span<std::byte> /*workspace*/,
                         std::span<const int64_t> cu_seqlens) {
    const IndexerShape s{q.size(0),
                         q.size(1),
                         q.size(2),
                         q.size(3),
                         p.topk,
                         indexer_list_size(p.topk),
                         cu_seqlens.empty() ? 0 : int64_t(cu_seqlens.size()) - 1};
    // at train.precision = bf16 the scores are a GEMM's, on tensor cores with bf16 operands (the CPU rounds them too)
    const bool tensor_cores = q.dtype == DType::f32 && gemm_precision() == GemmPrecision::bf16;
    const size_t need = indexer_smem(s.HI, s.DI, s.topk, dtype_size(q.dtype), tensor_cores),
                 limit = max_shared_memory();
    TESSERA_CHECK(need <= limit,
                  "dsa_indexer (CUDA): {} heads of {} dims with topk {} need {} bytes of shared memory; the device "
                  "allows {}",
                  s.HI, s.DI, s.topk, need, limit);
    // one scratch request: cu, then (tensor cores) the rounded keys
    const size_t cu_bytes = scratch_part(cu_seqlens.size_bytes());
    auto* base = static_cast<std::byte*>(
        scratch(cu_bytes + (tensor_cores ? indexer_bf16_keys_bytes(s.B, s.T, s.DI) : size_t(0))));
    const int64_t* cu = cu_seqlens.empty() ? nullptr : upload(base, cu_seqlens);
    dispatch_float(q.dtype, "dsa_indexer", [&]<class T>(T) {
        check_launch(
            launch_dsa_indexer<T>(s, cu, q.ptr<T>(), k.ptr<T>(), w.ptr<T>(), tensor_cores ? base + cu_bytes : nullptr,
                                  indices.ptr<int32_t>(), scores.ptr<T>(), stream()),
            "dsa_indexer");
    });
}

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
                           std::span<std::byte> /*workspace*/,
                           int64_t dk_slabs) {
    const KlShape s{q.size(0),
                    q.size(1),
                    q.size(2),
                    q.size(3),
                    indices.defined() ? indices.size(2) : 0,
                    cu_seqlens.empty() ? 0 : int64_t(cu_seqlens.size()) - 1,
                    q.dtype == DType::f32 && gemm_precision() == GemmPrecision::bf16};
    const size_t need = indexer_kl_smem(s, dtype_size(q.dtype)), limit = max_shared_memory();
    TESSERA_CHECK(
        need <= limit,
        "indexer_kl (CUDA): {} heads of {} dims need {} bytes of shared memory per block; the device allows {}", s.HI,
        s.DI, need, limit);
    const int64_t BT = s.B * s.T;
    const bool grads = dq.defined();
    IndexerKlResult r;
    dispatch_float(q.dtype, "indexer_kl", [&]<class T>(T) {
        // one scratch request: cu_seqlens, the rows' kl, lse, Σp and support flags, the dk slabs
        const size_t cu_bytes = scratch_part(sizeof(int64_t) * cu_seqlens.size()),
                     row_bytes = scratch_part(8 * size_t(BT));
        const int64_t slabs = scatter_slabs(dk_slabs, s.T, sizeof(T) * size_t(BT * s.DI));
        const size_t acc_bytes = grads ? sizeof(T) * size_t(slabs * BT * s.DI) : 0;
        auto* base = static_cast<std::byte*>(scratch(cu_bytes + 4 * row_bytes + acc_bytes));
        const int64_t* cu = cu_seqlens.empty() ? nullptr : upload(base, cu_seqlens);
        std::byte* rb = base + cu_bytes;
        const KlRows rows{reinterpret_cast<double*>(rb), reinterpret_cast<double*>(rb + row_bytes),
                          reinterpret_cast<double*>(rb + 2 * row_bytes),
                          reinterpret_cast<int32_t*>(rb + 3 * row_bytes)};
        const T* pp = p.ptr<T>();
        const int32_t* idx = indices.defined() ? indices.ptr<int32_t>() : nullptr;
        check_launch(launch_indexer_kl_rows<T>(s, cu, q.ptr<T>(), k.ptr<T>(), w.ptr<T>(), pp, idx, rows, stream()),
                     "indexer_kl");
        const std::vector<double> kl = download(rows.kl, size_t(BT));
        const std::vector<int32_t> has = download(rows.has, size_t(BT));
        double sum = 0;
        for (int64_t i = 0; i < BT; ++i) {  // in row order, as the CPU sums
            sum += kl[size_t(i)];
            r.rows += has[size_t(i)];
        }
        r.loss = r.rows ? sum / double(r.rows) : 0.0;
        if (!grads || r.rows == 0 || dloss == 0) return;
        check_launch(launch_indexer_kl_backward<T>(s, slabs, cu, q.ptr<T>(), k.ptr<T>(), w.ptr<T>(), pp, idx, rows,
                                                   dloss / double(r.rows), reinterpret_cast<T*>(rb + 4 * row_bytes),
                                                   dq.ptr<T>(), dk.ptr<T>(), dw.ptr<T>(), stream()),
                     "indexer_kl backward");
    });
    return r;
}

void cached_attention(
    double scale, TensorView q, TensorView keys, TensorView values, TensorView rows, int64_t len, TensorView o) {
    const int64_t n = rows.defined() ? rows.size(1) : len;
    CachedAttentionArgs a{q.ptr<float>(),
                          keys.ptr<float>(),
                          values.ptr<float>(),
                          rows.defined() ? rows.ptr<int32_t>() : nullptr,
                          o.ptr<float>(),
                          q.size(0),
                          q.size(1),
                          keys.size(2),
                          q.size(2),
                          o.size(2),
                          n,
                          len,
                          q.strides[0],
                          q.strides[1],
                          keys.strides[0],
                          keys.strides[1],
                          keys.strides[2],
                          values.strides[0],
                          values.strides[1],
                          values.strides[2],
                          o.strides[0],
                          o.strides[1],
                          scale};
    // one scratch request: the scores, then each split's partial sums
    const size_t z_bytes = scratch_part(sizeof(double) * size_t(std::max<int64_t>(1, a.B * a.H * n)));
    auto* base = static_cast<std::byte*>(
        scratch(z_bytes + sizeof(double) * size_t(a.B * a.H * cached_attention_splits(n) * (2 + a.DV))));
    check_launch(launch_cached_attention(a, reinterpret_cast<double*>(base), reinterpret_cast<double*>(base + z_bytes),
                                         stream()),
                 "cached_attention");
}

void cached_index_topk(TensorView q, TensorView w, TensorView keys, int64_t len, TensorView rows) {
    int64_t keep = 1, tiles = 1;
    while (keep < rows.size(1)) keep *= 2;
    while (tiles * 2 * keep < len) tiles *= 2;
    const CachedIndexArgs a{q.ptr<float>(),
                            w.ptr<float>(),
                            keys.ptr<float>(),
                            rows.ptr<int32_t>(),
                            q.size(0),
                            q.size(1),
                            q.size(2),
                            len,
                            rows.size(1),
                            2 * keep,
                            tiles,
                            q.strides[0],
                            q.strides[1],
                            w.strides[0],
                            w.strides[1],
                            keys.strides[0],
                            keys.strides[1]};
    // one scratch request: two levels of lists, scores and positions
    const size_t part = scratch_part(sizeof(float) * size_t(a.B * tiles * a.tile));
    auto* base = static_cast<std::byte*>(scratch(4 * part));
    check_launch(launch_cached_index_topk(a, reinterpret_cast<float*>(base), reinterpret_cast<int32_t*>(base + part),
                                          reinterpret_cast<float*>(base + 2 * part),
                                          reinterpret_cast<int32_t*>(base + 3 * part), stream()),
                 "cached_index_topk");
}

}  // namespace tessera::ops::cuda
