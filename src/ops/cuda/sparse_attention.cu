// DSA's sparse MQA attention on CUDA (ops/dsa.h): every query attends to its selected entries of kv (−1 and
// out-of-range indices skipped); the value is the first DV dims of the same entry. Every head of a query reads the
// same selected entries (MQA), so the kernels stage each chunk of a query's entries in shared memory once and use it
// for a group of heads (FlashMLA's sparse kernels share a query's gathered entries across its heads the same way):
//   forward, dq: one block per (query, group of kHeads heads); the block gathers kChunk entries at a time, a thread
//     per (head, entry) computes its score (and dO·v), then each thread sums the chunk into its output dims for
//     every head of the group, entries in order. The forward's online softmax rescales per chunk.
//   probs: one block per query, a thread per (head, entry) of each head group, then a thread per entry summing
//     the heads in order.
//   dkv: the CPU's scheme B (spec/dsa.md §3.7): the queries of a batch row split into `slabs` fixed slabs (the
//     entry point's count, attention_ops.cpp: scatter_slabs), each scattered into a private [T, DK] accumulator by
//     blocks (slab, key range) walking its queries in ascending order and each row's entries in row order (no
//     atomics), the slabs then added in slab order. A block finds the entries of its key range in each row: two binary
//     searches where the row is sorted (the indexer's rows; sorted_rows_kernel checks), else it picks them out
//     (select_in_range); a step stages `pairs` of them, a thread per (head, entry) computes p and dz once, and the
//     block spans every dim. Key ranges split a slab only where batch × slabs is small (dkv_key_ranges).
// Every kernel walks a query's row only up to its last entry that selects a key (row_end): the indexer's −1 padding
// costs a read of the row. Every sum has one order: bitwise run-to-run; dq, dkv and probs do not depend on the chunk
// sizes, the forward's rescaling does. Scalar FMAs (f32 or f64), except the *_tc_kernels: the forward, probs, dq and
// dkv on tensor cores at train.precision = bf16 (operands rounded to bf16, f32 sums).
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
constexpr int kThreads = 256;              // threads per block
constexpr int kHeads = 16;                 // heads per block of the per-query kernels
constexpr int kChunk = kThreads / kHeads;  // entries per chunk there: a thread per (head, entry)
constexpr int kSub = 8;                    // entries per register batch of the dkv scatter
constexpr int kDvSlots = int((kSparseMaxDV + kThreads - 1) / kThreads);  // output dims per thread (forward)
constexpr int kDkSlots = int((kSparseMaxDK + kThreads - 1) / kThreads);  // (dq, dkv)
constexpr int64_t kDkvBlocks = 256, kMinRange = 64;  // dkv: the blocks key ranges aim for; keys per range at least

int64_t dkv_pairs(int64_t H) { return H <= 128 ? 32 : 16; }  // entries per dkv step: P and DZ hold pairs·H each

// The dkv kernels' key ranges per (batch row, slab): enough for kDkvBlocks blocks, as far as ranges of kMinRange keys
// allow (the shape alone decides).
int64_t dkv_key_ranges(int64_t row_slabs, int64_t T) {
    return std::clamp((kDkvBlocks + row_slabs - 1) / row_slabs, int64_t(1), std::max(int64_t(1), T / kMinRange));
}

template <class T>
__device__ inline bool entry_ok(int32_t s, int64_t T_) {
    return s >= 0 && s < T_;
}

// One past the last entry of a query's row that selects a key, 0 where none: the kernels walk the entries before it
// only (the indexer's rows end in −1 padding, most of the row where a short sequence's queries have few keys; the
// entries past it would add nothing). Every thread of the block calls it and gets the value; `shared`: an int per warp.
__device__ inline int64_t row_end(const int32_t* row, const SparseShape& s, int* shared) {
    int end = 0;
    for (int64_t i = threadIdx.x; i < s.K; i += blockDim.x)
        if (entry_ok<float>(row[i], s.T)) end = int(i + 1);
    return block_max(end, shared);
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

// The selected position of step entry i0 + j of the `count` entries of a query's row: row[i0 + j], or with a list
// (the dkv kernels' entries in their key range) row[list[i0 + j]]; −1 past the count, where none, and out of range.
__device__ inline int32_t step_entry(
    const int32_t* row, int64_t count, int64_t i0, int64_t j, const SparseShape& s, const int32_t* list) {
    const int64_t i = i0 + j;
    const int32_t sel = i >= count ? -1 : list ? row[list[i]] : row[i];
    return entry_ok<float>(sel, s.T) ? sel : -1;
}

// Stages entries i0 .. i0 + n − 1 of the `count` entries of a query's row (or of its list: step_entry): rows[j] the
// selected position (−1 where none or out of range), E[j·ld + d] its entry in E's element type (the scalar kernels'
// T, the tensor-core kernels' bf16), zeros where none and past DK. Every thread of the block calls it; starts and ends
// at a barrier.
template <class T, class Out>
__device__ void stage_entries(const int32_t* row,
                              int64_t count,
                              int64_t i0,
                              int64_t n,
                              const SparseShape& s,
                              const T* kvb,
                              int64_t ld,
                              int32_t* rows,
                              Out* E,
                              const int32_t* list = nullptr) {
    __syncthreads();  // the previous step's rows and entries are consumed
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) rows[j] = step_entry(row, count, i0, j, s, list);
    __syncthreads();
    for (int64_t x = threadIdx.x; x < n * ld; x += blockDim.x) {
        const int64_t j = x / ld, d = x % ld;
        const T v = rows[j] >= 0 && d < s.DK ? kvb[int64_t(rows[j]) * s.DK + d] : T(0);
        if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
            E[x] = __float2bfloat16(v);
        } else {
            E[x] = v;
        }
    }
    __syncthreads();
}

