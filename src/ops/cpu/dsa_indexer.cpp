// The lightning indexer (streaming scores + running top-k) and its KL loss: entry points (CUDA tensors to
// ops/cuda) and the CPU kernels (dsa.h). Every buffer comes from the caller's workspace: the running
// top-k of a query is a fixed array of 2·topk candidates (cut back to the best topk whenever it fills), so
// nothing grows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/small_gemm.h"
#include "ops/dsa.h"
#include "ops/gemm.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Segments;
using cpu::ThreadSlices;
using cpu::WorkspaceCursor;

namespace {
// Fixed tiles: a key block is always kKeyBlock columns of a zero-padded kᵀ, so every score takes the
// same arithmetic path wherever it sits (the selection must not depend on tiling or threads).
constexpr int64_t kQueryBlock = 32;
constexpr int64_t kKeyBlock = 64;

struct Candidate {
    double score;
    int32_t s;
};
inline bool better(const Candidate& a, const Candidate& b) { return dsa_ranks_before(a.score, a.s, b.score, b.s); }

// keeps the best k of the n candidates at c (in some order); returns how many remain
int64_t keep_best(Candidate* c, int64_t n, int64_t k) {
    if (n <= k) return n;
    std::nth_element(c, c + k, c + n, better);
    return k;
}

struct IndexerDims {
    int64_t B, T, HI, DI;
};

IndexerDims check_indexer(const TensorView& q, const TensorView& k, const TensorView& w, std::string_view op) {
    TESSERA_CHECK(q.ndim() == 4, "{}: q must be [B, T, HI, DI], not {}", op, q.shape.str());
    const IndexerDims d{q.size(0), q.size(1), q.size(2), q.size(3)};
    check_shape(k, Shape{d.B, d.T, d.DI}, op, "k");
    check_shape(w, Shape{d.B, d.T, d.HI}, op, "w");
    for (const TensorView* t : {&q, &k, &w}) {
        check_contiguous(*t, op);
        TESSERA_CHECK(t->dtype == q.dtype, "{}: q, k and w must share one dtype", op);
    }
    return d;
}

int64_t padded_keys(int64_t T) { return (T + kKeyBlock - 1) / kKeyBlock * kKeyBlock; }

// Shared: kᵀ of every batch row [B, DI, Tp] (zero-padded to whole key blocks). Per thread: the score
// tile [kQueryBlock·HI, kKeyBlock] and each query's candidates (at most 2·topk) with their counts.
template <class T>
struct IndexerShared {
    T* kt;
    IndexerShared(const IndexerDims& d, WorkspaceCursor& c) : kt(c.take<T>(size_t(d.B * d.DI * padded_keys(d.T)))) {}
};
template <class T>
struct IndexerScratch {
    T* a;
    T* qr;            // [kQueryBlock·HI, DI]: the block's queries rounded to bf16 (GemmPrecision::bf16)
    Candidate* cand;  // [kQueryBlock, 2·topk]
    int64_t* count;   // [kQueryBlock]
    IndexerScratch(const IndexerDims& d, int64_t topk, WorkspaceCursor& c)
        : a(c.take<T>(size_t(kQueryBlock * d.HI * kKeyBlock))),
          qr(c.take<T>(size_t(kQueryBlock * d.HI * d.DI))),
          cand(c.take<Candidate>(size_t(kQueryBlock * 2 * topk))),
          count(c.take<int64_t>(kQueryBlock)) {}
};

template <class T>
void indexer_forward(const DsaIndexerParams& p,
                     const IndexerDims& d,
                     const TensorView& q,
                     const TensorView& k,
                     const TensorView& w,
                     const TensorView& indices,
                     const TensorView& scores,
                     const Segments& seg,
                     std::span<std::byte> ws) {
    const int64_t K = p.topk, Tp = padded_keys(d.T), cap = 2 * K;
    // at train.precision = bf16 the scores are a GEMM's: q and k rounded to bf16, f32 sums (the GPU: tensor cores)
    const bool bf16 = std::is_same_v<T, float> && gemm_precision() == GemmPrecision::bf16;
    const int nt = omp_get_max_threads();
    const size_t shared = cpu::measure_scratch([&](WorkspaceCursor& c) { IndexerShared<T>(d, c); });
    const size_t per_thread = cpu::measure_scratch([&](WorkspaceCursor& c) { IndexerScratch<T>(d, K, c); });
    const ThreadSlices slices(ws, shared, per_thread, nt, "dsa_indexer");
    WorkspaceCursor head(slices.head());
    const IndexerShared<T> sh(d, head);
    const int64_t blocks = (d.T + kQueryBlock - 1) / kQueryBlock;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < d.B; ++b) {
            T* kt = sh.kt + b * d.DI * Tp;
            std::fill(kt, kt + d.DI * Tp, T(0));
            cpu::transpose(k.ptr<T>() + b * d.T * d.DI, d.T, d.DI, d.DI, kt, Tp);  // [DI, Tp]
            if constexpr (std::is_same_v<T, float>) {
                if (bf16) cpu::round_to_bf16(kt, d.DI * Tp, kt);
            }
        }
        WorkspaceCursor cur(slices.thread(omp_get_thread_num()));
        const IndexerScratch<T> sc(d, K, cur);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < d.B * blocks; ++task) {
            const int64_t b = task / blocks, qb = task % blocks;
            const T* kt = sh.kt + b * d.DI * Tp;
            const int64_t t0 = qb * kQueryBlock, t1 = std::min(d.T, t0 + kQueryBlock);
            int64_t lo = t1;
            for (int64_t t = t0; t < t1; ++t) {
                sc.count[t - t0] = 0;
                lo = std::min(lo, seg.first_of(b, t));
            }
            const T* qrows = q.ptr<T>() + (b * d.T + t0) * d.HI * d.DI;
            if constexpr (std::is_same_v<T, float>) {
                if (bf16) {
                    cpu::round_to_bf16(qrows, (t1 - t0) * d.HI * d.DI, sc.qr);
                    qrows = sc.qr;
                }
            }
            for (int64_t s0 = lo / kKeyBlock * kKeyBlock; s0 < t1; s0 += kKeyBlock) {
                cpu::small_gemm_nn((t1 - t0) * d.HI, kKeyBlock, d.DI, T(1), qrows, d.DI, kt + s0, Tp, T(0), sc.a,
                                   kKeyBlock);
                for (int64_t t = t0; t < t1; ++t) {
                    const T* wt = w.ptr<T>() + (b * d.T + t) * d.HI;
                    const T* at = sc.a + (t - t0) * d.HI * kKeyBlock;
                    Candidate* c = sc.cand + (t - t0) * cap;
                    int64_t& n = sc.count[t - t0];
                    const int64_t s_end = std::min(s0 + kKeyBlock, t + 1);
                    for (int64_t s = std::max(s0, seg.first_of(b, t)); s < s_end; ++s) {
                        T score = 0;
                        for (int64_t j = 0; j < d.HI; ++j) score += wt[j] * std::max(at[j * kKeyBlock + s - s0], T(0));
                        if (std::isnan(score) || score == -std::numeric_limits<T>::infinity()) continue;
                        c[n++] = {double(score), int32_t(s)};
                        if (n >= cap) n = keep_best(c, n, K);
                    }
                }
            }
            for (int64_t t = t0; t < t1; ++t) {
                Candidate* c = sc.cand + (t - t0) * cap;
                const int64_t n = keep_best(c, sc.count[t - t0], K);
                std::sort(c, c + n, [](const Candidate& x, const Candidate& y) { return x.s < y.s; });
                int32_t* idx = indices.ptr<int32_t>() + (b * d.T + t) * K;
                T* out = scores.ptr<T>() + (b * d.T + t) * K;
                for (int64_t i = 0; i < K; ++i) {
                    const bool valid = i < n;
                    idx[i] = valid ? c[i].s : -1;
                    out[i] = valid ? T(c[i].score) : T(0);
                }
            }
        }
    }
}
}  // namespace

