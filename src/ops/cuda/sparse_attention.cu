// DSA's sparse MQA attention on CUDA (ops/dsa.h): every query attends to its selected entries of kv (−1 and
// out-of-range indices skipped); the value is the first DV dims of the same entry.
//   forward, dq: one block per (query, head); the block streams the row's entries kBlockEntries at a time, a thread
//     per entry computing its score, the online softmax over the chunk by fixed-order block reductions, then a
//     thread per output dim summing the chunk in entry order.
//   probs: one block per query, a thread per entry summing the heads in order.
//   dkv: the CPU's scheme B (spec/dsa.md §3.7): the queries of a batch row split into `slabs` fixed slabs (the
//     entry point's count, attention_ops.cpp: scatter_slabs), each scattered into a private [T, DK] accumulator by
//     one column of blocks (slab, dims chunk) walking its queries in ascending order and each row's entries in row
//     order (no atomics), the slabs then added in slab order.
// Every sum has one order: bitwise run-to-run. The heads' scores are recomputed per kernel, not shared between
// heads (MQA's reuse of an entry across heads is left to a later, tensor-core version).
#include <cmath>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
constexpr int kEntries = 128;  // entries per chunk = threads per block of the per-query kernels
constexpr int kPairs = 32;     // entries per step of the dkv kernel

template <class T>
__device__ inline bool entry_ok(int32_t s, int64_t T_) {
    return s >= 0 && s < T_;
}

// scale·q·e over DK and dO·e over DV for one entry row e (either output may be skipped by a null pointer).
template <class T>
__device__ inline void entry_dots(const T* q, const T* go, const T* e, int64_t DK, int64_t DV, T scale, T& z, T* dp) {
    T acc = 0;
    for (int64_t d = 0; d < DK; ++d) acc += q[d] * e[d];
    z = scale * acc;
    if (dp) {
        T a = 0;
        for (int64_t d = 0; d < DV; ++d) a += go[d] * e[d];
        *dp = a;
    }
}

template <class T>
__global__ void forward_kernel(SparseShape s, const T* q, const T* kv, const int32_t* idx, T* o, T* lse) {
    __shared__ T p[kEntries];
    __shared__ int32_t rows[kEntries];
    __shared__ T red[kEntries / 32];
    const int64_t bt = blockIdx.x, h = blockIdx.y, b = bt / s.T, tid = threadIdx.x;
    const T* qh = q + (bt * s.H + h) * s.DK;
    const T* kvb = kv + b * s.T * s.DK;
    const T scale = T(s.scale), inf = T(INFINITY);
    T m = -inf, l = 0;
    T acc[4] = {0, 0, 0, 0};  // dims tid, tid + 128, ... (DV <= 4·kEntries)
    for (int64_t i0 = 0; i0 < s.K; i0 += kEntries) {
        const int64_t i = i0 + tid;
        const int32_t sel = i < s.K ? idx[bt * s.K + i] : -1;
        T z = -inf;
        if (entry_ok<T>(sel, s.T)) entry_dots<T>(qh, nullptr, kvb + int64_t(sel) * s.DK, s.DK, 0, scale, z, nullptr);
        const T mx = max(m, block_max(z, red));
        if (mx == -inf) continue;  // no valid entry yet (uniform over the block)
        const T alpha = m == -inf ? T(0) : exp(m - mx);
        const T e = z == -inf ? T(0) : exp(z - mx);
        p[tid] = e;
        rows[tid] = entry_ok<T>(sel, s.T) ? sel : -1;
        l = alpha * l + block_sum(e, red);  // block_sum's barriers also publish p and rows
        m = mx;
        for (int c = 0; c < 4; ++c) {
            const int64_t d = tid + c * int64_t(kEntries);
            if (d >= s.DV) break;
            T a = acc[c] * alpha;
            for (int j = 0; j < kEntries; ++j)
                if (rows[j] >= 0) a += p[j] * kvb[int64_t(rows[j]) * s.DK + d];
            acc[c] = a;
        }
        __syncthreads();  // p and rows are read before the next chunk writes them
    }
    T* ot = o + (bt * s.H + h) * s.DV;
    for (int c = 0; c < 4; ++c) {
        const int64_t d = tid + c * int64_t(kEntries);
        if (d < s.DV) ot[d] = l > 0 ? acc[c] / l : T(0);
    }
    if (tid == 0) lse[bt * s.H + h] = l > 0 ? m + log(l) : inf;
}