template <class T>
__global__ void forward_kernel(SparseShape s, const T* q, const T* kv, const int32_t* idx, T* o, T* lse) {
    T* E = reinterpret_cast<T*>(dynamic_shared());  // [kChunk][DK + 1]
    __shared__ int32_t rows[kChunk];
    __shared__ T P[kHeads][kChunk];
    __shared__ T scale_by[kHeads], sums[kHeads];
    __shared__ int ends[kThreads / 32];
    const int64_t bt = blockIdx.x, b = bt / s.T, h0 = int64_t(blockIdx.y) * kHeads, tid = threadIdx.x;
    const int hn = int(min(int64_t(kHeads), s.H - h0)), hl = int(tid / kChunk), e = int(tid % kChunk);
    const bool head = hl < hn;
    const int64_t ld = s.DK + 1, n = row_end(idx + bt * s.K, s, ends);
    const T* qh = q + (bt * s.H + h0 + (head ? hl : 0)) * s.DK;
    const T* kvb = kv + b * s.T * s.DK;
    const T scale = T(s.scale), inf = T(INFINITY);
    T m = -inf, l = 0;             // the head's running max and sum (the same in its kChunk threads)
    T acc[kHeads][kDvSlots] = {};  // dims tid + c·kThreads of each head of the group
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
        stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, ld, rows, E);
        T z = -inf;
        if (head && rows[e] >= 0) entry_dots<T>(qh, nullptr, E + e * ld, s.DK, 0, scale, z, nullptr);
        T mx = z;  // the chunk's max over the head's kChunk lanes, then the running one
        for (int w = kChunk / 2; w > 0; w >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, w, kChunk));
        mx = max(m, mx);
        T alpha = 1, p = 0;  // no valid entry yet: nothing changes
        if (mx != -inf) {
            alpha = m == -inf ? T(0) : exp(m - mx);
            p = z == -inf ? T(0) : exp(z - mx);
        }
        T ps = p;
        for (int w = kChunk / 2; w > 0; w >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, w, kChunk);
        l = alpha * l + ps;
        m = mx;
        P[hl][e] = p;
        if (e == 0) scale_by[hl] = alpha;
        __syncthreads();
        for (int c = 0; c < kDvSlots; ++c) {
            const int64_t d = tid + c * int64_t(kThreads);
            if (d >= s.DV) break;
            for (int h = 0; h < kHeads; ++h)
                if (h < hn) acc[h][c] *= scale_by[h];
            for (int j = 0; j < kChunk; ++j) {
                if (rows[j] < 0) continue;
                const T v = E[j * ld + d];
                for (int h = 0; h < kHeads; ++h)
                    if (h < hn) acc[h][c] += P[h][j] * v;
            }
        }
    }
    if (head && e == 0) {
        sums[hl] = l;
        lse[bt * s.H + h0 + hl] = l > 0 ? m + log(l) : inf;
    }
    __syncthreads();
    for (int h = 0; h < kHeads; ++h) {
        if (h >= hn) break;
        T* oh = o + (bt * s.H + h0 + h) * s.DV;
        for (int c = 0; c < kDvSlots; ++c) {
            const int64_t d = tid + c * int64_t(kThreads);
            if (d < s.DV) oh[d] = sums[h] > 0 ? acc[h][c] / sums[h] : T(0);
        }
    }
}

// One warp's share of the (16 heads × 16·tiles entries) tile X·Eᵀ over `width` dims (X [kHeads][ld], E the entries
// [16·tiles][ldE]): entry tile warp % tiles, the steps 16·(warp / tiles), 16·(warp / tiles + warps / tiles), …, into
// the warp's partial 16 × 16 tile. An entry's score is the sum of its tile's warps' partials, warps in order.
__device__ inline void partial_scores(
    const __nv_bfloat16* X, int64_t ld, const __nv_bfloat16* E, int64_t ldE, int64_t width, int tiles, float* partial) {
    namespace wmma = nvcuda::wmma;
    const int warp = int(threadIdx.x / 32), warps = int(blockDim.x / 32);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fe;  // entries as columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    const __nv_bfloat16* Et = E + (warp % tiles) * 16 * ldE;
    for (int64_t d0 = 16 * (warp / tiles); d0 < width; d0 += 16 * (warps / tiles)) {
        wmma::load_matrix_sync(fa, X + d0, unsigned(ld));
        wmma::load_matrix_sync(fe, Et + d0, unsigned(ldE));
        wmma::mma_sync(acc, fa, fe, acc);
    }
    wmma::store_matrix_sync(partial + warp * kHeads * 16, acc, 16u, wmma::mem_row_major);
}

// The tensor-core forward's shared memory: q's head group and the chunk's entries as bf16 [kHeads][DK'], the warps'
// partial score tiles, the running output [kHeads][DV'] f32 and the chunk's probabilities as bf16 (' = whole 16s).
struct TcForwardSmem {
    int64_t dk, dv, entries, partial, out, probs, bytes;
    __host__ __device__ explicit TcForwardSmem(const SparseShape& s) {
        dk = round16(s.DK), dv = round16(s.DV);
        entries = kHeads * dk * 2;
        partial = entries + kChunk * dk * 2;
        out = partial + (kThreads / 32) * kHeads * kChunk * 4;
        probs = out + kHeads * dv * 4;
        bytes = probs + kHeads * kChunk * 2;
    }
};

