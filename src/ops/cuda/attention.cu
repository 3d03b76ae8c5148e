// Flash-style attention on CUDA (ops/attention.h), after FlashAttention-2 (Dao 2023): a block owns a tile of one
// sequence's queries (forward, dQ) or keys (dK, dV), one thread per row; the thread walks the other side
// kAttnChunk positions at a time with the chunk's scores in registers and an online softmax (forward), or the
// probabilities recomputed from lse (backward). No [T, T] matrix exists. The plan (tiles, rows per block, shared
// memory) is ops/attention_tiles.h.
//
// Backward runs three kernels: Δ = rowsum(dO∘O) per (row, head); dQ over query tiles; dK, dV over key tiles, each
// key tile walking its group's query heads in order. No two blocks write the same element and every sum has one
// order, so results are bitwise run-to-run and do not use atomics. Gradients accumulate (+=), as on the CPU.
#include <cmath>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
constexpr int kC = int(kAttnChunk);

template <class T>
__device__ inline T neg_inf() {
    return T(-INFINITY);
}

// Rows [first + t0, first + t0 + n) of head h of a [B, T, H, D] view into shared rows of stride ld; rows past n
// (up to `rows`) are zero. Every thread of the block takes part.
template <class T>
__device__ void load_rows(
    HeadsArg<const T> x, int64_t b, int64_t row0, int64_t h, int64_t n, int64_t rows, int64_t D, T* dst, int64_t ld) {
    for (int64_t i = threadIdx.x; i < rows * D; i += blockDim.x) {
        const int64_t r = i / D, d = i % D;
        dst[r * ld + d] = r < n ? x.data[b * x.sb + (row0 + r) * x.st + h * x.sh + d] : T(0);
    }
}

template <class T>
__device__ void zero(T* p, int64_t n) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = T(0);
}

template <class T>
__global__ void forward_kernel(AttnShape s,
                               const AttnTile* tiles,
                               HeadsArg<const T> q,
                               HeadsArg<const T> k,
                               HeadsArg<const T> v,
                               HeadsArg<T> o,
                               T* lse) {
    unsigned char* smem_raw = dynamic_shared();
    const int64_t R = blockDim.x, D = s.D, ld = D + 1;
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* Os = Qs + R * ld;
    T* Ks = Os + R * ld;
    T* Vs = Ks + kC * D;
    const AttnTile tile = tiles[blockIdx.x];
    const int64_t h = blockIdx.y, hk = h / (s.H / s.HKV), r = threadIdx.x;
    const int64_t nq = min(R, tile.len - tile.t0), row0 = tile.first + tile.t0, t = tile.t0 + r;
    const bool valid = r < nq;
    const T scale = T(s.scale);
    load_rows(q, tile.b, row0, h, nq, R, D, Qs, ld);
    zero(Os, R * ld);
    T m = neg_inf<T>(), l = 0;
    const int64_t kend = s.causal ? tile.t0 + nq : tile.len;
    for (int64_t s0 = 0; s0 < kend; s0 += kC) {
        const int64_t nk = min(int64_t(kC), kend - s0);
        __syncthreads();  // the previous chunk is consumed
        load_rows(k, tile.b, tile.first + s0, hk, nk, kC, D, Ks, D);
        load_rows(v, tile.b, tile.first + s0, hk, nk, kC, D, Vs, D);
        __syncthreads();
        // causal: key s0 + c is visible to query t when s0 + c <= t
        const int64_t nvis = !valid ? 0 : s.causal ? max(int64_t(0), min(nk, t - s0 + 1)) : nk;
        if (nvis == 0) continue;
        T sc[kC];
#pragma unroll
        for (int c = 0; c < kC; ++c) sc[c] = 0;
        for (int64_t d = 0; d < D; ++d) {
            const T qd = Qs[r * ld + d];
#pragma unroll
            for (int c = 0; c < kC; ++c) sc[c] += qd * Ks[c * D + d];
        }
        T mx = m;
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            sc[c] = c < nvis ? scale * sc[c] : neg_inf<T>();
            mx = max(mx, sc[c]);
        }
        const T alpha = exp(m - mx);
        T sum = 0;
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            sc[c] = c < nvis ? exp(sc[c] - mx) : T(0);
            sum += sc[c];
        }
        l = l * alpha + sum;
        m = mx;
        for (int64_t d = 0; d < D; ++d) {
            T acc = Os[r * ld + d] * alpha;
#pragma unroll
            for (int c = 0; c < kC; ++c) acc += sc[c] * Vs[c * D + d];
            Os[r * ld + d] = acc;
        }
    }
    if (!valid) return;
    T* orow = o.data + tile.b * o.sb + (row0 + r) * o.st + h * o.sh;
    const T inv = T(1) / l;
    for (int64_t d = 0; d < D; ++d) orow[d] = Os[r * ld + d] * inv;
    lse[(tile.b * s.H + h) * s.T + row0 + r] = m + log(l);
}