template <class T>
__global__ void probs_kernel(SparseShape s, const T* q, const T* kv, const int32_t* idx, const T* lse, T* probs) {
    const int64_t bt = blockIdx.x, b = bt / s.T;
    const T scale = T(s.scale), inv_h = T(1.0 / double(s.H));
    for (int64_t i = threadIdx.x; i < s.K; i += blockDim.x) {
        const int32_t sel = idx[bt * s.K + i];
        T sum = 0;
        if (entry_ok<T>(sel, s.T)) {
            const T* e = kv + (b * s.T + sel) * s.DK;
            for (int64_t h = 0; h < s.H; ++h) {
                const T l = lse[bt * s.H + h];
                if (isinf(l)) continue;
                T z;
                entry_dots<T>(q + (bt * s.H + h) * s.DK, nullptr, e, s.DK, 0, scale, z, nullptr);
                sum += exp(z - l);
            }
        }
        probs[bt * s.K + i] = sum * inv_h;
    }
}

// Δ[bt, h] = Σ_d dO·O
template <class T>
__global__ void delta_kernel(int64_t rows, int64_t DV, const T* dout, const T* o, T* delta) {
    for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
        T acc = 0;
        for (int64_t d = 0; d < DV; ++d) acc += dout[r * DV + d] * o[r * DV + d];
        delta[r] = acc;
    }
}

// dq[bt, h] += scale·Σ_i dz_i·kv[s_i] with dz = p·(dO·v − Δ), p = exp(z − lse).
template <class T>
__global__ void dq_kernel(
    SparseShape s, const T* dout, const T* q, const T* kv, const int32_t* idx, const T* lse, const T* delta, T* dq) {
    __shared__ T dz[kEntries];
    __shared__ int32_t rows[kEntries];
    const int64_t bt = blockIdx.x, h = blockIdx.y, b = bt / s.T, tid = threadIdx.x, r = bt * s.H + h;
    const T L = lse[r];
    if (isinf(L)) return;  // no valid entry: nothing flows back (uniform over the block)
    const T* qh = q + r * s.DK;
    const T* gh = dout + r * s.DV;
    const T* kvb = kv + b * s.T * s.DK;
    const T scale = T(s.scale), D = delta[r];
    T acc[5] = {0, 0, 0, 0, 0};  // dims tid + c·128 (DK <= 5·kEntries)
    for (int64_t i0 = 0; i0 < s.K; i0 += kEntries) {
        const int64_t i = i0 + tid;
        const int32_t sel = i < s.K ? idx[bt * s.K + i] : -1;
        T g = 0;
        if (entry_ok<T>(sel, s.T)) {
            T z, dp;
            entry_dots<T>(qh, gh, kvb + int64_t(sel) * s.DK, s.DK, s.DV, scale, z, &dp);
            g = exp(z - L) * (dp - D);
        }
        __syncthreads();  // the previous chunk is consumed
        dz[tid] = g;
        rows[tid] = entry_ok<T>(sel, s.T) ? sel : -1;
        __syncthreads();
        for (int c = 0; c < 5; ++c) {
            const int64_t d = tid + c * int64_t(kEntries);
            if (d >= s.DK) break;
            T a = acc[c];
            for (int j = 0; j < kEntries; ++j)
                if (rows[j] >= 0) a += dz[j] * kvb[int64_t(rows[j]) * s.DK + d];
            acc[c] = a;
        }
    }
    T* g = dq + r * s.DK;
    for (int c = 0; c < 5; ++c) {
        const int64_t d = tid + c * int64_t(kEntries);
        if (d < s.DK) g[d] += scale * acc[c];
    }
}