// The forward on tensor cores (train.precision = bf16, f32 data): as forward_kernel, with q and the entries rounded
// to bf16 and the two products by WMMA with f32 sums. Scores: the 16 × 16 tile of (head, entry) q·e, the DK' / 16
// steps spread over the 8 warps, their partial tiles summed in warp order. Output: O [kHeads, DV'] in shared memory,
// each chunk rescaled by its heads' alpha, then O += P·V by tiles of 16 dims (P rounded to bf16; the sum l of the
// probabilities stays f32, as FlashAttention's).
__global__ void forward_tc_kernel(
    SparseShape s, const float* q, const float* kv, const int32_t* idx, float* o, float* lse) {
    namespace wmma = nvcuda::wmma;
    const TcForwardSmem at(s);
    unsigned char* smem = dynamic_shared();
    auto* Qb = reinterpret_cast<__nv_bfloat16*>(smem);               // [kHeads][dk]
    auto* Eb = reinterpret_cast<__nv_bfloat16*>(smem + at.entries);  // [kChunk][dk]
    auto* Sp = reinterpret_cast<float*>(smem + at.partial);          // [warps][kHeads][kChunk]
    auto* Os = reinterpret_cast<float*>(smem + at.out);              // [kHeads][dv]
    auto* Pb = reinterpret_cast<__nv_bfloat16*>(smem + at.probs);    // [kHeads][kChunk]
    __shared__ int32_t rows[kChunk];
    __shared__ int ends[kThreads / 32];
    __shared__ float scale_by[kHeads], sums[kHeads];
    const int64_t bt = blockIdx.x, b = bt / s.T, h0 = int64_t(blockIdx.y) * kHeads, tid = threadIdx.x;
    const int hn = int(min(int64_t(kHeads), s.H - h0)), hl = int(tid / kChunk), e = int(tid % kChunk);
    const int warp = int(tid / 32), warps = kThreads / 32;
    const bool head = hl < hn;
    const float* kvb = kv + b * s.T * s.DK;
    const float scale = float(s.scale), inf = INFINITY;
    stage_rows_bf16(q + (bt * s.H + h0) * s.DK, s.DK, hn, kHeads, s.DK, at.dk, Qb);
    for (int64_t x = tid; x < kHeads * at.dv; x += kThreads) Os[x] = 0.0f;
    float m = -inf, l = 0;  // the head's running max and sum (the same in its kChunk threads)
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fv;  // entries as rows
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    const int64_t n = row_end(idx + bt * s.K, s, ends);
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
        stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, at.dk, rows, Eb);  // after the last chunk's P·V
        partial_scores(Qb, at.dk, Eb, at.dk, at.dk, 1, Sp);
        __syncthreads();
        float z = -inf;
        if (head && rows[e] >= 0) {
            float a = 0;
            for (int w = 0; w < warps; ++w) a += Sp[(w * kHeads + hl) * kChunk + e];
            z = scale * a;
        }
        float mx = z;  // the chunk's max over the head's kChunk lanes, then the running one
        for (int w = kChunk / 2; w > 0; w >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, w, kChunk));
        mx = max(m, mx);
        float alpha = 1, p = 0;  // no valid entry yet: nothing changes
        if (mx != -inf) {
            alpha = m == -inf ? 0.0f : exp(m - mx);
            p = z == -inf ? 0.0f : exp(z - mx);
        }
        float ps = p;
        for (int w = kChunk / 2; w > 0; w >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, w, kChunk);
        l = alpha * l + ps;
        m = mx;
        Pb[hl * kChunk + e] = __float2bfloat16(p);
        if (e == 0) scale_by[hl] = alpha;
        __syncthreads();
        for (int64_t x = tid; x < kHeads * at.dv; x += kThreads) Os[x] *= scale_by[x / at.dv];
        __syncthreads();
        wmma::load_matrix_sync(fa, Pb, unsigned(kChunk));
        for (int64_t d0 = 16 * warp; d0 < at.dv; d0 += 16 * warps) {
            wmma::load_matrix_sync(acc, Os + d0, unsigned(at.dv), wmma::mem_row_major);
            wmma::load_matrix_sync(fv, Eb + d0, unsigned(at.dk));
            wmma::mma_sync(acc, fa, fv, acc);
            wmma::store_matrix_sync(Os + d0, acc, unsigned(at.dv), wmma::mem_row_major);
        }
    }
    if (head && e == 0) {
        sums[hl] = l;
        lse[bt * s.H + h0 + hl] = l > 0 ? m + log(l) : inf;
    }
    __syncthreads();
    for (int64_t x = tid; x < int64_t(hn) * s.DV; x += kThreads) {
        const int64_t h = x / s.DV, d = x % s.DV;
        o[(bt * s.H + h0 + h) * s.DV + d] = sums[h] > 0 ? Os[h * at.dv + d] / sums[h] : 0.0f;
    }
}

// The tensor-core dq's shared memory: q's and dO's head group and the chunk's entries as bf16, the warps' partial
// score and dO·v tiles, dz as bf16, and the finished dQ [kHeads][DK'] f32.
struct TcDqSmem {
    int64_t dk, dv, dout, entries, partial_z, partial_dp, dz, out, bytes;
    __host__ __device__ explicit TcDqSmem(const SparseShape& s) {
        dk = round16(s.DK), dv = round16(s.DV);
        dout = kHeads * dk * 2;
        entries = dout + kHeads * dv * 2;
        partial_z = entries + kChunk * dk * 2;
        partial_dp = partial_z + (kThreads / 32) * kHeads * kChunk * 4;
        dz = partial_dp + (kThreads / 32) * kHeads * kChunk * 4;
        out = dz + kHeads * kChunk * 2;
        bytes = out + kHeads * dk * 4;
    }
};
constexpr int kDqTiles = int((kSparseMaxDK + 16 * (kThreads / 32) - 1) / (16 * (kThreads / 32)));  // per warp

// dq on tensor cores (train.precision = bf16, f32 data): per chunk, the score and dO·v tiles by WMMA (partial tiles
// summed in warp order, as the forward's), dz = p·(dp − Δ) per (head, entry) rounded to bf16, then dQ += dZ·E by tiles
// of 16 dims that each warp keeps in its accumulators over the chunks.
__global__ void dq_tc_kernel(SparseShape s,
                             const float* dout,
                             const float* q,
                             const float* kv,
                             const int32_t* idx,
                             const float* lse,
                             const float* delta,
                             float* dq) {
    namespace wmma = nvcuda::wmma;
    const TcDqSmem at(s);
    unsigned char* smem = dynamic_shared();
    auto* Qb = reinterpret_cast<__nv_bfloat16*>(smem);               // [kHeads][dk]
    auto* Ob = reinterpret_cast<__nv_bfloat16*>(smem + at.dout);     // [kHeads][dv]
    auto* Eb = reinterpret_cast<__nv_bfloat16*>(smem + at.entries);  // [kChunk][dk]
    auto* Sz = reinterpret_cast<float*>(smem + at.partial_z);        // [warps][kHeads][kChunk]
    auto* Sdp = reinterpret_cast<float*>(smem + at.partial_dp);      // [warps][kHeads][kChunk]
    auto* DZb = reinterpret_cast<__nv_bfloat16*>(smem + at.dz);      // [kHeads][kChunk]
    auto* Out = reinterpret_cast<float*>(smem + at.out);             // [kHeads][dk]
    __shared__ int32_t rows[kChunk];
    __shared__ int ends[kThreads / 32];
    __shared__ float lses[kHeads];
    const int64_t bt = blockIdx.x, b = bt / s.T, h0 = int64_t(blockIdx.y) * kHeads, tid = threadIdx.x;
    const int hn = int(min(int64_t(kHeads), s.H - h0)), hl = int(tid / kChunk), e = int(tid % kChunk);
    const int warp = int(tid / 32), warps = kThreads / 32;
    const bool head = hl < hn;
    stage_rows_bf16(q + (bt * s.H + h0) * s.DK, s.DK, hn, kHeads, s.DK, at.dk, Qb);
    stage_rows_bf16(dout + (bt * s.H + h0) * s.DV, s.DV, hn, kHeads, s.DV, at.dv, Ob);
    if (tid < hn) lses[tid] = lse[bt * s.H + h0 + tid];
    __syncthreads();
    const float* kvb = kv + b * s.T * s.DK;
    const float scale = float(s.scale), L = lses[head ? hl : 0], D = head ? delta[bt * s.H + h0 + hl] : 0.0f;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fz;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fv;  // entries as rows
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kDqTiles];
    for (int t = 0; t < kDqTiles; ++t) wmma::fill_fragment(acc[t], 0.0f);
    const int64_t n = row_end(idx + bt * s.K, s, ends);
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
        stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, at.dk, rows, Eb);  // after the last chunk's dz
        partial_scores(Qb, at.dk, Eb, at.dk, at.dk, 1, Sz);
        partial_scores(Ob, at.dv, Eb, at.dk, at.dv, 1, Sdp);  // dO·v over the values: an entry's first DV dims
        __syncthreads();
        float g = 0;
        if (head && rows[e] >= 0 && !isinf(L)) {
            float z = 0, dp = 0;
            for (int w = 0; w < warps; ++w) {
                z += Sz[(w * kHeads + hl) * kChunk + e];
                dp += Sdp[(w * kHeads + hl) * kChunk + e];
            }
            g = exp(scale * z - L) * (dp - D);
        }
        DZb[hl * kChunk + e] = __float2bfloat16(g);
        __syncthreads();
        wmma::load_matrix_sync(fz, DZb, unsigned(kChunk));
        for (int t = 0; t < kDqTiles; ++t) {
            const int64_t d0 = 16 * (warp + int64_t(warps) * t);
            if (d0 >= at.dk) break;
            wmma::load_matrix_sync(fv, Eb + d0, unsigned(at.dk));
            wmma::mma_sync(acc[t], fz, fv, acc[t]);
        }
    }
    for (int t = 0; t < kDqTiles; ++t) {
        const int64_t d0 = 16 * (warp + int64_t(warps) * t);
        if (d0 >= at.dk) break;
        wmma::store_matrix_sync(Out + d0, acc[t], unsigned(at.dk), wmma::mem_row_major);
    }
    __syncthreads();
    for (int64_t x = tid; x < int64_t(hn) * s.DK; x += kThreads) {
        const int64_t h = x / s.DK, d = x % s.DK;
        if (!isinf(lses[h])) dq[(bt * s.H + h0 + h) * s.DK + d] += scale * Out[h * at.dk + d];  // no entry: nothing
    }
}

