// Sparse MQA attention's entry points (checks, then CUDA tensors to ops/cuda) and its CPU kernels (dsa.h): per
// query, blocks of up to 64 selected entries multiplied in place (row-pointer small GEMMs: no gather copies),
// scores for all heads at once, online softmax; backward recomputes the probabilities from lse and scatters dkv
// through fixed query slabs. Every buffer comes from the caller's workspace (no heap allocation).
#include <omp.h>

#include <cmath>
#include <limits>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/small_gemm.h"
#include "ops/cpu/vec_math.h"
#include "ops/dsa.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::ThreadSlices;
using cpu::WorkspaceCursor;

namespace {
constexpr int64_t kBlock = 64;  // entries per block (FlashMLA's B_TOPK)

struct SparseDims {
    int64_t B, T, H, DK, DV, K;
    double scale;
};

SparseDims check_sparse(const SparseAttentionParams& p,
                        const TensorView& q,
                        const TensorView& kv,
                        const TensorView& indices,
                        const TensorView& o,
                        const TensorView& lse) {
    TESSERA_CHECK(q.ndim() == 4, "sparse_attention: q must be [B, T, H, DK], not {}", q.shape.str());
    SparseDims d{q.size(0), q.size(1), q.size(2), q.size(3), p.dv > 0 ? p.dv : q.size(3), 0, p.scale};
    if (d.scale <= 0) d.scale = 1.0 / std::sqrt(double(d.DK));
    TESSERA_CHECK(d.DV <= d.DK, "sparse_attention: dv = {} exceeds the entry width {}", d.DV, d.DK);
    check_shape(kv, Shape{d.B, d.T, d.DK}, "sparse_attention: kv");
    check_dtype(indices, DType::i32, "sparse_attention: indices");
    TESSERA_CHECK(indices.ndim() == 3 && indices.size(0) == d.B && indices.size(1) == d.T,
                  "sparse_attention: indices must be [B = {}, T = {}, TOPK], not {}", d.B, d.T, indices.shape.str());
    d.K = indices.size(2);
    check_shape(o, Shape{d.B, d.T, d.H, d.DV}, "sparse_attention: o");
    check_shape(lse, Shape{d.B, d.T, d.H}, "sparse_attention: lse");
    for (const TensorView* t : {&q, &kv, &indices, &o, &lse}) check_contiguous(*t, "sparse_attention");
    for (const TensorView* t : {&kv, &o, &lse}) {
        TESSERA_CHECK(t->dtype == q.dtype, "sparse_attention: q, kv, o and lse must share one dtype");
    }
    return d;
}

// Per-thread scratch of each pass, carved from a workspace cursor (measuring cursors size them).
template <class T>
struct ForwardScratch {
    int32_t* sel;  // [K] the valid entries of the row
    const T** rows;
    T *qt_t, *z, *acc, *m, *l;  // [DK, H], [kBlock, H], [H, DV], [H], [H]
    ForwardScratch(const SparseDims& d, WorkspaceCursor& c)
        : sel(c.take<int32_t>(size_t(d.K))),
          rows(c.take<const T*>(kBlock)),
          qt_t(c.take<T>(size_t(d.DK * d.H))),
          z(c.take<T>(size_t(kBlock * d.H))),
          acc(c.take<T>(size_t(d.H * d.DV))),
          m(c.take<T>(size_t(d.H))),
          l(c.take<T>(size_t(d.H))) {}
};
template <class T>
struct ProbsScratch {
    const T** rows;
    int64_t* pos;
    T *qt_t, *z;  // [DK, H], [kBlock, H]
    ProbsScratch(const SparseDims& d, WorkspaceCursor& c)
        : rows(c.take<const T*>(kBlock)),
          pos(c.take<int64_t>(kBlock)),
          qt_t(c.take<T>(size_t(d.DK * d.H))),
          z(c.take<T>(size_t(kBlock * d.H))) {}
};
template <class T>
struct BackwardScratch {
    int32_t* sel;
    const T** rows;
    T *qt_t, *do_t, *tmp, *pm, *dz;  // [DK, H], [DV, H], [kBlock, DK], [kBlock, H], [kBlock, H]
    BackwardScratch(const SparseDims& d, WorkspaceCursor& c)
        : sel(c.take<int32_t>(size_t(d.K))),
          rows(c.take<const T*>(kBlock)),
          qt_t(c.take<T>(size_t(d.DK * d.H))),
          do_t(c.take<T>(size_t(d.DV * d.H))),
          tmp(c.take<T>(size_t(kBlock * d.DK))),
          pm(c.take<T>(size_t(kBlock * d.H))),
          dz(c.take<T>(size_t(kBlock * d.H))) {}
};
// Shared by backward's threads: delta [B·T·H] and the dkv slab accumulators [slabs, B·T, DK].
template <class T>
struct BackwardShared {
    T *delta, *acc;
    BackwardShared(const SparseDims& d, int64_t slabs, WorkspaceCursor& c)
        : delta(c.take<T>(size_t(d.B * d.T * d.H))), acc(c.take<T>(size_t(slabs * d.B * d.T * d.DK))) {}
};

template <class Scratch>
size_t per_thread_bytes(const SparseDims& d) {
    return cpu::measure_scratch([&](WorkspaceCursor& c) { Scratch(d, c); });
}

// The valid entries of one query's row (−1 and out-of-range indices skipped), in row order.
int64_t valid_entries(const SparseDims& d, const int32_t* row, int32_t* out) {
    int64_t n = 0;
    for (int64_t i = 0; i < d.K; ++i) {
        if (row[i] >= 0 && row[i] < d.T) out[n++] = row[i];
    }
    return n;
}

template <class T>
void forward_impl(const SparseDims& d,
                  const TensorView& q,
                  const TensorView& kv,
                  const TensorView& indices,
                  const TensorView& o,
                  const TensorView& lse,
                  std::span<std::byte> ws) {
    const T scale = T(d.scale), inf = std::numeric_limits<T>::infinity();
    const int nt = omp_get_max_threads();
    const ThreadSlices slices(ws, 0, per_thread_bytes<ForwardScratch<T>>(d), nt, "sparse_attention");
#pragma omp parallel num_threads(nt)
    {
        WorkspaceCursor cur(slices.thread(omp_get_thread_num()));
        const ForwardScratch<T> sc(d, cur);
        int32_t* sel = sc.sel;
        const T** rows = sc.rows;
        T *qt_t = sc.qt_t, *z = sc.z, *acc = sc.acc, *m = sc.m, *l = sc.l;
#pragma omp for schedule(dynamic, 16)
        for (int64_t bt = 0; bt < d.B * d.T; ++bt) {
            const T* qt = q.ptr<T>() + bt * d.H * d.DK;
            const T* kvb = kv.ptr<T>() + bt / d.T * d.T * d.DK;
            const int64_t n = valid_entries(d, indices.ptr<int32_t>() + bt * d.K, sel);
            cpu::transpose(qt, d.H, d.DK, d.DK, qt_t, d.H);  // [DK, H]
            std::fill(m, m + d.H, -inf);
            std::fill(l, l + d.H, T(0));
            std::fill(acc, acc + d.H * d.DV, T(0));
            for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
                const int64_t nb = std::min(kBlock, n - i0);
                for (int64_t i = 0; i < nb; ++i) rows[size_t(i)] = kvb + int64_t(sel[size_t(i0 + i)]) * d.DK;
                // zᵀ [nb, H] = scale · entries · q_tᵀ, the entries used in place
                cpu::small_gemm_rows_nn(nb, d.H, d.DK, scale, rows, qt_t, d.H, T(0), z, d.H);
                for (int64_t h = 0; h < d.H; ++h) {
                    T mx = m[size_t(h)];
                    for (int64_t i = 0; i < nb; ++i) mx = std::max(mx, z[size_t(i * d.H + h)]);
                    const T alpha = m[size_t(h)] == -inf ? T(0) : cpu::vexp(m[size_t(h)] - mx);
                    T sum = 0;
                    for (int64_t i = 0; i < nb; ++i)
                        sum += (z[size_t(i * d.H + h)] = cpu::vexp(z[size_t(i * d.H + h)] - mx));
                    l[size_t(h)] = alpha * l[size_t(h)] + sum;
                    m[size_t(h)] = mx;
                    for (int64_t e = 0; e < d.DV; ++e) acc[size_t(h * d.DV + e)] *= alpha;
                }
                // acc [H, DV] += pᵀ · values (the first DV dims of the same entries)
                cpu::small_gemm_tn_rows(d.H, d.DV, nb, T(1), z, d.H, rows, T(1), acc, d.DV);
            }
            T* ot = o.ptr<T>() + bt * d.H * d.DV;
            T* lt = lse.ptr<T>() + bt * d.H;
            for (int64_t h = 0; h < d.H; ++h) {
                const T lh = l[size_t(h)];
                for (int64_t e = 0; e < d.DV; ++e) ot[h * d.DV + e] = lh > 0 ? acc[size_t(h * d.DV + e)] / lh : T(0);
                lt[h] = lh > 0 ? m[size_t(h)] + std::log(lh) : inf;
            }
        }
    }
}