// Slab sl of batch row b: acc[sl][b·T + s] += scale·Σ_h dz_{t,i,h}·q[t, h] (+ Σ_h p_{t,i,h}·dO[t, h] on the value
// dims) over its queries t ascending and their entries i in row order; blockIdx.z picks 128 dims.
template <class T>
__global__ void dkv_kernel(SparseShape s,
                           int64_t slabs,
                           const T* dout,
                           const T* q,
                           const T* kv,
                           const int32_t* idx,
                           const T* lse,
                           const T* delta,
                           T* acc) {
    unsigned char* smem_raw = dynamic_shared();
    T* P = reinterpret_cast<T*>(smem_raw);  // [kPairs][H]
    T* DZ = P + kPairs * s.H;               // [kPairs][H]
    __shared__ int32_t rows[kPairs];
    const int64_t b = blockIdx.x, sl = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int64_t d = blockIdx.z * nt + tid;
    const T* kvb = kv + b * s.T * s.DK;
    T* slab = acc + (sl * s.B * s.T + b * s.T) * s.DK;
    const T scale = T(s.scale);
    for (int64_t t = s.T * sl / slabs; t < s.T * (sl + 1) / slabs; ++t) {
        const int64_t bt = b * s.T + t;
        for (int64_t i0 = 0; i0 < s.K; i0 += kPairs) {
            __syncthreads();  // the previous step's P, DZ and rows are consumed
            for (int64_t x = tid; x < kPairs * s.H; x += nt) {
                const int64_t i = i0 + x / s.H, h = x % s.H, r = bt * s.H + h;
                const int32_t sel = i < s.K ? idx[bt * s.K + i] : -1;
                T pr = 0, g = 0;
                if (entry_ok<T>(sel, s.T) && !isinf(lse[r])) {
                    T z, dp;
                    entry_dots<T>(q + r * s.DK, dout + r * s.DV, kvb + int64_t(sel) * s.DK, s.DK, s.DV, scale, z, &dp);
                    pr = exp(z - lse[r]);
                    g = pr * (dp - delta[r]);
                }
                P[x] = pr;
                DZ[x] = g;
                if (h == 0) rows[x / s.H] = entry_ok<T>(sel, s.T) ? sel : -1;
            }
            __syncthreads();
            if (d >= s.DK) continue;
            for (int64_t j = 0; j < kPairs; ++j) {
                if (rows[j] < 0) continue;
                T a = 0, v = 0;
                for (int64_t h = 0; h < s.H; ++h) {
                    const int64_t r = bt * s.H + h;
                    a += DZ[j * s.H + h] * q[r * s.DK + d];
                    if (d < s.DV) v += P[j * s.H + h] * dout[r * s.DV + d];
                }
                slab[int64_t(rows[j]) * s.DK + d] += scale * a + v;
            }
        }
    }
}

}  // namespace

size_t sparse_dkv_smem(int64_t H, size_t elem) { return size_t(2 * kPairs * H) * elem; }

template <class T>
cudaError_t launch_sparse_attention_forward(
    SparseShape s, const T* q, const T* kv, const int32_t* idx, T* o, T* lse, cudaStream_t stream) {
    if (s.B * s.T == 0 || s.H == 0) return cudaSuccess;
    launch_kernel(forward_kernel<T>, dim3(unsigned(s.B * s.T), unsigned(s.H)), kEntries, 0, stream, s, q, kv, idx, o,
                  lse);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_sparse_attention_probs(
    SparseShape s, const T* q, const T* kv, const int32_t* idx, const T* lse, T* probs, cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    launch_kernel(probs_kernel<T>, unsigned(s.B * s.T), kEntries, 0, stream, s, q, kv, idx, lse, probs);
    return cudaGetLastError();
}

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
                                             T* dq,
                                             T* dkv,
                                             cudaStream_t stream) {
    const int64_t rows = s.B * s.T * s.H;
    if (rows == 0) return cudaSuccess;
    launch_kernel(delta_kernel<T>, grid_for(rows), kBlock, 0, stream, rows, s.DV, dout, o, delta);
    launch_kernel(dq_kernel<T>, dim3(unsigned(s.B * s.T), unsigned(s.H)), kEntries, 0, stream, s, dout, q, kv, idx, lse,
                  delta, dq);
    cudaError_t err = cudaMemsetAsync(acc, 0, sizeof(T) * size_t(slabs * s.B * s.T * s.DK), stream);
    if (err != cudaSuccess) return err;
    const size_t smem = sparse_dkv_smem(s.H, sizeof(T));
    err = cudaFuncSetAttribute(dkv_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    const dim3 grid(unsigned(s.B), unsigned(slabs), unsigned((s.DK + kEntries - 1) / kEntries));
    launch_kernel(dkv_kernel<T>, grid, kEntries, smem, stream, s, slabs, dout, q, kv, idx, lse, delta, acc);
    const int64_t n = s.B * s.T * s.DK;
    launch_kernel(slab_sum_kernel<T>, grid_for(n), kBlock, 0, stream, n, slabs, acc, dkv);
    return cudaGetLastError();
}

#define TESSERA_SPARSE(T)                                                                                            \
    template cudaError_t launch_sparse_attention_forward<T>(SparseShape, const T*, const T*, const int32_t*, T*, T*, \
                                                            cudaStream_t);                                           \
    template cudaError_t launch_sparse_attention_probs<T>(SparseShape, const T*, const T*, const int32_t*, const T*, \
                                                          T*, cudaStream_t);                                         \
    template cudaError_t launch_sparse_attention_backward<T>(SparseShape, int64_t, const T*, const T*, const T*,     \
                                                             const int32_t*, const T*, const T*, T*, T*, T*, T*,     \
                                                             cudaStream_t);
TESSERA_SPARSE(float)
TESSERA_SPARSE(double)
#undef TESSERA_SPARSE

}  // namespace tessera::ops::cuda