// probs[bt, i] = (1/H)·Σ_h exp(z_{t,i,h} − lse[t, h]), the heads summed in order.
template <class T>
__global__ void probs_kernel(SparseShape s, const T* q, const T* kv, const int32_t* idx, const T* lse, T* probs) {
    T* E = reinterpret_cast<T*>(dynamic_shared());  // [kChunk][DK + 1]
    const int64_t ld = s.DK + 1;
    T* S = E + kChunk * ld;  // [H][kChunk]
    __shared__ int32_t rows[kChunk];
    __shared__ int ends[kThreads / 32];
    const int64_t bt = blockIdx.x, b = bt / s.T, tid = threadIdx.x, hl = tid / kChunk, e = tid % kChunk;
    const T* kvb = kv + b * s.T * s.DK;
    const T scale = T(s.scale), inv_h = T(1.0 / double(s.H));
    const int64_t n = row_end(idx + bt * s.K, s, ends);
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
        stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, ld, rows, E);
        for (int64_t h = hl; h < s.H; h += kHeads) {
            const T L = lse[bt * s.H + h];
            T v = 0;
            if (rows[e] >= 0 && !isinf(L)) {
                T z;
                entry_dots<T>(q + (bt * s.H + h) * s.DK, nullptr, E + e * ld, s.DK, 0, scale, z, nullptr);
                v = exp(z - L);
            }
            S[h * kChunk + e] = v;
        }
        __syncthreads();
        if (tid < kChunk && i0 + tid < s.K) {
            T sum = 0;
            for (int64_t h = 0; h < s.H; ++h) sum += S[h * kChunk + tid];
            probs[bt * s.K + i0 + tid] = sum * inv_h;
        }
    }
    for (int64_t i = (n + kChunk - 1) / kChunk * kChunk + tid; i < s.K; i += blockDim.x) probs[bt * s.K + i] = 0;
}

// The teacher probabilities on tensor cores (train.precision = bf16, f32 data): a block per query walks its head
// groups, and for each its chunks of 16 entries: the (16 heads × 16 entries) score tile by WMMA (partial tiles summed
// in warp order), then a thread per entry adds the group's exp(z − lse) in head order into probs, which it alone
// owns; the groups go in order, then the sum is scaled by 1/H. Shared memory: q's head group and the entries as bf16
// [16][DK'], the warps' partial tiles.
size_t probs_tc_smem(const SparseShape& s) {
    return size_t(2 * kHeads * round16(s.DK) * 2 + (kThreads / 32) * kHeads * kChunk * 4);
}