template <class T>
void probs_impl(const SparseDims& d,
                const TensorView& q,
                const TensorView& kv,
                const TensorView& indices,
                const TensorView& lse,
                const TensorView& probs,
                std::span<std::byte> ws) {
    const T scale = T(d.scale), inv_h = T(1.0 / double(d.H));
    const int nt = omp_get_max_threads();
    const ThreadSlices slices(ws, 0, per_thread_bytes<ProbsScratch<T>>(d), nt, "sparse_attention_probs");
#pragma omp parallel num_threads(nt)
    {
        WorkspaceCursor cur(slices.thread(omp_get_thread_num()));
        const ProbsScratch<T> sc(d, cur);
        const T** rows = sc.rows;
        int64_t* pos = sc.pos;
        T *qt_t = sc.qt_t, *z = sc.z;
#pragma omp for schedule(dynamic, 16)
        for (int64_t bt = 0; bt < d.B * d.T; ++bt) {
            const T* kvb = kv.ptr<T>() + bt / d.T * d.T * d.DK;
            const int32_t* row = indices.ptr<int32_t>() + bt * d.K;
            const T* lt = lse.ptr<T>() + bt * d.H;
            T* pt = probs.ptr<T>() + bt * d.K;
            cpu::transpose(q.ptr<T>() + bt * d.H * d.DK, d.H, d.DK, d.DK, qt_t, d.H);
            for (int64_t i0 = 0; i0 < d.K; i0 += kBlock) {
                int64_t nb = 0;
                for (int64_t i = i0; i < std::min(d.K, i0 + kBlock); ++i) {
                    pt[i] = T(0);
                    if (row[i] < 0 || row[i] >= d.T) continue;
                    pos[size_t(nb)] = i;
                    rows[size_t(nb++)] = kvb + int64_t(row[i]) * d.DK;
                }
                if (nb == 0) continue;
                cpu::small_gemm_rows_nn(nb, d.H, d.DK, scale, rows, qt_t, d.H, T(0), z, d.H);
                for (int64_t i = 0; i < nb; ++i) {
                    T sum = 0;
                    for (int64_t h = 0; h < d.H; ++h) {
                        if (!std::isinf(lt[h])) sum += cpu::vexp(z[size_t(i * d.H + h)] - lt[h]);
                    }
                    pt[pos[size_t(i)]] = sum * inv_h;
                }
            }
        }
    }
}

