// Attention's entry points (checks, then CUDA tensors to ops/cuda) and flash-style attention on the CPU, per sequence
// (batch row or packed segment). Tiles multiply with the register-blocked small GEMM (ops/cpu/small_gemm.h) and the
// online softmax runs in vectorized loops. f64 uses the same algorithm with the reference loops.
#include "ops/attention.h"

#include <omp.h>

#include <cmath>
#include <limits>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/small_gemm.h"
#include "ops/cpu/vec_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Segments;
using cpu::small_gemm_nn;
using cpu::small_gemm_tn;
using cpu::transpose;
using cpu::WorkspaceCursor;

namespace {
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 128;

size_t round64(size_t b) { return (b + 63) / 64 * 64; }

// forward: S [BQ, BK], acc [BQ, D], m and l [BQ], Kᵀ [D, BK];
// backward: Di [T], P and dP [BQ, BK], Kᵀ and Vᵀ [D, BK]
size_t per_thread_bytes(size_t elem, int64_t T, int64_t D) {
    const size_t tile = round64(kBlockQ * kBlockK * elem), kt = round64(size_t(D) * kBlockK * elem);
    size_t fwd = tile + round64(kBlockQ * D * elem) + 2 * round64(kBlockQ * elem) + kt;
    size_t bwd = round64(size_t(T) * elem) + 2 * tile + 2 * kt;
    return std::max(fwd, bwd);
}

struct Dims {
    int64_t B, T, H, HKV, D;
};

Dims check_inputs(
    const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o, const TensorView& lse) {
    TESSERA_CHECK(q.ndim() == 4, "attention: q must be [B, T, H, D], not {}", q.shape.str());
    TESSERA_CHECK(k.ndim() == 4 && v.ndim() == 4, "attention: k and v must be [B, T, HKV, D]");
    Dims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
    TESSERA_CHECK(k.size(0) == d.B && k.size(1) == d.T && k.size(3) == d.D,
                  "attention: k {} does not match q {} (batch, time and head dim must agree)", k.shape.str(),
                  q.shape.str());
    TESSERA_CHECK(v.shape == k.shape, "attention: v {} must be shaped like k {}", v.shape.str(), k.shape.str());
    TESSERA_CHECK(d.HKV >= 1 && d.H % d.HKV == 0, "attention: {} query heads are not a multiple of {} kv heads", d.H,
                  d.HKV);
    check_shape(o, q.shape, "attention: o");
    check_shape(lse, Shape{d.B, d.H, d.T}, "attention: lse");
    check_contiguous(lse, "attention: lse");
    for (const TensorView* t : {&q, &k, &v, &o, &lse}) {
        TESSERA_CHECK(t->dtype == q.dtype, "attention: tensors must share one dtype (q is {}, found {})",
                      dtype_name(q.dtype), dtype_name(t->dtype));
        TESSERA_CHECK(t == &lse || t->strides[3] == 1, "attention: the head dimension must be contiguous");
    }
    return d;
}

// Pointer to row (b, t, h) of a [B, T, H, D] view
template <class T>
inline T* at(const TensorView& x, int64_t b, int64_t t, int64_t h) {
    return static_cast<T*>(x.data) + b * x.strides[0] + t * x.strides[1] + h * x.strides[2];
}

template <class T>
void forward_impl(const AttentionParams& p,
                  const Dims& d,
                  const Segments& seg,
                  const TensorView& q,
                  const TensorView& k,
                  const TensorView& v,
                  const TensorView& o,
                  const TensorView& lse,
                  std::span<std::byte> ws) {
    const T scale = T(p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(d.D)));
    const int64_t group = d.H / d.HKV;
    const size_t per_thread = per_thread_bytes(sizeof(T), d.T, d.D);
    const int nt = omp_get_max_threads();
    TESSERA_CHECK(ws.size() >= per_thread * size_t(nt), "attention: workspace {} bytes < {} needed", ws.size(),
                  per_thread * size_t(nt));
    T* LSE = lse.ptr<T>();
    const T neg_inf = -std::numeric_limits<T>::infinity();
#pragma omp parallel num_threads(nt)
    {
        WorkspaceCursor cur(ws.subspan(per_thread * size_t(omp_get_thread_num()), per_thread));
        T* S = cur.take<T>(kBlockQ * kBlockK);
        T* acc = cur.take<T>(kBlockQ * d.D);
        T* m = cur.take<T>(kBlockQ);
        T* l = cur.take<T>(kBlockQ);
        T* Kt = cur.take<T>(d.D * kBlockK);
        for (int64_t s = 0; s < seg.count(); ++s) {  // every thread walks the sequences; tasks are split
            const int64_t b = seg.batch(s), first = seg.start(s), len = seg.length(s);
            const int64_t num_qblocks = (len + kBlockQ - 1) / kBlockQ;
#pragma omp for collapse(2) schedule(dynamic) nowait
            for (int64_t h = 0; h < d.H; ++h) {
                for (int64_t qb = 0; qb < num_qblocks; ++qb) {
                    // t0, s0: positions within the sequence; its row index is first + position
                    const int64_t t0 = qb * kBlockQ, nq = std::min(kBlockQ, len - t0), hk = h / group;
                    const T* Q = at<T>(q, b, first + t0, h);
                    for (int64_t i = 0; i < nq * d.D; ++i) acc[i] = 0;
                    for (int64_t i = 0; i < nq; ++i) {
                        m[i] = neg_inf;
                        l[i] = 0;
                    }
                    const int64_t kend = p.causal ? t0 + nq : len;
                    for (int64_t s0 = 0; s0 < kend; s0 += kBlockK) {
                        const int64_t nk = std::min(kBlockK, kend - s0);
                        transpose(at<T>(k, b, first + s0, hk), nk, d.D, k.strides[1], Kt, nk);
                        small_gemm_nn(nq, nk, d.D, scale, Q, q.strides[1], Kt, nk, T(0), S, kBlockK);
                        for (int64_t i = 0; i < nq; ++i) {
                            T* srow = S + i * kBlockK;
                            // causal: key s0 + j is visible to query t0 + i when s0 + j <= t0 + i
                            const int64_t nvis = p.causal ? std::min(nk, std::max<int64_t>(0, t0 + i - s0 + 1)) : nk;
                            for (int64_t j = nvis; j < nk; ++j) srow[j] = neg_inf;
                            if (nvis == 0) continue;
                            T mx = m[i];
                            for (int64_t j = 0; j < nvis; ++j) mx = std::max(mx, srow[j]);
                            const T alpha = cpu::vexp(m[i] - mx);
                            T sum = 0;
#pragma omp simd reduction(+ : sum)
                            for (int64_t j = 0; j < nk; ++j) {
                                srow[j] = cpu::vexp(srow[j] - mx);
                                sum += srow[j];
                            }
                            l[i] = l[i] * alpha + sum;
                            m[i] = mx;
                            T* arow = acc + i * d.D;
                            for (int64_t c = 0; c < d.D; ++c) arow[c] *= alpha;
                        }
                        small_gemm_nn(nq, d.D, nk, T(1), S, kBlockK, at<T>(v, b, first + s0, hk), v.strides[1], T(1),
                                      acc, d.D);
                    }
                    for (int64_t i = 0; i < nq; ++i) {
                        T* orow = at<T>(o, b, first + t0 + i, h);
                        const T inv = T(1) / l[i];
                        for (int64_t c = 0; c < d.D; ++c) orow[c] = acc[i * d.D + c] * inv;
                        LSE[(b * d.H + h) * d.T + first + t0 + i] = m[i] + T(std::log(double(l[i])));
                    }
                }
            }
        }
    }
}