__global__ void probs_tc_kernel(
    SparseShape s, const float* q, const float* kv, const int32_t* idx, const float* lse, float* probs) {
    const int64_t dk = round16(s.DK);
    unsigned char* smem = dynamic_shared();
    auto* Qb = reinterpret_cast<__nv_bfloat16*>(smem);      // [kHeads][dk]
    __nv_bfloat16* Eb = Qb + kHeads * dk;                   // [kChunk][dk]
    auto* Sp = reinterpret_cast<float*>(Eb + kChunk * dk);  // [warps][kHeads][kChunk]
    __shared__ int32_t rows[kChunk];
    __shared__ int ends[kThreads / 32];
    __shared__ float lses[kHeads];
    const int64_t bt = blockIdx.x, b = bt / s.T, tid = threadIdx.x;
    const int warps = kThreads / 32;
    const float* kvb = kv + b * s.T * s.DK;
    const float scale = float(s.scale);
    float* out = probs + bt * s.K;
    for (int64_t i = tid; i < s.K; i += kThreads) out[i] = 0.0f;
    const int64_t n = row_end(idx + bt * s.K, s, ends);
    for (int64_t hg = 0; hg < s.H; hg += kHeads) {
        const int64_t hn = min(int64_t(kHeads), s.H - hg);
        __syncthreads();  // the previous group's q rows are consumed
        stage_rows_bf16(q + (bt * s.H + hg) * s.DK, s.DK, hn, kHeads, s.DK, dk, Qb);
        if (tid < hn) lses[tid] = lse[bt * s.H + hg + tid];
        for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
            stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, dk, rows, Eb);  // after the last chunk's sums
            partial_scores(Qb, dk, Eb, dk, dk, 1, Sp);
            __syncthreads();
            if (tid < kChunk && i0 + tid < s.K && rows[tid] >= 0) {
                float sum = 0;
                for (int64_t h = 0; h < hn; ++h) {
                    if (isinf(lses[h])) continue;
                    float z = 0;
                    for (int w = 0; w < warps; ++w) z += Sp[(w * kHeads + h) * kChunk + tid];
                    sum += exp(scale * z - lses[h]);
                }
                out[i0 + tid] += sum;
            }
        }
    }
    __syncthreads();
    const float inv_h = float(1.0 / double(s.H));
    for (int64_t i = tid; i < s.K; i += kThreads) out[i] *= inv_h;
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
    T* E = reinterpret_cast<T*>(dynamic_shared());  // [kChunk][DK + 1]
    __shared__ int32_t rows[kChunk];
    __shared__ int ends[kThreads / 32];
    __shared__ T DZ[kHeads][kChunk];
    __shared__ T lses[kHeads];
    const int64_t bt = blockIdx.x, b = bt / s.T, h0 = int64_t(blockIdx.y) * kHeads, tid = threadIdx.x;
    const int hn = int(min(int64_t(kHeads), s.H - h0)), hl = int(tid / kChunk), e = int(tid % kChunk);
    const bool head = hl < hn;
    const int64_t ld = s.DK + 1, r = bt * s.H + h0 + (head ? hl : 0);
    if (tid < hn) lses[tid] = lse[bt * s.H + h0 + tid];
    __syncthreads();
    const T* kvb = kv + b * s.T * s.DK;
    const T scale = T(s.scale), L = lses[head ? hl : 0], D = delta[r];
    T acc[kHeads][kDkSlots] = {};  // dims tid + c·kThreads of each head of the group
    const int64_t n = row_end(idx + bt * s.K, s, ends);
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
        stage_entries(idx + bt * s.K, n, i0, kChunk, s, kvb, ld, rows, E);
        T g = 0;
        if (head && rows[e] >= 0 && !isinf(L)) {
            T z, dp;
            entry_dots<T>(q + r * s.DK, dout + r * s.DV, E + e * ld, s.DK, s.DV, scale, z, &dp);
            g = exp(z - L) * (dp - D);
        }
        DZ[hl][e] = g;
        __syncthreads();
        for (int c = 0; c < kDkSlots; ++c) {
            const int64_t d = tid + c * int64_t(kThreads);
            if (d >= s.DK) break;
            for (int j = 0; j < kChunk; ++j) {
                if (rows[j] < 0) continue;
                const T v = E[j * ld + d];
                for (int h = 0; h < kHeads; ++h)
                    if (h < hn) acc[h][c] += DZ[h][j] * v;
            }
        }
    }
    for (int h = 0; h < kHeads; ++h) {
        if (h >= hn) break;
        if (isinf(lses[h])) continue;  // no valid entry: nothing flows back
        T* g = dq + (bt * s.H + h0 + h) * s.DK;
        for (int c = 0; c < kDkSlots; ++c) {
            const int64_t d = tid + c * int64_t(kThreads);
            if (d < s.DK) g[d] += scale * acc[h][c];
        }
    }
}

// The dkv kernels' key ranges: block (b, slab, r) owns the keys [r·len, (r + 1)·len) of its slab's accumulator, so
// no two blocks write one row and each row still takes its queries ascending and their entries in row order: the
// bits do not depend on the range count. Each block finds its entries in every row of its queries: by two binary
// searches in a sorted row (the indexer's, sorted_rows_kernel), else picking them out of windows of the row.
constexpr int kSelectPasses = 4;  // a window of a row: kSelectPasses · kThreads entries
constexpr int64_t kWindow = kSelectPasses * kThreads;

// The positions i in [w0, w0 + kWindow) of a query's row whose selected key lies in [lo, hi) (0 ≤ lo, hi ≤ T: −1
// and out-of-range entries never do), in row order into list; returns their count. A pass takes kThreads consecutive
// entries, a thread each; the warps' counts (ballots) through `counts`. Every thread of the block calls it; starts
// and ends at a barrier.
__device__ int64_t
select_in_range(const int32_t* row, int64_t w0, int64_t K, int64_t lo, int64_t hi, int32_t* list, int* counts) {
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32, warps = kThreads / 32;
    int64_t n = 0;
    for (int pass = 0; pass < kSelectPasses; ++pass) {
        const int64_t i = w0 + int64_t(pass) * kThreads + tid;
        const int32_t sel = i < K ? row[i] : -1;
        const bool in = sel >= lo && sel < hi;
        const unsigned mask = __ballot_sync(0xffffffffu, in);
        __syncthreads();  // the previous pass's counts (or the previous window's list) are consumed
        if (lane == 0) counts[warp] = __popc(mask);
        __syncthreads();
        int64_t at = n + __popc(mask & ((1u << lane) - 1u));
        for (int w = 0; w < warps; ++w) {
            if (w < warp) at += counts[w];
            n += counts[w];
        }
        if (in) list[at] = int32_t(i);
    }
    __syncthreads();
    return n;
}

// Whether each query's row is sorted, as the indexer writes it (ops/dsa.h): its entries in [0, T) first, ascending
// (repeats allowed), every later one skipped (−1 or out of range). A warp per row; sorted[b·T + t] 1 or 0.
__global__ void sorted_rows_kernel(SparseShape s, const int32_t* idx, uint8_t* sorted) {
    const int64_t bt = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (bt >= s.B * s.T) return;  // the whole warp
    const int32_t* row = idx + bt * s.K;
    bool ok = true;
    for (int64_t i = lane + 1; i < s.K; i += 32) {
        const int32_t prev = row[i - 1], sel = row[i];
        if (entry_ok<float>(sel, s.T) && (!entry_ok<float>(prev, s.T) || prev > sel)) ok = false;
    }
    const unsigned unsorted = __ballot_sync(0xffffffffu, !ok);
    if (lane == 0) sorted[bt] = unsorted == 0;
}

// The first position of a sorted row (sorted_rows_kernel) whose entry is skipped or at least x: the row's entries in
// keys [lo, hi) are the positions from first_at_least(lo) up to first_at_least(hi).
__device__ inline int64_t first_at_least(const int32_t* row, const SparseShape& s, int64_t x) {
    int64_t a = 0, b = s.K;  // entries before a lie below x, those from b on do not
    while (a < b) {
        const int64_t m = (a + b) / 2, sel = row[m];
        if (entry_ok<float>(int32_t(sel), s.T) && sel < x) {
            a = m + 1;
        } else {
            b = m;
        }
    }
    return a;
}

// A window of a query's row in a dkv block of keys [lo, hi): its `count` entries are row[i] (or row[list[i]]), the
// next window starts at `next` (K: none).
struct RangeWindow {
    const int32_t* row;
    const int32_t* list;
    int64_t count, next;
};