template <class T>
void backward_impl(const SparseDims& d,
                   int64_t slabs,
                   const TensorView& dout,
                   const TensorView& q,
                   const TensorView& kv,
                   const TensorView& indices,
                   const TensorView& o,
                   const TensorView& lse,
                   const TensorView& dq,
                   const TensorView& dkv,
                   std::span<std::byte> ws) {
    const T scale = T(d.scale);
    const int nt = omp_get_max_threads();
    const size_t shared = cpu::measure_scratch([&](WorkspaceCursor& c) { BackwardShared<T>(d, slabs, c); });
    const ThreadSlices slices(ws, shared, per_thread_bytes<BackwardScratch<T>>(d), nt, "sparse_attention backward");
    WorkspaceCursor head(slices.head());
    const BackwardShared<T> sh(d, slabs, head);
    T* delta = sh.delta;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < d.B * d.T * d.H; ++i) {
        T s = 0;
        for (int64_t e = 0; e < d.DV; ++e) s += dout.ptr<T>()[i * d.DV + e] * o.ptr<T>()[i * d.DV + e];
        delta[i] = s;
    }
    // slab sl of batch row b accumulates into acc[sl][b·T .. (b+1)·T); every row's slabs run at once
    const int64_t BT = d.B * d.T;
    T* acc = sh.acc;
