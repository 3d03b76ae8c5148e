// Flash-style attention on CUDA (ops/attention.h), after FlashAttention-2 (Dao 2023): a block owns a tile of one
// sequence's queries (forward, dQ) or keys (dK, dV), one thread per row; the thread walks the other side
// kAttnChunk positions at a time with the chunk's scores in registers and an online softmax (forward), or the
// probabilities recomputed from lse (backward). No [T, T] matrix exists. The plan (tiles, rows per block, shared
// memory) is ops/attention_tiles.h.
//
// Backward runs three kernels: Δ = rowsum(dO∘O) per (row, head); dQ over query tiles; dK, dV over key tiles, each
// key tile walking its group's query heads in order. No two blocks write the same element and every sum has one
// order, so results are bitwise run-to-run and do not use atomics. Gradients accumulate (+=), as on the CPU.
//
// At train.precision = bf16 (f32 data) the *_tc_kernels run the same plan on tensor cores (below: WMMA, bf16
// operands, f32 sums), and Δ takes dO rounded to bf16, as the dO·V they pair with does (FlashAttention-2's bf16 Δ
// reads the same dO as its dP): so Σ_s dS = 0 holds for the rounded dO, and a row that sees one key gets dQ ≈ 0 and not
// the rounding of dO times its key.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <type_traits>

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

// Δ[b, h, t] = Σ_d dO·O, one thread per (b, t, h); dO rounded to bf16 first where `bf16` (f32 only).
template <class T>
__global__ void delta_kernel(AttnShape s, HeadsArg<const T> dout, HeadsArg<const T> o, T* delta, bool bf16) {
    const int64_t total = s.B * s.T * s.H;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t h = e % s.H, t = (e / s.H) % s.T, b = e / (s.H * s.T);
        const T* g = dout.data + b * dout.sb + t * dout.st + h * dout.sh;
        const T* y = o.data + b * o.sb + t * o.st + h * o.sh;
        T acc = 0;
        for (int64_t d = 0; d < s.D; ++d) {
            T gd = g[d];
            if constexpr (std::is_same_v<T, float>)
                if (bf16) gd = __bfloat162float(__float2bfloat16(gd));
            acc += gd * y[d];
        }
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

// The tensor-core kernels (train.precision = bf16, f32 data; layout: AttnTcLayout). A warp owns 16 rows of the
// block's tile; per step of the other side it forms its [16 × chunk] scores by WMMA (bf16 operands, f32 sums) into
// shared memory, two lanes per row turn them into probabilities (or dS), rounded to bf16, and one more WMMA product
// adds them into the warp's f32 accumulators in shared memory: O (rescaled per step, as the scalar forward), dQ,
// dK and dV. Only the scores' tiles a warp can see are formed: a causal step stops at the warp's last row (forward,
// dq) or starts at its first key (dkv). Each sum has one order for a launch shape: bitwise run to run.
namespace wmma = nvcuda::wmma;
using Bf16 = __nv_bfloat16;
constexpr int kTcTiles = 4;  // the longest chunk's 16-wide tiles (AttnTcLayout: 64)

// Rows [row0, row0 + n) of head h of a [B, T, H, D] view as bf16 rows of ld values, zeros past n (up to `rows`)
// and past D. Every thread of the block takes part.
__device__ void load_rows_bf16(HeadsArg<const float> x,
                               int64_t b,
                               int64_t row0,
                               int64_t h,
                               int64_t n,
                               int64_t rows,
                               int64_t D,
                               int64_t ld,
                               Bf16* dst) {
    stage_rows_bf16(x.data + b * x.sb + row0 * x.st + h * x.sh, x.st, n, rows, D, ld, dst);
}

// S[16][16·j] = A[16][D'] · B[16·j][D']ᵀ for the column tiles j in [j0, j1) (A and B bf16 rows of ldb, S f32 rows
// of lds): one warp's scores (or dO·V) against a chunk of the other side.
__device__ void warp_scores(const Bf16* A, const Bf16* B, const AttnTcLayout& at, int64_t j0, int64_t j1, float* S) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major> fb;  // B's rows as columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTcTiles];
#pragma unroll
    for (int j = 0; j < kTcTiles; ++j) wmma::fill_fragment(acc[j], 0.0f);
    for (int64_t d0 = 0; d0 < at.dp; d0 += 16) {
        wmma::load_matrix_sync(fa, A + d0, unsigned(at.ldb));
#pragma unroll
        for (int j = 0; j < kTcTiles; ++j)  // constant indices keep the fragments in registers
            if (j >= j0 && j < j1) {
                wmma::load_matrix_sync(fb, B + 16 * j * at.ldb + d0, unsigned(at.ldb));
                wmma::mma_sync(acc[j], fa, fb, acc[j]);
            }
    }
#pragma unroll
    for (int j = 0; j < kTcTiles; ++j)
        if (j >= j0 && j < j1) wmma::store_matrix_sync(S + 16 * j, acc[j], unsigned(at.lds), wmma::mem_row_major);
}