template <class T>
void backward_impl(const AttentionParams& p,
                   const Dims& d,
                   const Segments& seg,
                   const TensorView& dout,
                   const TensorView& q,
                   const TensorView& k,
                   const TensorView& v,
                   const TensorView& o,
                   const TensorView& lse,
                   const TensorView& dq,
                   const TensorView& dk,
                   const TensorView& dv,
                   std::span<std::byte> ws) {
    const T scale = T(p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(d.D)));
    const int64_t group = d.H / d.HKV;
    const size_t per_thread = per_thread_bytes(sizeof(T), d.T, d.D);
    const int nt = omp_get_max_threads();
    TESSERA_CHECK(ws.size() >= per_thread * size_t(nt), "attention: workspace {} bytes < {} needed", ws.size(),
                  per_thread * size_t(nt));
    const T* LSE = lse.ptr<T>();
#pragma omp parallel num_threads(nt)
    {
        WorkspaceCursor cur(ws.subspan(per_thread * size_t(omp_get_thread_num()), per_thread));
        T* Di = cur.take<T>(size_t(d.T));
        T* P = cur.take<T>(kBlockQ * kBlockK);
        T* dP = cur.take<T>(kBlockQ * kBlockK);
        T* Kt = cur.take<T>(d.D * kBlockK);
        T* Vt = cur.take<T>(d.D * kBlockK);
        for (int64_t s = 0; s < seg.count(); ++s) {
            const int64_t b = seg.batch(s), first = seg.start(s), len = seg.length(s);
            // NOTES: a task owns (sequence, kv head): it alone writes those rows of dk, dv and of dq
            // for the query heads of its group, so there are no races and no order-dependent sums.
#pragma omp for schedule(dynamic) nowait
            for (int64_t hk = 0; hk < d.HKV; ++hk) {
                for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
                    for (int64_t t = 0; t < len; ++t) {
                        const T* dor = at<T>(dout, b, first + t, h);
                        const T* orow = at<T>(o, b, first + t, h);
                        T acc = 0;
                        for (int64_t c = 0; c < d.D; ++c) acc += dor[c] * orow[c];
                        Di[t] = acc;
                    }
                    const T* L = LSE + (b * d.H + h) * d.T + first;
                    for (int64_t s0 = 0; s0 < len; s0 += kBlockK) {
                        const int64_t nk = std::min(kBlockK, len - s0);
                        const T* K = at<T>(k, b, first + s0, hk);
                        T* dK = at<T>(dk, b, first + s0, hk);
                        T* dV = at<T>(dv, b, first + s0, hk);
                        transpose(K, nk, d.D, k.strides[1], Kt, nk);
                        transpose(at<T>(v, b, first + s0, hk), nk, d.D, v.strides[1], Vt, nk);
                        const int64_t qstart = p.causal ? s0 / kBlockQ * kBlockQ : 0;
                        for (int64_t t0 = qstart; t0 < len; t0 += kBlockQ) {
                            const int64_t nq = std::min(kBlockQ, len - t0);
                            const T* Q = at<T>(q, b, first + t0, h);
                            const T* dO = at<T>(dout, b, first + t0, h);
                            small_gemm_nn(nq, nk, d.D, scale, Q, q.strides[1], Kt, nk, T(0), P, kBlockK);
                            for (int64_t i = 0; i < nq; ++i) {
                                T* prow = P + i * kBlockK;
                                const int64_t nvis =
                                    p.causal ? std::min(nk, std::max<int64_t>(0, t0 + i - s0 + 1)) : nk;
                                const T li = L[t0 + i];
#pragma omp simd
                                for (int64_t j = 0; j < nvis; ++j) prow[j] = cpu::vexp(prow[j] - li);
                                for (int64_t j = nvis; j < nk; ++j) prow[j] = 0;
                            }
                            small_gemm_tn(nk, d.D, nq, T(1), P, kBlockK, dO, dout.strides[1], T(1), dV, dv.strides[1]);
                            small_gemm_nn(nq, nk, d.D, T(1), dO, dout.strides[1], Vt, nk, T(0), dP, kBlockK);
                            for (int64_t i = 0; i < nq; ++i) {
                                T* prow = P + i * kBlockK;
                                const T* dprow = dP + i * kBlockK;
                                const T di = Di[t0 + i];
#pragma omp simd
                                for (int64_t j = 0; j < nk; ++j) prow[j] = prow[j] * (dprow[j] - di) * scale;
                            }
                            small_gemm_nn(nq, d.D, nk, T(1), P, kBlockK, K, k.strides[1], T(1),
                                          at<T>(dq, b, first + t0, h), dq.strides[1]);
                            small_gemm_tn(nk, d.D, nq, T(1), P, kBlockK, Q, q.strides[1], T(1), dK, dk.strides[1]);
                        }
                    }
                }
            }
        }
    }
}
}  // namespace