#pragma omp parallel num_threads(nt)
    {
        WorkspaceCursor cur(slices.thread(omp_get_thread_num()));
        const BackwardScratch<T> sc(d, cur);
        int32_t* sel = sc.sel;
        const T** rows = sc.rows;
        T *qt_t = sc.qt_t, *do_t = sc.do_t, *tmp = sc.tmp, *pm = sc.pm, *dz = sc.dz;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < d.B * slabs; ++task) {
            const int64_t b = task / slabs, sl = task % slabs;
            const T* kvb = kv.ptr<T>() + b * d.T * d.DK;
            T* slab = acc + (sl * BT + b * d.T) * d.DK;
            std::fill(slab, slab + d.T * d.DK, T(0));
            for (int64_t t = d.T * sl / slabs; t < d.T * (sl + 1) / slabs; ++t) {  // ascending queries
                const int64_t bt = b * d.T + t;
                const T* qt = q.ptr<T>() + bt * d.H * d.DK;
                const T* dot = dout.ptr<T>() + bt * d.H * d.DV;
                const T* lt = lse.ptr<T>() + bt * d.H;
                const T* dl = delta + bt * d.H;
                T* dqt = dq.ptr<T>() + bt * d.H * d.DK;
                const int64_t n = valid_entries(d, indices.ptr<int32_t>() + bt * d.K, sel);
                if (n == 0) continue;
                cpu::transpose(qt, d.H, d.DK, d.DK, qt_t, d.H);
                cpu::transpose(dot, d.H, d.DV, d.DV, do_t, d.H);
                for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
                    const int64_t nb = std::min(kBlock, n - i0);
                    for (int64_t i = 0; i < nb; ++i) rows[i] = kvb + int64_t(sel[i0 + i]) * d.DK;
                    // pᵀ and dpᵀ [nb, H] from the entries in place
                    cpu::small_gemm_rows_nn(nb, d.H, d.DK, scale, rows, qt_t, d.H, T(0), pm, d.H);
                    cpu::small_gemm_rows_nn(nb, d.H, d.DV, T(1), rows, do_t, d.H, T(0), dz, d.H);
                    for (int64_t i = 0; i < nb; ++i) {
                        for (int64_t h = 0; h < d.H; ++h) {
                            T& pr = pm[i * d.H + h];
                            pr = std::isinf(lt[h]) ? T(0) : cpu::vexp(pr - lt[h]);
                            dz[i * d.H + h] = pr * (dz[i * d.H + h] - dl[h]);
                        }
                    }
                    // dq_t += scale · dzᵀ · entries;  d(entries) = scale · dz · q_t (+ p · do_t on the value dims)
                    cpu::small_gemm_tn_rows(d.H, d.DK, nb, scale, dz, d.H, rows, T(1), dqt, d.DK);
                    cpu::small_gemm_nn(nb, d.DK, d.H, scale, dz, d.H, qt, d.DK, T(0), tmp, d.DK);
                    cpu::small_gemm_nn(nb, d.DV, d.H, T(1), pm, d.H, dot, d.DV, T(1), tmp, d.DK);
                    for (int64_t i = 0; i < nb; ++i) {
                        T* dst = slab + int64_t(sel[i0 + i]) * d.DK;
                        const T* src = tmp + i * d.DK;
                        for (int64_t e = 0; e < d.DK; ++e) dst[e] += src[e];
                    }
                }
            }
        }
    }
    // reduced in slab order, per element
    T* dkvp = dkv.ptr<T>();
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < BT * d.DK; ++i) {
        for (int64_t sl = 0; sl < slabs; ++sl) dkvp[i] += acc[sl * BT * d.DK + i];
    }
}
}  // namespace