// The window from w0 on: the whole row (up to row_end) where the range is every key; where the row is sorted its run
// of entries in range (one window); else the entries of [w0, w0 + kWindow) in range, picked into list. Every thread of
// the block calls it.
__device__ RangeWindow range_window(const int32_t* row,
                                    int64_t w0,
                                    const SparseShape& s,
                                    int64_t lo,
                                    int64_t hi,
                                    bool sorted,
                                    int32_t* list,
                                    int* counts) {
    if (lo == 0 && hi == s.T) return {row, nullptr, row_end(row, s, counts), s.K};
    if (sorted) {
        const int64_t first = first_at_least(row, s, lo);
        return {row + first, nullptr, first_at_least(row, s, hi) - first, s.K};
    }
    return {row, list, select_in_range(row, w0, s.K, lo, hi, list, counts), w0 + kWindow};
}

// Slab sl of batch row b, keys of range blockIdx.z (len each): acc[sl][b·T + s] += scale·Σ_h dz_{t,i,h}·q[t, h]
// (+ Σ_h p_{t,i,h}·dO[t, h] on the value dims) over its queries t ascending and their entries i in row order.
template <class T>
__global__ void dkv_kernel(SparseShape s,
                           int64_t slabs,
                           int64_t pairs,
                           int64_t len,
                           const T* dout,
                           const T* q,
                           const T* kv,
                           const int32_t* idx,
                           const uint8_t* sorted,
                           const T* lse,
                           const T* delta,
                           T* acc) {
    const int64_t ld = s.DK + 1;
    T* E = reinterpret_cast<T*>(dynamic_shared());  // [pairs][DK + 1]
    T* P = E + pairs * ld;                          // [pairs][H]
    T* DZ = P + pairs * s.H;                        // [pairs][H]
    int32_t* rows = reinterpret_cast<int32_t*>(DZ + pairs * s.H);
    __shared__ int32_t list[kWindow];
    __shared__ int counts[kThreads / 32];
    const int64_t b = blockIdx.x, sl = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int64_t lo = int64_t(blockIdx.z) * len, hi = min(s.T, lo + len);
    const T* kvb = kv + b * s.T * s.DK;
    T* slab = acc + (sl * s.B * s.T + b * s.T) * s.DK;
    const T scale = T(s.scale);
    for (int64_t t = s.T * sl / slabs; t < s.T * (sl + 1) / slabs; ++t) {
        const int64_t bt = b * s.T + t;
        for (int64_t w0 = 0; w0 < s.K;) {
            const RangeWindow w = range_window(idx + bt * s.K, w0, s, lo, hi, sorted && sorted[bt], list, counts);
            w0 = w.next;
            for (int64_t i0 = 0; i0 < w.count; i0 += pairs) {
                stage_entries(w.row, w.count, i0, pairs, s, kvb, ld, rows, E, w.list);
                for (int64_t x = tid; x < pairs * s.H; x += nt) {  // a warp: one head, consecutive entries
                    const int64_t h = x / pairs, j = x % pairs, r = bt * s.H + h;
                    T pr = 0, g = 0;
                    if (rows[j] >= 0 && !isinf(lse[r])) {
                        T z, dp;
                        entry_dots<T>(q + r * s.DK, dout + r * s.DV, E + j * ld, s.DK, s.DV, scale, z, &dp);
                        pr = exp(z - lse[r]);
                        g = pr * (dp - delta[r]);
                    }
                    P[j * s.H + h] = pr;
                    DZ[j * s.H + h] = g;
                }
                __syncthreads();
                for (int c = 0; c < kDkSlots; ++c) {
                    const int64_t d = tid + c * nt;
                    if (d >= s.DK) break;
                    const bool value = d < s.DV;
                    for (int64_t j0 = 0; j0 < pairs; j0 += kSub) {  // kSub entries at a time share each load of q, dO
                        T a[kSub] = {}, v[kSub] = {};
                        for (int64_t h = 0; h < s.H; ++h) {
                            const int64_t r = bt * s.H + h;
                            const T qd = q[r * s.DK + d], gd = value ? dout[r * s.DV + d] : T(0);
                            for (int jj = 0; jj < kSub; ++jj) {
                                a[jj] += DZ[(j0 + jj) * s.H + h] * qd;
                                if (value) v[jj] += P[(j0 + jj) * s.H + h] * gd;
                            }
                        }
                        for (int jj = 0; jj < kSub; ++jj) {
                            const int32_t row = rows[j0 + jj];
                            if (row >= 0) slab[int64_t(row) * s.DK + d] += scale * a[jj] + v[jj];
                        }
                    }
                }
            }
        }
    }
}

// The tensor-core dkv's shared memory: a step's 32 entries, then one head group's q and dO rows, as bf16; the warps'
// partial score and dO·v tiles; P and scale·dz as bf16 [entries][heads]; the step's contributions [32][DK'] f32.
constexpr int64_t kTcPairs = 32;  // entries of one query per step
constexpr int kDkvTiles = int((2 * kSparseMaxDK / 16 + kThreads / 32 - 1) / (kThreads / 32));  // per warp
struct TcDkvSmem {
    int64_t dk, dv, q, dout, partial_z, partial_dp, p, dz, out, bytes;
    __host__ __device__ explicit TcDkvSmem(const SparseShape& s) {
        dk = round16(s.DK), dv = round16(s.DV);
        q = kTcPairs * dk * 2;
        dout = q + kHeads * dk * 2;
        partial_z = dout + kHeads * dv * 2;
        partial_dp = partial_z + (kThreads / 32) * kHeads * 16 * 4;
        p = partial_dp + (kThreads / 32) * kHeads * 16 * 4;
        dz = p + kTcPairs * kHeads * 2;
        out = dz + kTcPairs * kHeads * 2;
        bytes = out + kTcPairs * dk * 4;
    }
};