// Acc[16][D'] += P[16][16·j] · B[16·j][D'] over the tiles j in [j0, j1) (P bf16 rows of ldp, B bf16 rows of ldb, Acc
// f32 rows of ldo): one warp's P·V, dS·K, P·dO or dS·Q.
__device__ void warp_accumulate(
    const Bf16* P, const Bf16* B, const AttnTcLayout& at, int64_t j0, int64_t j1, float* Acc) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major> fp[kTcTiles];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
#pragma unroll
    for (int j = 0; j < kTcTiles; ++j)
        if (j >= j0 && j < j1) wmma::load_matrix_sync(fp[j], P + 16 * j, unsigned(at.ldp));
    for (int64_t d0 = 0; d0 < at.dp; d0 += 16) {
        wmma::load_matrix_sync(acc, Acc + d0, unsigned(at.ldo), wmma::mem_row_major);
#pragma unroll
        for (int j = 0; j < kTcTiles; ++j)
            if (j >= j0 && j < j1) {
                wmma::load_matrix_sync(fb, B + 16 * j * at.ldb + d0, unsigned(at.ldb));
                wmma::mma_sync(acc, fp[j], fb, acc);
            }
        wmma::store_matrix_sync(Acc + d0, acc, unsigned(at.ldo), wmma::mem_row_major);
    }
}

// warp_accumulate into the warp's accumulator fragments, tile t holding dims 16·t … 16·t + 15 (the layout's `regs`):
// the same products in the same order, without the accumulators' trips through shared memory.
using AccFragments = wmma::fragment<wmma::accumulator, 16, 16, 16, float>[kAttnRegTiles];
__device__ void warp_accumulate_regs(
    const Bf16* P, const Bf16* B, const AttnTcLayout& at, int64_t j0, int64_t j1, AccFragments& acc) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major> fp[kTcTiles];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major> fb;
#pragma unroll
    for (int j = 0; j < kTcTiles; ++j)
        if (j >= j0 && j < j1) wmma::load_matrix_sync(fp[j], P + 16 * j, unsigned(at.ldp));
#pragma unroll
    for (int t = 0; t < int(kAttnRegTiles); ++t)  // constant indices keep the fragments in registers
        if (16 * t < at.dp) {
#pragma unroll
            for (int j = 0; j < kTcTiles; ++j)
                if (j >= j0 && j < j1) {
                    wmma::load_matrix_sync(fb, B + 16 * j * at.ldb + 16 * t, unsigned(at.ldb));
                    wmma::mma_sync(acc[t], fp[j], fb, acc[t]);
                }
        }
}

// A warp's place in a tensor-core block: its 16 rows from `first` (within the tile), `valid` of them real; the
// lane's row r (two lanes a row) and its half of a row's columns (scores) and of its dims (accumulators).
struct TcLane {
    int64_t first, valid, r, c0, c1, d0, d1;
    __device__ TcLane(const AttnTcLayout& at, int64_t tile_rows) {
        const int64_t w = threadIdx.x / 32, lane = threadIdx.x % 32, half = lane % 2;
        first = 16 * w;
        valid = max(int64_t(0), min(int64_t(16), tile_rows - first));
        r = lane / 2;
        c0 = half * at.chunk / 2, c1 = c0 + at.chunk / 2;
        d0 = half * at.dp / 2, d1 = d0 + at.dp / 2;
    }
    __device__ bool real() const { return r < valid; }
    __device__ unsigned char* part(unsigned char* smem, const AttnTcLayout& at) const {
        return smem + at.warp + first / 16 * at.part;
    }
};

