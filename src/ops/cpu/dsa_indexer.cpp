// The lightning indexer (streaming scores + running top-k) and its KL loss on the CPU (dsa.h).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/kernel_util.h"
#include "ops/cpu/small_gemm.h"
#include "ops/dsa.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Segments;

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

void keep_best(std::vector<Candidate>& c, int64_t k) {
    if (int64_t(c.size()) <= k) return;
    std::nth_element(c.begin(), c.begin() + k, c.end(), better);
    c.resize(size_t(k));
}

struct IndexerDims {
    int64_t B, T, HI, DI;
};

IndexerDims check_indexer(const TensorView& q, const TensorView& k, const TensorView& w, std::string_view op) {
    TESSERA_CHECK(q.ndim() == 4, "{}: q must be [B, T, HI, DI], not {}", op, q.shape.str());
    const IndexerDims d{q.size(0), q.size(1), q.size(2), q.size(3)};
    check_shape(k, Shape{d.B, d.T, d.DI}, fmt::format("{}: k", op));
    check_shape(w, Shape{d.B, d.T, d.HI}, fmt::format("{}: w", op));
    for (const TensorView* t : {&q, &k, &w}) {
        check_contiguous(*t, op);
        TESSERA_CHECK(t->dtype == q.dtype, "{}: q, k and w must share one dtype", op);
    }
    return d;
}

template <class T>
void indexer_forward(const DsaIndexerParams& p,
                     const IndexerDims& d,
                     const TensorView& q,
                     const TensorView& k,
                     const TensorView& w,
                     const TensorView& indices,
                     const TensorView& scores,
                     const Segments& seg) {
    const int64_t K = p.topk, Tp = (d.T + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    std::vector<T> kt(static_cast<size_t>(d.DI * Tp));
    for (int64_t b = 0; b < d.B; ++b) {
        std::fill(kt.begin(), kt.end(), T(0));
        cpu::transpose(k.ptr<T>() + b * d.T * d.DI, d.T, d.DI, d.DI, kt.data(), Tp);  // [DI, Tp]
        const int64_t blocks = (d.T + kQueryBlock - 1) / kQueryBlock;
#pragma omp parallel
        {
            std::vector<T> a(static_cast<size_t>(kQueryBlock * d.HI * kKeyBlock));
            std::vector<std::vector<Candidate>> cand(static_cast<size_t>(kQueryBlock));
#pragma omp for schedule(dynamic)
            for (int64_t qb = 0; qb < blocks; ++qb) {
                const int64_t t0 = qb * kQueryBlock, t1 = std::min(d.T, t0 + kQueryBlock);
                int64_t lo = t1;
                for (int64_t t = t0; t < t1; ++t) {
                    cand[size_t(t - t0)].clear();
                    lo = std::min(lo, seg.first_of(b, t));
                }
                const T* qrows = q.ptr<T>() + (b * d.T + t0) * d.HI * d.DI;
                for (int64_t s0 = lo / kKeyBlock * kKeyBlock; s0 < t1; s0 += kKeyBlock) {
                    cpu::small_gemm_nn((t1 - t0) * d.HI, kKeyBlock, d.DI, T(1), qrows, d.DI, kt.data() + s0, Tp, T(0),
                                       a.data(), kKeyBlock);
                    for (int64_t t = t0; t < t1; ++t) {
                        const T* wt = w.ptr<T>() + (b * d.T + t) * d.HI;
                        const T* at = a.data() + (t - t0) * d.HI * kKeyBlock;
                        auto& c = cand[size_t(t - t0)];
                        const int64_t s_end = std::min(s0 + kKeyBlock, t + 1);
                        for (int64_t s = std::max(s0, seg.first_of(b, t)); s < s_end; ++s) {
                            T score = 0;
                            for (int64_t j = 0; j < d.HI; ++j)
                                score += wt[j] * std::max(at[j * kKeyBlock + s - s0], T(0));
                            if (std::isnan(score) || score == -std::numeric_limits<T>::infinity()) continue;
                            c.push_back({double(score), int32_t(s)});
                            if (int64_t(c.size()) >= 2 * K) keep_best(c, K);
                        }
                    }
                }
                for (int64_t t = t0; t < t1; ++t) {
                    auto& c = cand[size_t(t - t0)];
                    keep_best(c, K);
                    std::sort(c.begin(), c.end(), [](const Candidate& x, const Candidate& y) { return x.s < y.s; });
                    int32_t* idx = indices.ptr<int32_t>() + (b * d.T + t) * K;
                    T* sc = scores.ptr<T>() + (b * d.T + t) * K;
                    for (int64_t i = 0; i < K; ++i) {
                        const bool valid = i < int64_t(c.size());
                        idx[i] = valid ? c[size_t(i)].s : -1;
                        sc[i] = valid ? T(c[size_t(i)].score) : T(0);
                    }
                }
            }
        }
    }
}
}  // namespace