// dkv on tensor cores (train.precision = bf16, f32 data), the scheme of dkv_kernel with every dim in one block: per
// query t of the slab (ascending) and step of 32 of its entries, for each group of 16 heads the score and dO·v tiles
// by WMMA (partial tiles summed in warp order), p and scale·dz rounded to bf16, then the contributions
// C [32, DK] += (scale·dZ)ᵀ·q + Pᵀ·dO by WMMA over the group's heads, kept in the warps' accumulators; then C goes
// through shared memory and each thread adds its dims' rows into the slab in entry order.
__global__ void dkv_tc_kernel(SparseShape s,
                              int64_t slabs,
                              int64_t len,
                              const float* dout,
                              const float* q,
                              const float* kv,
                              const int32_t* idx,
                              const uint8_t* sorted,
                              const float* lse,
                              const float* delta,
                              float* acc) {
    namespace wmma = nvcuda::wmma;
    const TcDkvSmem at(s);
    unsigned char* smem = dynamic_shared();
    auto* Eb = reinterpret_cast<__nv_bfloat16*>(smem);            // [kTcPairs][dk]
    auto* Qb = reinterpret_cast<__nv_bfloat16*>(smem + at.q);     // [kHeads][dk]
    auto* Ob = reinterpret_cast<__nv_bfloat16*>(smem + at.dout);  // [kHeads][dv]
    auto* Sz = reinterpret_cast<float*>(smem + at.partial_z);     // [warps][kHeads][16]
    auto* Sdp = reinterpret_cast<float*>(smem + at.partial_dp);   // [warps][kHeads][16]
    auto* Pb = reinterpret_cast<__nv_bfloat16*>(smem + at.p);     // [kTcPairs][kHeads]
    auto* DZb = reinterpret_cast<__nv_bfloat16*>(smem + at.dz);   // [kTcPairs][kHeads]
    auto* Cs = reinterpret_cast<float*>(smem + at.out);           // [kTcPairs][dk]
    __shared__ int32_t rows[kTcPairs];
    __shared__ int32_t list[kWindow];
    __shared__ int counts[kThreads / 32];
    const int64_t b = blockIdx.x, sl = blockIdx.y, tid = threadIdx.x;
    const int64_t lo = int64_t(blockIdx.z) * len, hi = min(s.T, lo + len);
    const int warp = int(tid / 32), warps = kThreads / 32;
    const float* kvb = kv + b * s.T * s.DK;
    float* slab = acc + (sl * s.B * s.T + b * s.T) * s.DK;
    const float scale = float(s.scale);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[kDkvTiles];  // tile warp + 8·i: entries 16·(i % 2)…
    for (int64_t t = s.T * sl / slabs; t < s.T * (sl + 1) / slabs; ++t) {
        const int64_t bt = b * s.T + t;
        bool staged = false;  // one head group: its rows stay from the query's first step in this block
        for (int64_t w0 = 0; w0 < s.K;) {
            const RangeWindow w = range_window(idx + bt * s.K, w0, s, lo, hi, sorted && sorted[bt], list, counts);
            w0 = w.next;
            for (int64_t i0 = 0; i0 < w.count; i0 += kTcPairs) {
                // after the last scatter
                stage_entries(w.row, w.count, i0, kTcPairs, s, kvb, at.dk, rows, Eb, w.list);
                for (int i = 0; i < kDkvTiles; ++i) wmma::fill_fragment(c[i], 0.0f);
                for (int64_t hg = 0; hg < s.H; hg += kHeads) {
                    const int64_t hn = min(int64_t(kHeads), s.H - hg);
                    __syncthreads();  // the previous group's rows, P and dz are consumed
                    if (s.H > kHeads || !staged) {
                        stage_rows_bf16(q + (bt * s.H + hg) * s.DK, s.DK, hn, kHeads, s.DK, at.dk, Qb);
                        stage_rows_bf16(dout + (bt * s.H + hg) * s.DV, s.DV, hn, kHeads, s.DV, at.dv, Ob);
                        __syncthreads();
                        staged = true;
                    }
                    partial_scores(Qb, at.dk, Eb, at.dk, at.dk, 2, Sz);
                    partial_scores(Ob, at.dv, Eb, at.dk, at.dv, 2, Sdp);
                    __syncthreads();
                    for (int64_t x = tid; x < kHeads * kTcPairs; x += kThreads) {  // (head, entry) pairs
                        const int64_t h = x / kTcPairs, j = x % kTcPairs, r = bt * s.H + hg + h;
                        float pr = 0, g = 0;
                        if (h < hn && rows[j] >= 0 && !isinf(lse[r])) {
                            float z = 0, dp = 0;
                            for (int w = int(j / 16); w < warps; w += 2) {
                                z += Sz[(w * kHeads + h) * 16 + j % 16];
                                dp += Sdp[(w * kHeads + h) * 16 + j % 16];
                            }
                            pr = exp(scale * z - lse[r]);
                            g = pr * (dp - delta[r]);
                        }
                        Pb[j * kHeads + h] = __float2bfloat16(pr);
                        DZb[j * kHeads + h] = __float2bfloat16(scale * g);
                    }
                    __syncthreads();
                    for (int i = 0; i < kDkvTiles; ++i) {
                        const int64_t tile = warp + int64_t(warps) * i, jt = tile % 2, d0 = tile / 2 * 16;
                        if (d0 >= at.dk) break;
                        wmma::load_matrix_sync(fa, DZb + jt * 16 * kHeads, unsigned(kHeads));
                        wmma::load_matrix_sync(fb, Qb + d0, unsigned(at.dk));
                        wmma::mma_sync(c[i], fa, fb, c[i]);
                        if (d0 < at.dv) {
                            wmma::load_matrix_sync(fa, Pb + jt * 16 * kHeads, unsigned(kHeads));
                            wmma::load_matrix_sync(fb, Ob + d0, unsigned(at.dv));
                            wmma::mma_sync(c[i], fa, fb, c[i]);
                        }
                    }
                }
                for (int i = 0; i < kDkvTiles; ++i) {
                    const int64_t tile = warp + int64_t(warps) * i, jt = tile % 2, d0 = tile / 2 * 16;
                    if (d0 >= at.dk) break;
                    wmma::store_matrix_sync(Cs + jt * 16 * at.dk + d0, c[i], unsigned(at.dk), wmma::mem_row_major);
                }
                __syncthreads();
                for (int64_t d = tid; d < s.DK; d += kThreads)
                    for (int64_t j = 0; j < kTcPairs; ++j)
                        if (rows[j] >= 0) slab[int64_t(rows[j]) * s.DK + d] += Cs[j * at.dk + d];
            }
        }
    }
}

size_t entries_smem(const SparseShape& s, int64_t n, size_t elem) { return size_t(n * (s.DK + 1)) * elem; }
size_t probs_smem(const SparseShape& s, size_t elem) {
    return entries_smem(s, kChunk, elem) + size_t(s.H * kChunk) * elem;
}
size_t dkv_smem(const SparseShape& s, size_t elem) {
    const int64_t n = dkv_pairs(s.H);
    return entries_smem(s, n, elem) + size_t(2 * n * s.H) * elem + size_t(n) * sizeof(int32_t);
}

template <class K>
cudaError_t allow_smem(K* kernel, size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

}  // namespace