void dsa_all_candidates(TensorView indices, std::span<const int64_t> cu_seqlens) {
    const Device device = op_device("dsa_all_candidates", {indices});
    TESSERA_CHECK(indices.ndim() == 3, "dsa_all_candidates: indices must be [B, T, K], not {}", indices.shape.str());
    check_dtype(indices, DType::i32, "dsa_all_candidates: indices");
    check_contiguous(indices, "dsa_all_candidates: indices");
    const int64_t B = indices.size(0), T = indices.size(1), K = indices.size(2);
    const cpu::Segments seg(B, T, cu_seqlens, "dsa_all_candidates");
    for (int64_t s = 0; s < seg.count(); ++s) {
        TESSERA_CHECK(seg.length(s) <= K, "dsa_all_candidates: a sequence of {} tokens needs K >= {}, not {}",
                      seg.length(s), seg.length(s), K);
    }
    if (device == Device::cuda) return TESSERA_ON_CUDA(dsa_all_candidates(indices, cu_seqlens));
    int32_t* out = indices.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < B * T; ++n) {
        const int64_t b = n / T, t = n % T;
        int32_t* row = out + n * K;
        int64_t k = 0;
        for (int64_t c = seg.first_of(b, t); c <= t; ++c) row[k++] = int32_t(c);
        for (; k < K; ++k) row[k] = -1;
    }
}