// Δ[b, h, t] = Σ_d dO·O, one thread per (b, t, h).
template <class T>
__global__ void delta_kernel(AttnShape s, HeadsArg<const T> dout, HeadsArg<const T> o, T* delta) {
    const int64_t total = s.B * s.T * s.H;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t h = e % s.H, t = (e / s.H) % s.T, b = e / (s.H * s.T);
        const T* g = dout.data + b * dout.sb + t * dout.st + h * dout.sh;
        const T* y = o.data + b * o.sb + t * o.st + h * o.sh;
        T acc = 0;
        for (int64_t d = 0; d < s.D; ++d) acc += g[d] * y[d];
        delta[(b * s.H + h) * s.T + t] = acc;
    }
}

// dQ += Σ_keys dS·K with dS = P∘(dP − Δ)·scale, P = exp(scale·q·k − lse), dP = dO·v.
template <class T>
__global__ void dq_kernel(AttnShape s,
                          const AttnTile* tiles,
                          HeadsArg<const T> dout,
                          HeadsArg<const T> q,
                          HeadsArg<const T> k,
                          HeadsArg<const T> v,
                          const T* lse,
                          const T* delta,
                          HeadsArg<T> dq) {
    unsigned char* smem_raw = dynamic_shared();
    const int64_t R = blockDim.x, D = s.D, ld = D + 1;
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* Gs = Qs + R * ld;  // dO
    T* Acc = Gs + R * ld;
    T* Ks = Acc + R * ld;
    T* Vs = Ks + kC * D;
    const AttnTile tile = tiles[blockIdx.x];
    const int64_t h = blockIdx.y, hk = h / (s.H / s.HKV), r = threadIdx.x;
    const int64_t nq = min(R, tile.len - tile.t0), row0 = tile.first + tile.t0, t = tile.t0 + r;
    const bool valid = r < nq;
    const T scale = T(s.scale);
    load_rows(q, tile.b, row0, h, nq, R, D, Qs, ld);
    load_rows(dout, tile.b, row0, h, nq, R, D, Gs, ld);
    zero(Acc, R * ld);
    const int64_t at = (tile.b * s.H + h) * s.T + row0 + r;
    const T L = valid ? lse[at] : T(0), Dl = valid ? delta[at] : T(0);
    const int64_t kend = s.causal ? tile.t0 + nq : tile.len;
    for (int64_t s0 = 0; s0 < kend; s0 += kC) {
        const int64_t nk = min(int64_t(kC), kend - s0);
        __syncthreads();
        load_rows(k, tile.b, tile.first + s0, hk, nk, kC, D, Ks, D);
        load_rows(v, tile.b, tile.first + s0, hk, nk, kC, D, Vs, D);
        __syncthreads();
        const int64_t nvis = !valid ? 0 : s.causal ? max(int64_t(0), min(nk, t - s0 + 1)) : nk;
        if (nvis == 0) continue;
        T sc[kC], dp[kC];
#pragma unroll
        for (int c = 0; c < kC; ++c) sc[c] = dp[c] = 0;
        for (int64_t d = 0; d < D; ++d) {
            const T qd = Qs[r * ld + d], gd = Gs[r * ld + d];
#pragma unroll
            for (int c = 0; c < kC; ++c) {
                sc[c] += qd * Ks[c * D + d];
                dp[c] += gd * Vs[c * D + d];
            }
        }
#pragma unroll
        for (int c = 0; c < kC; ++c) sc[c] = c < nvis ? exp(scale * sc[c] - L) * (dp[c] - Dl) * scale : T(0);
        for (int64_t d = 0; d < D; ++d) {
            T acc = Acc[r * ld + d];
#pragma unroll
            for (int c = 0; c < kC; ++c) acc += sc[c] * Ks[c * D + d];
            Acc[r * ld + d] = acc;
        }
    }
    if (!valid) return;
    T* g = dq.data + tile.b * dq.sb + (row0 + r) * dq.st + h * dq.sh;
    for (int64_t d = 0; d < D; ++d) g[d] += Acc[r * ld + d];
}