// The sum of a row's two lanes' values, the same bits in both (addition commutes).
__device__ inline float row_sum(float x) { return x + __shfl_xor_sync(0xffffffffu, x, 1); }
__device__ inline float row_max(float x) { return max(x, __shfl_xor_sync(0xffffffffu, x, 1)); }

__device__ void zero_rows(float* acc, const AttnTcLayout& at) {
    for (int64_t i = threadIdx.x % 32; i < 16 * at.ldo; i += 32) acc[i] = 0.0f;
}

// out row += (or =, times `mul`) the lane's half of accumulator row r, dims below D.
__device__ void finish_row(
    const TcLane& ln, const float* acc, const AttnTcLayout& at, float* out, int64_t D, float mul, bool add) {
    for (int64_t d = ln.d0; d < min(ln.d1, D); ++d) {
        const float x = acc[ln.r * at.ldo + d] * mul;
        out[d] = add ? out[d] + x : x;
    }
}

// A query tile's block (forward, dq): its tile, query head h and key head hk, its real rows nq from row0 (within the
// batch row), the lane's place and its warp's part of shared memory; Q's rows (dq: then dO's) and the chunk's K and V
// staged as bf16.
struct TcQueries {
    AttnTile tile;
    int64_t h, hk, nq, row0;
    TcLane ln;
    unsigned char* mine;
    Bf16 *Q, *K, *V;
    __device__ TcQueries(const AttnShape& s, const AttnTile* tiles, const AttnTcLayout& at)
        : tile(tiles[blockIdx.x]),
          h(blockIdx.y),
          hk(h / (s.H / s.HKV)),
          nq(min(16 * at.warps, tile.len - tile.t0)),
          row0(tile.first + tile.t0),
          ln(at, nq),
          mine(ln.part(dynamic_shared(), at)),
          Q(reinterpret_cast<Bf16*>(dynamic_shared())),
          K(reinterpret_cast<Bf16*>(dynamic_shared() + at.other)),
          V(K + at.chunk * at.ldb) {}
    __device__ int64_t row() const { return row0 + ln.first + ln.r; }  // the lane's query within the batch row
};

// The block's walk over its keys: each chunk's K and V staged, then, in the warps that see any of its keys,
// body(nvis, tiles): the lane's query sees the chunk's first nvis keys, the warp's last real query the first
// 16·tiles (or fewer: the chunk's end). Every thread of the block takes part.
template <class Body>
__device__ void walk_keys(const AttnShape& s,
                          const AttnTcLayout& at,
                          const TcQueries& qb,
                          HeadsArg<const float> k,
                          HeadsArg<const float> v,
                          Body body) {
    const AttnTile& tile = qb.tile;
    const TcLane& ln = qb.ln;
    const int64_t kend = s.causal ? tile.t0 + qb.nq : tile.len, last = tile.t0 + ln.first + ln.valid - 1;
    const int64_t t = tile.t0 + ln.first + ln.r;  // the lane's query within the sequence
    for (int64_t s0 = 0; s0 < kend; s0 += at.chunk) {
        const int64_t nk = min(at.chunk, kend - s0);
        __syncthreads();  // the previous chunk is consumed
        load_rows_bf16(k, tile.b, tile.first + s0, qb.hk, nk, at.chunk, s.D, at.ldb, qb.K);
        load_rows_bf16(v, tile.b, tile.first + s0, qb.hk, nk, at.chunk, s.D, at.ldb, qb.V);
        __syncthreads();
        const int64_t ncols = ln.valid == 0 ? 0 : s.causal ? min(nk, last - s0 + 1) : nk;
        if (ncols <= 0) continue;  // the same in the whole warp
        body(!ln.real() ? 0 : s.causal ? max(int64_t(0), min(ncols, t - s0 + 1)) : ncols, (ncols + 15) / 16);
    }
}