void dsa_indexer_forward(const DsaIndexerParams& p,
                         TensorView q,
                         TensorView k,
                         TensorView w,
                         TensorView indices,
                         TensorView scores,
                         std::span<std::byte> workspace,
                         std::span<const int64_t> cu_seqlens) {
    note_op_use("dsa_indexer");
    const Device device = op_device("dsa_indexer", {q, k, w, indices, scores});
    const IndexerDims d = check_indexer(q, k, w, "dsa_indexer");
    TESSERA_CHECK(p.topk >= 1, "dsa_indexer: topk must be positive, not {}", p.topk);
    check_shape(indices, Shape{d.B, d.T, p.topk}, "dsa_indexer: indices");
    check_dtype(indices, DType::i32, "dsa_indexer: indices");
    check_shape(scores, Shape{d.B, d.T, p.topk}, "dsa_indexer: scores");
    check_dtype(scores, q.dtype, "dsa_indexer: scores");
    check_contiguous(indices, "dsa_indexer: indices");
    check_contiguous(scores, "dsa_indexer: scores");
    const Segments seg(d.B, d.T, cu_seqlens, "dsa_indexer");
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(dsa_indexer_forward(p, q, k, w, indices, scores, workspace, cu_seqlens));
    dispatch_float(q.dtype, "dsa_indexer",
                   [&]<class T>(T) { indexer_forward<T>(p, d, q, k, w, indices, scores, seg, workspace); });
}