// dV += Σ_queries P·dO and dK += Σ_queries dS·q over the group's query heads in order, per key tile.
template <class T>
__global__ void dkv_kernel(AttnShape s,
                           const AttnTile* tiles,
                           HeadsArg<const T> dout,
                           HeadsArg<const T> q,
                           HeadsArg<const T> k,
                           HeadsArg<const T> v,
                           const T* lse,
                           const T* delta,
                           HeadsArg<T> dk,
                           HeadsArg<T> dv) {
    unsigned char* smem_raw = dynamic_shared();
    const int64_t R = blockDim.x, D = s.D, ld = D + 1;
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + R * ld;
    T* dKs = Vs + R * ld;
    T* dVs = dKs + R * ld;
    T* Qs = dVs + R * ld;
    T* Gs = Qs + kC * D;
    T* Ls = Gs + kC * D;
    T* Ds = Ls + kC;
    const AttnTile tile = tiles[blockIdx.x];
    const int64_t hk = blockIdx.y, group = s.H / s.HKV, r = threadIdx.x;
    const int64_t nk = min(R, tile.len - tile.t0), row0 = tile.first + tile.t0, sp = tile.t0 + r;
    const bool valid = r < nk;
    const T scale = T(s.scale);
    load_rows(k, tile.b, row0, hk, nk, R, D, Ks, ld);
    load_rows(v, tile.b, row0, hk, nk, R, D, Vs, ld);
    zero(dKs, R * ld);
    zero(dVs, R * ld);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t base = (tile.b * s.H + h) * s.T + tile.first;
        // causal: only queries t >= the tile's first key see it
        for (int64_t q0 = s.causal ? tile.t0 : 0; q0 < tile.len; q0 += kC) {
            const int64_t nq = min(int64_t(kC), tile.len - q0);
            __syncthreads();
            load_rows(q, tile.b, tile.first + q0, h, nq, kC, D, Qs, D);
            load_rows(dout, tile.b, tile.first + q0, h, nq, kC, D, Gs, D);
            for (int64_t i = threadIdx.x; i < kC; i += blockDim.x) {
                Ls[i] = i < nq ? lse[base + q0 + i] : T(0);
                Ds[i] = i < nq ? delta[base + q0 + i] : T(0);
            }
            __syncthreads();
            if (!valid) continue;
            T sc[kC], dp[kC];
#pragma unroll
            for (int i = 0; i < kC; ++i) sc[i] = dp[i] = 0;
            for (int64_t d = 0; d < D; ++d) {
                const T kd = Ks[r * ld + d], vd = Vs[r * ld + d];
#pragma unroll
                for (int i = 0; i < kC; ++i) {
                    sc[i] += Qs[i * D + d] * kd;
                    dp[i] += Gs[i * D + d] * vd;
                }
            }
#pragma unroll
            for (int i = 0; i < kC; ++i) {
                const bool vis = i < nq && (!s.causal || q0 + i >= sp);
                const T p = vis ? exp(scale * sc[i] - Ls[i]) : T(0);
                sc[i] = p;
                dp[i] = p * (dp[i] - Ds[i]) * scale;
            }
            for (int64_t d = 0; d < D; ++d) {
                T av = dVs[r * ld + d], ak = dKs[r * ld + d];
#pragma unroll
                for (int i = 0; i < kC; ++i) {
                    av += sc[i] * Gs[i * D + d];
                    ak += dp[i] * Qs[i * D + d];
                }
                dVs[r * ld + d] = av;
                dKs[r * ld + d] = ak;
            }
        }
    }
    if (!valid) return;
    T* gk = dk.data + tile.b * dk.sb + (row0 + r) * dk.st + hk * dk.sh;
    T* gv = dv.data + tile.b * dv.sb + (row0 + r) * dv.st + hk * dv.sh;
    for (int64_t d = 0; d < D; ++d) {
        gk[d] += dKs[r * ld + d];
        gv[d] += dVs[r * ld + d];
    }
}

// Opts the kernel in to `bytes` of dynamic shared memory (past the 48 KiB default) and launches it.
template <class K, class... A>
cudaError_t launch(K kernel, AttnPlan plan, int64_t heads, cudaStream_t stream, A... args) {
    if (plan.tiles == 0 || heads == 0) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem));
    if (err != cudaSuccess) return err;
    launch_kernel(kernel, dim3(unsigned(plan.tiles), unsigned(heads)), unsigned(plan.rows), plan.smem, stream, args...);
    return cudaGetLastError();
}
}  // namespace

template <class T>
cudaError_t launch_attention_forward(AttnShape s,
                                     AttnPlan plan,
                                     HeadsArg<const T> q,
                                     HeadsArg<const T> k,
                                     HeadsArg<const T> v,
                                     HeadsArg<T> o,
                                     T* lse,
                                     cudaStream_t stream) {
    return launch(forward_kernel<T>, plan, s.H, stream, s, plan.list, q, k, v, o, lse);
}

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
                                      cudaStream_t stream) {
    const int64_t rows = s.B * s.T * s.H;
    if (rows == 0) return cudaSuccess;
    launch_kernel(delta_kernel<T>, grid_for(rows), kBlock, 0, stream, s, dout, o, delta);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    err = launch(dq_kernel<T>, queries, s.H, stream, s, queries.list, dout, q, k, v, lse, (const T*)delta, dq);
    if (err != cudaSuccess) return err;
    return launch(dkv_kernel<T>, keys, s.HKV, stream, s, keys.list, dout, q, k, v, lse, (const T*)delta, dk, dv);
}

#define TESSERA_ATTENTION(T)                                                                                       \
    template cudaError_t launch_attention_forward<T>(AttnShape, AttnPlan, HeadsArg<const T>, HeadsArg<const T>,    \
                                                     HeadsArg<const T>, HeadsArg<T>, T*, cudaStream_t);            \
    template cudaError_t launch_attention_backward<T>(                                                             \
        AttnShape, AttnPlan, AttnPlan, HeadsArg<const T>, HeadsArg<const T>, HeadsArg<const T>, HeadsArg<const T>, \
        HeadsArg<const T>, const T*, T*, HeadsArg<T>, HeadsArg<T>, HeadsArg<T>, cudaStream_t);
TESSERA_ATTENTION(float)
TESSERA_ATTENTION(double)
#undef TESSERA_ATTENTION

}  // namespace tessera::ops::cuda