__global__ void forward_tc_kernel(AttnShape s,
                                  const AttnTile* tiles,
                                  int64_t chunk,
                                  HeadsArg<const float> q,
                                  HeadsArg<const float> k,
                                  HeadsArg<const float> v,
                                  HeadsArg<float> o,
                                  float* lse) {
    const AttnTcLayout at(AttnKernel::forward, blockDim.x / 32, chunk, s.D);
    const TcQueries qb(s, tiles, at);
    const TcLane& ln = qb.ln;
    auto* S = reinterpret_cast<float*>(qb.mine + at.scores);
    auto* P = reinterpret_cast<Bf16*>(qb.mine + at.probs);
    auto* O = reinterpret_cast<float*>(qb.mine + at.acc);
    const float scale = float(s.scale), inf = INFINITY;
    load_rows_bf16(q, qb.tile.b, qb.row0, qb.h, qb.nq, 16 * at.warps, s.D, at.ldb, qb.Q);
    zero_rows(O, at);
    float m = -inf, l = 0;
    walk_keys(s, at, qb, k, v, [&](int64_t nvis, int64_t j1) {
        warp_scores(qb.Q + ln.first * at.ldb, qb.K, at, 0, j1, S);
        __syncwarp();
        float mx = -inf;
        for (int64_t c = ln.c0; c < min(ln.c1, nvis); ++c) mx = max(mx, scale * S[ln.r * at.lds + c]);
        const float mn = max(m, row_max(mx));
        const float alpha = mn == -inf ? 1.0f : exp(m - mn);
        float sum = 0;
        for (int64_t c = ln.c0; c < ln.c1; ++c) {
            const float p = c < nvis ? exp(scale * S[ln.r * at.lds + c] - mn) : 0.0f;
            P[ln.r * at.ldp + c] = __float2bfloat16(p);
            sum += p;
        }
        l = alpha * l + row_sum(sum);
        m = mn;
        for (int64_t d = ln.d0; d < ln.d1; ++d) O[ln.r * at.ldo + d] *= alpha;
        __syncwarp();
        warp_accumulate(P, qb.V, at, 0, j1, O);
    });
    __syncwarp();
    if (!ln.real()) return;
    finish_row(ln, O, at, o.data + qb.tile.b * o.sb + qb.row() * o.st + qb.h * o.sh, s.D, 1.0f / l, false);
    if (ln.d0 == 0) lse[(qb.tile.b * s.H + qb.h) * s.T + qb.row()] = m + log(l);
}