namespace {
// Shared: each row's KL and support flag [B·T], and (with gradients) the dk slab accumulators
// [slabs, B·T, DI]. Per thread, for one row's support of at most n entries (topk, or T dense): the
// support, key pointers, scores I, qᵀ [DI, HI], head dots a and their gradients [n, HI], d(keys) [n, DI].
template <class T>
struct KlShared {
    double* kl;
    uint8_t* has_support;
    T* acc;
    KlShared(const IndexerDims& d, int64_t slabs, bool grads, WorkspaceCursor& c)
        : kl(c.take<double>(size_t(d.B * d.T))),
          has_support(c.take<uint8_t>(size_t(d.B * d.T))),
          acc(grads ? c.take<T>(size_t(slabs * d.B * d.T * d.DI)) : nullptr) {}
};
template <class T>
struct KlScratch {
    int64_t* sup;
    const T** rows;
    double* I;
    T *qt_t, *a, *da, *tmp;
    KlScratch(const IndexerDims& d, int64_t n, WorkspaceCursor& c)
        : sup(c.take<int64_t>(size_t(n))),
          rows(c.take<const T*>(size_t(n))),
          I(c.take<double>(size_t(n))),
          qt_t(c.take<T>(size_t(d.DI * d.HI))),
          a(c.take<T>(size_t(n * d.HI))),
          da(c.take<T>(size_t(n * d.HI))),
          tmp(c.take<T>(size_t(n * d.DI))) {}
};

// Rows are split into `slabs` fixed slabs per batch row; each slab runs on one thread in ascending t
// with a private dk accumulator, and slabs are reduced in order: deterministic on any thread count.
template <class T>
IndexerKlResult indexer_kl_impl(const IndexerDims& d,
                                const TensorView& q,
                                const TensorView& k,
                                const TensorView& w,
                                const TensorView& p,
                                const TensorView& indices,
                                const Segments& seg,
                                double dloss,
                                const TensorView& dq,
                                const TensorView& dk,
                                const TensorView& dw,
                                int64_t slabs,
                                std::span<std::byte> ws) {
    const bool sparse = indices.defined(), grads = dq.defined();
    const int64_t K = sparse ? indices.size(2) : d.T, BT = d.B * d.T;
    const int nt = omp_get_max_threads();
    const size_t shared = cpu::measure_scratch([&](WorkspaceCursor& c) { KlShared<T>(d, slabs, grads, c); });
    const size_t per_thread = cpu::measure_scratch([&](WorkspaceCursor& c) { KlScratch<T>(d, K, c); });
    const ThreadSlices slices(ws, shared, per_thread, nt, "indexer_kl");
    WorkspaceCursor head(slices.head());
    const KlShared<T> sh(d, slabs, grads, head);
    double* kl = sh.kl;
    uint8_t* has_support = sh.has_support;
    // pass 1 (and pass 2 with gradients once N is known): per row, over its support. The head dot products
    // a [n, HI] come from row-pointer small GEMMs over the support's keys in place (no gather copies).
    auto row_pass = [&](int64_t b, int64_t t, double g, T* dk_acc, const KlScratch<T>& r) {
        int64_t* sup = r.sup;
        int64_t n = 0;
        const T* prow = p.ptr<T>() + (b * d.T + t) * K;
        if (sparse) {
            const int32_t* idx = indices.ptr<int32_t>() + (b * d.T + t) * K;
            for (int64_t i = 0; i < K; ++i) {
                if (idx[i] >= 0 && idx[i] < d.T) sup[n++] = i;
            }
        } else {
            for (int64_t s = seg.first_of(b, t); s <= t; ++s) sup[n++] = s;
        }
        kl[b * d.T + t] = 0;
        has_support[b * d.T + t] = n > 0;
        if (n == 0) return;
        const T* qt = q.ptr<T>() + (b * d.T + t) * d.HI * d.DI;
        const T* wt = w.ptr<T>() + (b * d.T + t) * d.HI;
        const int64_t HI = d.HI;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t s = sparse ? indices.ptr<int32_t>()[(b * d.T + t) * K + sup[i]] : sup[i];
            r.rows[i] = k.ptr<T>() + (b * d.T + s) * d.DI;
        }
        cpu::transpose(qt, HI, d.DI, d.DI, r.qt_t, HI);
        cpu::small_gemm_rows_nn(n, HI, d.DI, T(1), r.rows, r.qt_t, HI, T(0), r.a, HI);
        const T* a = r.a;
        double m = -INFINITY, psum = 0;
        for (int64_t i = 0; i < n; ++i) {
            double Ii = 0;
            for (int64_t j = 0; j < HI; ++j) Ii += double(wt[j]) * std::max(double(a[i * HI + j]), 0.0);
            r.I[i] = Ii;
            m = std::max(m, Ii);
            psum += double(prow[sup[i]]);
        }
        double z = 0;
        for (int64_t i = 0; i < n; ++i) z += std::exp(r.I[i] - m);
        const double lse = m + std::log(z);
        double row_kl = 0;
        for (int64_t i = 0; i < n; ++i) {
            const double pi = double(prow[sup[i]]);
            if (pi > 0) row_kl += pi * (std::log(pi) - r.I[i] + lse);
        }
        kl[b * d.T + t] = row_kl;
        if (g == 0) return;
        T* dqt = dq.ptr<T>() + (b * d.T + t) * d.HI * d.DI;
        T* dwt = dw.ptr<T>() + (b * d.T + t) * d.HI;
        for (int64_t i = 0; i < n; ++i) {
            const double dI = g * (std::exp(r.I[i] - lse) * psum - double(prow[sup[i]]));
            for (int64_t j = 0; j < HI; ++j) {
                const double aj = double(a[i * HI + j]);
                dwt[j] += T(dI * std::max(aj, 0.0));
                r.da[i * HI + j] = aj > 0 ? T(dI * double(wt[j])) : T(0);
            }
        }
        // dq_t += daᵀ · keys;  d(keys) = da · q_t, scattered into this slab's accumulator
        cpu::small_gemm_tn_rows(HI, d.DI, n, T(1), r.da, HI, r.rows, T(1), dqt, d.DI);
        cpu::small_gemm_nn(n, d.DI, HI, T(1), r.da, HI, qt, d.DI, T(0), r.tmp, d.DI);
        for (int64_t i = 0; i < n; ++i) {
            T* dks = dk_acc + (r.rows[i] - k.ptr<T>() - b * d.T * d.DI);
            const T* src = r.tmp + i * d.DI;
            for (int64_t e = 0; e < d.DI; ++e) dks[e] += src[e];
        }
    };
    // slab sl of batch row b accumulates into acc[sl][b·T .. (b+1)·T); every row's slabs run at once
    auto run = [&](double g) {
#pragma omp parallel num_threads(nt)
        {
            WorkspaceCursor cur(slices.thread(omp_get_thread_num()));
            const KlScratch<T> scratch(d, K, cur);
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < d.B * slabs; ++task) {
                const int64_t b = task / slabs, sl = task % slabs;
                const int64_t t0 = d.T * sl / slabs, t1 = d.T * (sl + 1) / slabs;
                T* dk_acc = nullptr;
                if (g != 0) {
                    dk_acc = sh.acc + (sl * BT + b * d.T) * d.DI;
                    std::fill(dk_acc, dk_acc + d.T * d.DI, T(0));
                }
                for (int64_t t = t0; t < t1; ++t) row_pass(b, t, g, dk_acc, scratch);
            }
        }
        if (g == 0) return;
        T* dkp = dk.ptr<T>();
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t i = 0; i < BT * d.DI; ++i) {
            for (int64_t sl = 0; sl < slabs; ++sl) dkp[i] += sh.acc[sl * BT * d.DI + i];
        }
    };
    run(0.0);
    IndexerKlResult r;
    double sum = 0;
    for (int64_t i = 0; i < BT; ++i) {
        sum += kl[i];
        r.rows += has_support[i];
    }
    r.loss = r.rows ? sum / double(r.rows) : 0.0;
    if (grads && r.rows > 0 && dloss != 0) run(dloss / double(r.rows));
    return r;
}
}  // namespace