size_t sparse_attention_workspace_bytes(
    DType dtype, const SparseAttentionParams& p, int64_t B, int64_t T, int64_t H, int64_t DK, int64_t K, int threads) {
    const SparseDims d{B, T, H, DK, p.dv > 0 ? p.dv : DK, K, 0.0};
    const int64_t slabs = std::max<int64_t>(1, p.dkv_slabs);
    size_t bytes = 0;
    dispatch_float(dtype, "sparse_attention", [&]<class T_>(T_) {
        const size_t shared = cpu::measure_scratch([&](WorkspaceCursor& c) { BackwardShared<T_>(d, slabs, c); });
        const size_t n = size_t(threads);
        bytes = std::max({per_thread_bytes<ForwardScratch<T_>>(d) * n, per_thread_bytes<ProbsScratch<T_>>(d) * n,
                          shared + per_thread_bytes<BackwardScratch<T_>>(d) * n});
    });
    return bytes;
}

void sparse_attention_forward(const SparseAttentionParams& p,
                              TensorView q,
                              TensorView kv,
                              TensorView indices,
                              TensorView o,
                              TensorView lse,
                              std::span<std::byte> workspace) {
    note_op_use("sparse_attention");
    const Device device = op_device("sparse_attention", {q, kv, indices, o, lse});
    const SparseDims d = check_sparse(p, q, kv, indices, o, lse);
    if (device == Device::cuda) return TESSERA_ON_CUDA(sparse_attention_forward(p, q, kv, indices, o, lse, workspace));
    dispatch_float(q.dtype, "sparse_attention",
                   [&]<class T>(T) { forward_impl<T>(d, q, kv, indices, o, lse, workspace); });
}

void sparse_attention_probs(const SparseAttentionParams& p,
                            TensorView q,
                            TensorView kv,
                            TensorView indices,
                            TensorView lse,
                            TensorView probs,
                            std::span<std::byte> workspace) {
    const Device device = op_device("sparse_attention", {q, kv, indices, lse, probs});
    TESSERA_CHECK(q.ndim() == 4, "sparse_attention_probs: q must be [B, T, H, DK], not {}", q.shape.str());
    const int64_t DV = p.dv > 0 ? p.dv : q.size(3);
    TensorView o(nullptr, q.dtype, Shape{q.size(0), q.size(1), q.size(2), DV});  // shape only, for the checks
    const SparseDims d = check_sparse(p, q, kv, indices, o, lse);
    check_shape(probs, indices.shape, "sparse_attention_probs: probs");
    check_contiguous(probs, "sparse_attention_probs");
    TESSERA_CHECK(probs.dtype == q.dtype, "sparse_attention_probs: probs must have q's dtype");
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(sparse_attention_probs(p, q, kv, indices, lse, probs, workspace));
    dispatch_float(q.dtype, "sparse_attention",
                   [&]<class T>(T) { probs_impl<T>(d, q, kv, indices, lse, probs, workspace); });
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
                               std::span<std::byte> workspace) {
    const Device device = op_device("sparse_attention", {dout, q, kv, indices, o, lse, dq, dkv});
    const SparseDims d = check_sparse(p, q, kv, indices, o, lse);
    TESSERA_CHECK(p.dkv_slabs >= 1, "sparse_attention: dkv_slabs must be positive");
    check_shape(dout, o.shape, "sparse_attention: do");
    check_shape(dq, q.shape, "sparse_attention: dq");
    check_shape(dkv, kv.shape, "sparse_attention: dkv");
    for (const TensorView* t : {&dout, &dq, &dkv}) {
        check_contiguous(*t, "sparse_attention");
        TESSERA_CHECK(t->dtype == q.dtype, "sparse_attention: do, dq and dkv must have q's dtype");
    }
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(sparse_attention_backward(p, dout, q, kv, indices, o, lse, dq, dkv, workspace));
    dispatch_float(q.dtype, "sparse_attention", [&]<class T>(T) {
        backward_impl<T>(d, p.dkv_slabs, dout, q, kv, indices, o, lse, dq, dkv, workspace);
    });
}

}  // namespace tessera::ops