size_t sparse_attention_smem(SparseShape s, size_t elem) {  // the dkv kernels' with their static key-range list
    constexpr size_t select = kWindow * sizeof(int32_t) + (kThreads / 32) * sizeof(int);
    return std::max({probs_smem(s, elem), dkv_smem(s, elem) + select, size_t(TcForwardSmem(s).bytes),
                     size_t(TcDqSmem(s).bytes), size_t(TcDkvSmem(s).bytes) + select, probs_tc_smem(s)});
}

template <class T>
cudaError_t launch_sparse_attention_forward(
    SparseShape s, const T* q, const T* kv, const int32_t* idx, T* o, T* lse, bool bf16, cudaStream_t stream) {
    if (s.B * s.T == 0 || s.H == 0) return cudaSuccess;
    const dim3 grid(unsigned(s.B * s.T), unsigned((s.H + kHeads - 1) / kHeads));
    if constexpr (std::is_same_v<T, float>) {
        if (bf16) {  // on tensor cores
            const size_t smem = size_t(TcForwardSmem(s).bytes);
            if (cudaError_t err = allow_smem(forward_tc_kernel, smem); err != cudaSuccess) return err;
            launch_kernel(forward_tc_kernel, grid, kThreads, smem, stream, s, q, kv, idx, o, lse);
            return cudaGetLastError();
        }
    }
    const size_t smem = entries_smem(s, kChunk, sizeof(T));
    if (cudaError_t err = allow_smem(forward_kernel<T>, smem); err != cudaSuccess) return err;
    launch_kernel(forward_kernel<T>, grid, kThreads, smem, stream, s, q, kv, idx, o, lse);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_sparse_attention_probs(SparseShape s,
                                          const T* q,
                                          const T* kv,
                                          const int32_t* idx,
                                          const T* lse,
                                          T* probs,
                                          bool bf16,
                                          cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    if constexpr (std::is_same_v<T, float>) {
        if (bf16) {  // on tensor cores
            const size_t smem = probs_tc_smem(s);
            if (cudaError_t err = allow_smem(probs_tc_kernel, smem); err != cudaSuccess) return err;
            launch_kernel(probs_tc_kernel, unsigned(s.B * s.T), kThreads, smem, stream, s, q, kv, idx, lse, probs);
            return cudaGetLastError();
        }
    }
    const size_t smem = probs_smem(s, sizeof(T));
    if (cudaError_t err = allow_smem(probs_kernel<T>, smem); err != cudaSuccess) return err;
    launch_kernel(probs_kernel<T>, unsigned(s.B * s.T), kThreads, smem, stream, s, q, kv, idx, lse, probs);
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
                                             uint8_t* sorted,
                                             T* dq,
                                             T* dkv,
                                             bool bf16,
                                             cudaStream_t stream) {
    const int64_t rows = s.B * s.T * s.H;
    if (rows == 0) return cudaSuccess;
    launch_kernel(delta_kernel<T>, grid_for(rows), kBlock, 0, stream, rows, s.DV, dout, o, delta);
    const dim3 groups(unsigned(s.B * s.T), unsigned((s.H + kHeads - 1) / kHeads));
    size_t smem = entries_smem(s, kChunk, sizeof(T));
    cudaError_t err = cudaSuccess;
    if constexpr (std::is_same_v<T, float>) {
        if (bf16) {  // dq on tensor cores
            smem = size_t(TcDqSmem(s).bytes);
            if (err = allow_smem(dq_tc_kernel, smem); err != cudaSuccess) return err;
            launch_kernel(dq_tc_kernel, groups, kThreads, smem, stream, s, dout, q, kv, idx, lse, delta, dq);
        }
    }
    if (!bf16 || !std::is_same_v<T, float>) {
        if (err = allow_smem(dq_kernel<T>, smem); err != cudaSuccess) return err;
        launch_kernel(dq_kernel<T>, groups, kThreads, smem, stream, s, dout, q, kv, idx, lse, delta, dq);
    }
    err = cudaMemsetAsync(acc, 0, sizeof(T) * size_t(slabs * s.B * s.T * s.DK), stream);
    if (err != cudaSuccess) return err;
    // key ranges where batch × slabs leaves the GPU short of kDkvBlocks blocks, each of kMinRange keys at least
    const int64_t ranges = dkv_key_ranges(s.B * slabs, s.T), len = (s.T + ranges - 1) / ranges;
    const dim3 grid(unsigned(s.B), unsigned(slabs), unsigned(ranges));
    if (ranges > 1) {  // the rows a block can binary-search for its keys
        const int64_t warps = kBlock / 32;
        launch_kernel(sorted_rows_kernel, unsigned((s.B * s.T + warps - 1) / warps), kBlock, 0, stream, s, idx, sorted);
    } else {
        sorted = nullptr;  // one range: every block takes whole rows
    }
    if constexpr (std::is_same_v<T, float>) {
        if (bf16) {  // dkv on tensor cores
            smem = size_t(TcDkvSmem(s).bytes);
            if (err = allow_smem(dkv_tc_kernel, smem); err != cudaSuccess) return err;
            launch_kernel(dkv_tc_kernel, grid, kThreads, smem, stream, s, slabs, len, dout, q, kv, idx, sorted, lse,
                          delta, acc);
        }
    }
    if (!bf16 || !std::is_same_v<T, float>) {
        smem = dkv_smem(s, sizeof(T));
        if (err = allow_smem(dkv_kernel<T>, smem); err != cudaSuccess) return err;
        launch_kernel(dkv_kernel<T>, grid, kThreads, smem, stream, s, slabs, dkv_pairs(s.H), len, dout, q, kv, idx,
                      sorted, lse, delta, acc);
    }
    const int64_t n = s.B * s.T * s.DK;
    launch_kernel(slab_sum_kernel<T>, grid_for(n), kBlock, 0, stream, n, slabs, acc, dkv);
    return cudaGetLastError();
}

#define TESSERA_SPARSE(T)                                                                                              \
    template cudaError_t launch_sparse_attention_forward<T>(SparseShape, const T*, const T*, const int32_t*, T*, T*,   \
                                                            bool, cudaStream_t);                                       \
    template cudaError_t launch_sparse_attention_probs<T>(SparseShape, const T*, const T*, const int32_t*, const T*,   \
                                                          T*, bool, cudaStream_t);                                     \
    template cudaError_t launch_sparse_attention_backward<T>(SparseShape, int64_t, const T*, const T*, const T*,       \
                                                             const int32_t*, const T*, const T*, T*, T*, uint8_t*, T*, \
                                                             T*, bool, cudaStream_t);
TESSERA_SPARSE(float)
TESSERA_SPARSE(double)
#undef TESSERA_SPARSE

}  // namespace tessera::ops::cuda