size_t attention_workspace_bytes(DType dtype, int64_t T, int64_t D, int num_threads) {
    return per_thread_bytes(dtype_size(dtype), T, D) * size_t(num_threads);
}

double attention_forward_flops(int64_t B, int64_t T, int64_t H, int64_t D, bool causal) {
    const double pairs = causal ? double(T) * double(T + 1) / 2.0 : double(T) * double(T);
    return 4.0 * double(B) * double(H) * double(D) * pairs;
}

void attention_forward(const AttentionParams& p,
                       TensorView q,
                       TensorView k,
                       TensorView v,
                       TensorView o,
                       TensorView lse,
                       std::span<std::byte> workspace,
                       std::span<const int64_t> cu_seqlens) {
    note_op_use("attention");
    const Device device = op_device("attention", {q, k, v, o, lse});
    Dims d = check_inputs(q, k, v, o, lse);
    const Segments seg(d.B, d.T, cu_seqlens, "attention");
    if (device == Device::cuda) return TESSERA_ON_CUDA(attention_forward(p, q, k, v, o, lse, workspace, cu_seqlens));
    dispatch_float(q.dtype, "attention", [&]<class T>(T) { forward_impl<T>(p, d, seg, q, k, v, o, lse, workspace); });
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
                        std::span<std::byte> workspace,
                        std::span<const int64_t> cu_seqlens) {
    const Device device = op_device("attention", {dout, q, k, v, o, lse, dq, dk, dv});
    Dims d = check_inputs(q, k, v, o, lse);
    const Segments seg(d.B, d.T, cu_seqlens, "attention");
    check_shape(dout, q.shape, "attention: do");
    check_shape(dq, q.shape, "attention: dq");
    check_shape(dk, k.shape, "attention: dk");
    check_shape(dv, v.shape, "attention: dv");
    for (const TensorView* t : {&dout, &dq, &dk, &dv}) {
        TESSERA_CHECK(t->dtype == q.dtype && t->strides[3] == 1,
                      "attention: gradients must be {} with a contiguous head dimension", dtype_name(q.dtype));
    }
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(attention_backward(p, dout, q, k, v, o, lse, dq, dk, dv, workspace, cu_seqlens));
    dispatch_float(q.dtype, "attention",
                   [&]<class T>(T) { backward_impl<T>(p, d, seg, dout, q, k, v, o, lse, dq, dk, dv, workspace); });
}

}  // namespace tessera::ops