__global__ void dq_tc_kernel(AttnShape s,
                             const AttnTile* tiles,
                             int64_t chunk,
                             HeadsArg<const float> dout,
                             HeadsArg<const float> q,
                             HeadsArg<const float> k,
                             HeadsArg<const float> v,
                             const float* lse,
                             const float* delta,
                             HeadsArg<float> dq) {
    const AttnTcLayout at(AttnKernel::dq, blockDim.x / 32, chunk, s.D);
    const TcQueries qb(s, tiles, at);
    const TcLane& ln = qb.ln;
    const int64_t rows = 16 * at.warps;
    Bf16* Gb = qb.Q + rows * at.ldb;  // dO
    auto* S = reinterpret_cast<float*>(qb.mine + at.scores);
    auto* dP = reinterpret_cast<float*>(qb.mine + at.dscores);
    auto* dS = reinterpret_cast<Bf16*>(qb.mine + at.probs);
    auto* Acc = reinterpret_cast<float*>(qb.mine + at.acc);  // (in shared memory unless at.regs)
    AccFragments acc;
#pragma unroll
    for (int t = 0; t < int(kAttnRegTiles); ++t) wmma::fill_fragment(acc[t], 0.0f);
    const int64_t at_row = (qb.tile.b * s.H + qb.h) * s.T + qb.row();
    const float scale = float(s.scale);
    const float L = ln.real() ? lse[at_row] : 0.0f, Dl = ln.real() ? delta[at_row] : 0.0f;
    load_rows_bf16(q, qb.tile.b, qb.row0, qb.h, qb.nq, rows, s.D, at.ldb, qb.Q);
    load_rows_bf16(dout, qb.tile.b, qb.row0, qb.h, qb.nq, rows, s.D, at.ldb, Gb);
    if (!at.regs) zero_rows(Acc, at);
    walk_keys(s, at, qb, k, v, [&](int64_t nvis, int64_t j1) {
        warp_scores(qb.Q + ln.first * at.ldb, qb.K, at, 0, j1, S);
        warp_scores(Gb + ln.first * at.ldb, qb.V, at, 0, j1, dP);
        __syncwarp();
        for (int64_t c = ln.c0; c < ln.c1; ++c) {
            const int64_t x = ln.r * at.lds + c;
            const float ds = c < nvis ? exp(scale * S[x] - L) * (dP[x] - Dl) * scale : 0.0f;
            dS[ln.r * at.ldp + c] = __float2bfloat16(ds);
        }
        __syncwarp();
        if (at.regs) {
            warp_accumulate_regs(dS, qb.K, at, 0, j1, acc);
        } else {
            warp_accumulate(dS, qb.K, at, 0, j1, Acc);
        }
    });
    __syncwarp();
    float* out = dq.data + qb.tile.b * dq.sb + qb.row() * dq.st + qb.h * dq.sh;
    if (!at.regs) {
        if (ln.real()) finish_row(ln, Acc, at, out, s.D, 1.0f, true);
        return;
    }
#pragma unroll
    for (int t = 0; t < int(kAttnRegTiles); ++t)  // each tile through the scores' space, a lane a half row
        if (16 * t < at.dp) {
            wmma::store_matrix_sync(S, acc[t], 16u, wmma::mem_row_major);
            __syncwarp();
            const int64_t c0 = threadIdx.x % 2 * 8;
            if (ln.real())
                for (int64_t c = c0; c < c0 + 8 && 16 * t + c < s.D; ++c) out[16 * t + c] += S[ln.r * 16 + c];
            __syncwarp();
        }
}