void dsa_indexer_forward(const DsaIndexerParams& p,
                         TensorView q,
                         TensorView k,
                         TensorView w,
                         TensorView indices,
                         TensorView scores,
                         std::span<const int64_t> cu_seqlens) {
    const IndexerDims d = check_indexer(q, k, w, "dsa_indexer");
    TESSERA_CHECK(p.topk >= 1, "dsa_indexer: topk must be positive, not {}", p.topk);
    check_shape(indices, Shape{d.B, d.T, p.topk}, "dsa_indexer: indices");
    check_dtype(indices, DType::i32, "dsa_indexer: indices");
    check_shape(scores, Shape{d.B, d.T, p.topk}, "dsa_indexer: scores");
    const Segments seg(d.B, d.T, cu_seqlens, "dsa_indexer");
    dispatch_float(q.dtype, "dsa_indexer",
                   [&]<class T>(T) { indexer_forward<T>(p, d, q, k, w, indices, scores, seg); });
}

namespace {
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
                                int64_t slabs) {
    const bool sparse = indices.defined(), grads = dq.defined();
    const int64_t K = sparse ? indices.size(2) : d.T;
    std::vector<double> kl(static_cast<size_t>(d.B * d.T), 0.0);
    std::vector<uint8_t> has_support(static_cast<size_t>(d.B * d.T), 0);
    // pass 1 (and pass 2 with gradients once N is known): per row, over its support. The head dot products
    // a [n, HI] come from row-pointer small GEMMs over the support's keys in place (no gather copies).
    struct RowScratch {
        std::vector<int64_t> sup;
        std::vector<const T*> rows;
        std::vector<double> I;
        std::vector<T> qt_t, a, da, tmp;
    };
    auto row_pass = [&](int64_t b, int64_t t, double g, T* dk_acc, RowScratch& r) {
        auto& sup = r.sup;
        sup.clear();
        const T* prow = p.ptr<T>() + (b * d.T + t) * K;
        if (sparse) {
            const int32_t* idx = indices.ptr<int32_t>() + (b * d.T + t) * K;
            for (int64_t i = 0; i < K; ++i) {
                if (idx[i] >= 0 && idx[i] < d.T) sup.push_back(i);
            }
        } else {
            for (int64_t s = seg.first_of(b, t); s <= t; ++s) sup.push_back(s);
        }
        if (sup.empty()) return;
        has_support[size_t(b * d.T + t)] = 1;
        const T* qt = q.ptr<T>() + (b * d.T + t) * d.HI * d.DI;
        const T* wt = w.ptr<T>() + (b * d.T + t) * d.HI;
        const int64_t n = int64_t(sup.size()), HI = d.HI;
        r.rows.resize(size_t(n));
        for (int64_t i = 0; i < n; ++i) {
            const int64_t s = sparse ? indices.ptr<int32_t>()[(b * d.T + t) * K + sup[size_t(i)]] : sup[size_t(i)];
            r.rows[size_t(i)] = k.ptr<T>() + (b * d.T + s) * d.DI;
        }
        r.qt_t.resize(size_t(d.DI * HI));
        cpu::transpose(qt, HI, d.DI, d.DI, r.qt_t.data(), HI);
        r.a.resize(size_t(n * HI));
        cpu::small_gemm_rows_nn(n, HI, d.DI, T(1), r.rows.data(), r.qt_t.data(), HI, T(0), r.a.data(), HI);
        const T* a = r.a.data();
        r.I.assign(size_t(n), 0.0);
        double m = -INFINITY, psum = 0;
        for (int64_t i = 0; i < n; ++i) {
            double Ii = 0;
            for (int64_t j = 0; j < HI; ++j) Ii += double(wt[j]) * std::max(double(a[i * HI + j]), 0.0);
            r.I[size_t(i)] = Ii;
            m = std::max(m, Ii);
            psum += double(prow[sup[size_t(i)]]);
        }
        double z = 0;
        for (int64_t i = 0; i < n; ++i) z += std::exp(r.I[size_t(i)] - m);
        const double lse = m + std::log(z);
        double row_kl = 0;
        for (int64_t i = 0; i < n; ++i) {
            const double pi = double(prow[sup[size_t(i)]]);
            if (pi > 0) row_kl += pi * (std::log(pi) - r.I[size_t(i)] + lse);
        }
        kl[size_t(b * d.T + t)] = row_kl;
        if (g == 0) return;
        T* dqt = dq.ptr<T>() + (b * d.T + t) * d.HI * d.DI;
        T* dwt = dw.ptr<T>() + (b * d.T + t) * d.HI;
        r.da.resize(size_t(n * HI));
        for (int64_t i = 0; i < n; ++i) {
            const double dI = g * (std::exp(r.I[size_t(i)] - lse) * psum - double(prow[sup[size_t(i)]]));
            for (int64_t j = 0; j < HI; ++j) {
                const double aj = double(a[i * HI + j]);
                dwt[j] += T(dI * std::max(aj, 0.0));
                r.da[size_t(i * HI + j)] = aj > 0 ? T(dI * double(wt[j])) : T(0);
            }
        }
        // dq_t += daᵀ · keys;  d(keys) = da · q_t, scattered into this slab's accumulator
        cpu::small_gemm_tn_rows(HI, d.DI, n, T(1), r.da.data(), HI, r.rows.data(), T(1), dqt, d.DI);
        r.tmp.resize(size_t(n * d.DI));
        cpu::small_gemm_nn(n, d.DI, HI, T(1), r.da.data(), HI, qt, d.DI, T(0), r.tmp.data(), d.DI);
        for (int64_t i = 0; i < n; ++i) {
            T* dks = dk_acc + (r.rows[size_t(i)] - k.ptr<T>() - b * d.T * d.DI);
            const T* src = r.tmp.data() + i * d.DI;
            for (int64_t e = 0; e < d.DI; ++e) dks[e] += src[e];
        }
    };
    auto run = [&](double g) {
        std::vector<T> acc(static_cast<size_t>(g != 0 ? slabs * d.T * d.DI : 0));
        for (int64_t b = 0; b < d.B; ++b) {
            std::fill(acc.begin(), acc.end(), T(0));
#pragma omp parallel
            {
                RowScratch scratch;
#pragma omp for schedule(dynamic)
                for (int64_t sl = 0; sl < slabs; ++sl) {
                    const int64_t t0 = d.T * sl / slabs, t1 = d.T * (sl + 1) / slabs;
                    T* dk_acc = g != 0 ? acc.data() + sl * d.T * d.DI : nullptr;
                    for (int64_t t = t0; t < t1; ++t) row_pass(b, t, g, dk_acc, scratch);
                }
            }
            if (g == 0) continue;
            T* dkb = dk.ptr<T>() + b * d.T * d.DI;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < d.T * d.DI; ++i) {
                for (int64_t sl = 0; sl < slabs; ++sl) dkb[i] += acc[size_t(sl * d.T * d.DI + i)];
            }
        }
    };
    run(0.0);
    IndexerKlResult r;
    double sum = 0;
    for (size_t i = 0; i < kl.size(); ++i) {
        sum += kl[i];
        r.rows += has_support[i];
    }
    r.loss = r.rows ? sum / double(r.rows) : 0.0;
    if (grads && r.rows > 0 && dloss != 0) run(dloss / double(r.rows));
    return r;
}
}  // namespace

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
                           int64_t dk_slabs) {
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
    if (dq.defined()) {
        check_shape(dq, q.shape, "indexer_kl: dq");
        check_shape(dk, k.shape, "indexer_kl: dk");
        check_shape(dw, w.shape, "indexer_kl: dw");
    }
    const Segments seg(d.B, d.T, cu_seqlens, "indexer_kl");
    IndexerKlResult r;
    dispatch_float(q.dtype, "indexer_kl", [&]<class T>(T) {
        r = indexer_kl_impl<T>(d, q, k, w, p, indices, seg, dloss, dq, dk, dw, dk_slabs);
    });
    return r;
}

}  // namespace tessera::ops