size_t dsa_indexer_workspace_bytes(
    DType dtype, int64_t B, int64_t T, int64_t HI, int64_t DI, int64_t topk, int threads) {
    const IndexerDims d{B, T, HI, DI};
    size_t bytes = 0;
    dispatch_float(dtype, "dsa_indexer", [&]<class T_>(T_) {
        bytes = cpu::measure_scratch([&](WorkspaceCursor& c) { IndexerShared<T_>(d, c); }) +
                cpu::measure_scratch([&](WorkspaceCursor& c) { IndexerScratch<T_>(d, topk, c); }) * size_t(threads);
    });
    return bytes;
}

size_t indexer_kl_workspace_bytes(
    DType dtype, int64_t B, int64_t T, int64_t HI, int64_t DI, int64_t support, int64_t dk_slabs, int threads) {
    const IndexerDims d{B, T, HI, DI};
    size_t bytes = 0;
    dispatch_float(dtype, "indexer_kl", [&]<class T_>(T_) {
        bytes = cpu::measure_scratch([&](WorkspaceCursor& c) { KlShared<T_>(d, dk_slabs, true, c); }) +
                cpu::measure_scratch([&](WorkspaceCursor& c) { KlScratch<T_>(d, support, c); }) * size_t(threads);
    });
    return bytes;
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
                           std::span<std::byte> workspace,
                           int64_t dk_slabs) {
    note_op_use("indexer_kl");
    const Device device = op_device("indexer_kl", {q, k, w, p, indices, dq, dk, dw});
    const IndexerDims d = check_indexer(q, k, w, "indexer_kl");
    TESSERA_CHECK(dk_slabs >= 1, "indexer_kl: dk_slabs must be positive");
    if (indices.defined()) {
        check_dtype(indices, DType::i32, "indexer_kl: indices");
        TESSERA_CHECK(indices.ndim() == 3 && indices.size(0) == d.B && indices.size(1) == d.T,
                      "indexer_kl: indices must be [B = {}, T = {}, TOPK], not {}", d.B, d.T, indices.shape.str());
        check_shape(p, indices.shape, "indexer_kl: p (over the selected entries)");
    } else {
        check_shape(p, Shape{d.B, d.T, d.T}, "indexer_kl: p (dense, over every s <= t)");
    }
    check_contiguous(p, "indexer_kl: p");
    check_dtype(p, q.dtype, "indexer_kl: p");
    if (indices.defined()) check_contiguous(indices, "indexer_kl: indices");
    if (dq.defined()) {
        for (const auto& [g, like, what] :
             {std::tuple{&dq, &q, "indexer_kl: dq"}, std::tuple{&dk, &k, "indexer_kl: dk"},
              std::tuple{&dw, &w, "indexer_kl: dw"}}) {
            check_shape(*g, like->shape, what);
            check_dtype(*g, q.dtype, what);
            check_contiguous(*g, what);
        }
    }
    const Segments seg(d.B, d.T, cu_seqlens, "indexer_kl");
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(indexer_kl(q, k, w, p, indices, cu_seqlens, dloss, dq, dk, dw, workspace, dk_slabs));
    IndexerKlResult r;
    dispatch_float(q.dtype, "indexer_kl", [&]<class T>(T) {
        r = indexer_kl_impl<T>(d, q, k, w, p, indices, seg, dloss, dq, dk, dw, dk_slabs, workspace);
    });
    return r;
}

}  // namespace tessera::ops