__global__ void dkv_tc_kernel(AttnShape s,
                              const AttnTile* tiles,
                              int64_t chunk,
                              HeadsArg<const float> dout,
                              HeadsArg<const float> q,
                              HeadsArg<const float> k,
                              HeadsArg<const float> v,
                              const float* lse,
                              const float* delta,
                              HeadsArg<float> dk,
                              HeadsArg<float> dv) {
    const AttnTcLayout at(AttnKernel::dkv, blockDim.x / 32, chunk, s.D);
    unsigned char* smem = dynamic_shared();
    const int64_t rows = 16 * at.warps;
    auto* Kb = reinterpret_cast<Bf16*>(smem);
    Bf16* Vb = Kb + rows * at.ldb;
    auto* Qb = reinterpret_cast<Bf16*>(smem + at.other);
    Bf16* Gb = Qb + chunk * at.ldb;  // dO
    auto* Ls = reinterpret_cast<float*>(smem + at.rowvals);
    float* Ds = Ls + chunk;
    const AttnTile tile = tiles[blockIdx.x];
    const int64_t hk = blockIdx.y, group = s.H / s.HKV;
    const int64_t nk = min(rows, tile.len - tile.t0), row0 = tile.first + tile.t0;
    const TcLane ln(at, nk);
    unsigned char* mine = ln.part(smem, at);
    auto* S = reinterpret_cast<float*>(mine + at.scores);
    auto* dP = reinterpret_cast<float*>(mine + at.dscores);
    auto* P = reinterpret_cast<Bf16*>(mine + at.probs);
    auto* dS = reinterpret_cast<Bf16*>(mine + at.dprobs);
    auto* dK = reinterpret_cast<float*>(mine + at.acc);
    auto* dV = reinterpret_cast<float*>(mine + at.acc2);
    const int64_t first_key = tile.t0 + ln.first, sp = first_key + ln.r;  // within the sequence
    const float scale = float(s.scale);
    load_rows_bf16(k, tile.b, row0, hk, nk, rows, s.D, at.ldb, Kb);
    load_rows_bf16(v, tile.b, row0, hk, nk, rows, s.D, at.ldb, Vb);
    zero_rows(dK, at);
    zero_rows(dV, at);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t base = (tile.b * s.H + h) * s.T + tile.first;
        for (int64_t q0 = s.causal ? tile.t0 : 0; q0 < tile.len; q0 += chunk) {
            const int64_t nq = min(chunk, tile.len - q0);
            __syncthreads();
            load_rows_bf16(q, tile.b, tile.first + q0, h, nq, chunk, s.D, at.ldb, Qb);
            load_rows_bf16(dout, tile.b, tile.first + q0, h, nq, chunk, s.D, at.ldb, Gb);
            for (int64_t i = threadIdx.x; i < chunk; i += blockDim.x) {
                Ls[i] = i < nq ? lse[base + q0 + i] : 0.0f;
                Ds[i] = i < nq ? delta[base + q0 + i] : 0.0f;
            }
            __syncthreads();
            // causal: the query tiles wholly before the warp's first key see none of its keys
            const int64_t j0 = s.causal ? min(chunk, max(int64_t(0), first_key - q0)) / 16 : 0, j1 = (nq + 15) / 16;
            if (ln.valid == 0 || j0 >= j1) continue;
            warp_scores(Kb + ln.first * at.ldb, Qb, at, j0, j1, S);
            warp_scores(Vb + ln.first * at.ldb, Gb, at, j0, j1, dP);
            __syncwarp();
            for (int64_t c = ln.c0; c < ln.c1; ++c) {
                const int64_t x = ln.r * at.lds + c;
                const bool vis = ln.real() && c >= 16 * j0 && c < nq && (!s.causal || q0 + c >= sp);
                const float p = vis ? exp(scale * S[x] - Ls[c]) : 0.0f;
                P[ln.r * at.ldp + c] = __float2bfloat16(p);
                dS[ln.r * at.ldp + c] = __float2bfloat16(vis ? p * (dP[x] - Ds[c]) * scale : 0.0f);
            }
            __syncwarp();
            warp_accumulate(P, Gb, at, j0, j1, dV);
            warp_accumulate(dS, Qb, at, j0, j1, dK);
        }
    }
    __syncwarp();
    if (!ln.real()) return;
    const int64_t row = row0 + ln.first + ln.r;
    finish_row(ln, dK, at, dk.data + tile.b * dk.sb + row * dk.st + hk * dk.sh, s.D, 1.0f, true);
    finish_row(ln, dV, at, dv.data + tile.b * dv.sb + row * dv.st + hk * dv.sh, s.D, 1.0f, true);
}

// Opts the kernel in to `bytes` of dynamic shared memory (past the 48 KiB default) and launches it.
template <class K, class... A>
cudaError_t launch(K kernel, AttnPlan plan, int64_t heads, cudaStream_t stream, A... args) {
    if (plan.tiles == 0 || heads == 0) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem));
    if (err != cudaSuccess) return err;
    const unsigned threads = unsigned(plan.chunk > 0 ? 2 * plan.rows : plan.rows);  // tensor cores: two lanes a row
    launch_kernel(kernel, dim3(unsigned(plan.tiles), unsigned(heads)), threads, plan.smem, stream, args...);
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
    if constexpr (std::is_same_v<T, float>)
        if (plan.chunk > 0)
            return launch(forward_tc_kernel, plan, s.H, stream, s, plan.list, plan.chunk, q, k, v, o, lse);
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
    launch_kernel(delta_kernel<T>, grid_for(rows), kBlock, 0, stream, s, dout, o, delta, queries.chunk > 0);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if constexpr (std::is_same_v<T, float>)
        if (queries.chunk > 0) {
            err = launch(dq_tc_kernel, queries, s.H, stream, s, queries.list, queries.chunk, dout, q, k, v, lse,
                         (const T*)delta, dq);
            if (err != cudaSuccess) return err;
            return launch(dkv_tc_kernel, keys, s.HKV, stream, s, keys.list, keys.chunk, dout, q, k, v, lse,
                          (const T*)delta, dk, dv);
        }
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
