// The indexer's KL loss on CUDA (ops/dsa.h): mean over the rows with support of KL(p_t ‖ softmax(I_t)), the support
// being the valid selected entries (indices) or every candidate s <= t of t's sequence (dense warm-up).
// Every kernel walks a query's support kChunk entries at a time (chunk_dots): the chunk's keys gathered into shared
// memory once, a thread per (entry, head) for the head dots, then a thread per entry for I = Σ_j w_j·relu(q_j·k_s)
// (heads in order, in double), so every kernel has the same I bit for bit.
//   row pass: one block per query; thread tid takes entries lo + tid, lo + tid + kThreads, ... into its online
//     softmax; the row's log-sum-exp, Σp and KL by fixed-order block reductions.
//   gradients (g = dloss / rows): dI = g·(softmax(I)·Σp − p); dw and dq per query block (entries in order), dk by
//     the fixed query slabs of sparse attention's dkv (no atomics), then the slabs in order.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <type_traits>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
constexpr int kThreads = 128;
constexpr int kChunk = 32;  // support entries per step of the gradient kernels

// Slot `slot` of query bt's support: its key position (−1 when the slot is not in the support) and p's element.
__device__ inline int64_t support_pos(const KlShape& s, const int32_t* idx, int64_t bt, int64_t slot, int64_t& pidx) {
    if (idx) {
        pidx = bt * s.K + slot;
        const int32_t sel = idx[pidx];
        return sel >= 0 && sel < s.T ? sel : -1;
    }
    pidx = bt * s.T + slot;
    return slot;
}

// The slots [lo, hi) of query bt (sparse: every entry; dense: t's candidates)
__device__ inline void support_slots(const KlShape& s, const int64_t* cu, int64_t bt, int64_t& lo, int64_t& hi) {
    const int64_t t = bt % s.T;
    if (s.K > 0) {
        lo = 0;
        hi = s.K;
        return;
    }
    lo = 0;
    if (cu)
        for (int64_t i = 0; i < s.segments; ++i)
            if (cu[i] <= t) lo = cu[i];
    hi = t + 1;
}

// The tensor-core part of shared memory (s.bf16), after the scalar layout: q[t]'s heads [HI'][DI'] and the chunk's
// keys [kChunk][DI'] as bf16, the dots [HI'][kChunk] f32; for the gradients the chunk's DA [kChunk][HI'] as bf16 and
// a product's f32 tile: dq's running [HI'][DI'] or dk's chunk [kChunk][DI'] (' = whole 16s).
struct TcDots {
    int64_t hi, di, keys, dots, grads, out, bytes;
    __host__ __device__ explicit TcDots(const KlShape& s) {
        hi = round16(s.HI), di = round16(s.DI);
        keys = hi * di * 2;
        dots = keys + kChunk * di * 2;
        grads = dots + hi * kChunk * 4;
        out = grads + kChunk * hi * 2;
        bytes = out + (hi > kChunk ? hi : kChunk) * di * 4;
    }
};

// The scalar layout's bytes (indexer_kl_smem), rounded up to the tensor-core part's 128-byte alignment.
__host__ __device__ inline int64_t scalar_smem(const KlShape& s, size_t elem) {
    return (int64_t(kChunk * sizeof(int64_t) + size_t(kChunk * (2 * s.HI + s.DI + 1)) * elem) + 127) / 128 * 128;
}

// chunk_dots' products on tensor cores (train.precision = bf16, f32 data): q[t]'s heads and the chunk's keys (already
// in `keys`) rounded to bf16, the (heads × 32 entries) dots by WMMA with f32 sums, a warp per 16 × 16 tile in turn,
// then A [kChunk][HI] from the dots. Every thread takes part.
__device__ void chunk_dots_tc(
    const KlShape& s, const float* q, int64_t bt, const int64_t* pos, const float* keys, float* A) {
    namespace wmma = nvcuda::wmma;
    const TcDots at(s);
    unsigned char* tc = dynamic_shared() + scalar_smem(s, sizeof(float));
    auto* Qb = reinterpret_cast<__nv_bfloat16*>(tc);            // [hi][di]
    auto* Kb = reinterpret_cast<__nv_bfloat16*>(tc + at.keys);  // [kChunk][di]
    auto* D = reinterpret_cast<float*>(tc + at.dots);           // [hi][kChunk]
    const int64_t nt = blockDim.x, ld = s.DI + 1;
    stage_rows_bf16(q + bt * s.HI * s.DI, s.DI, s.HI, at.hi, s.DI, at.di, Qb);
    stage_rows_bf16(keys, ld, kChunk, kChunk, s.DI, at.di, Kb);  // zeros outside the support already
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fq;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fk;  // keys as columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    const int64_t tiles = at.hi / 16 * (kChunk / 16);
    for (int64_t tile = threadIdx.x / 32; tile < tiles; tile += nt / 32) {
        const int64_t j0 = tile / (kChunk / 16) * 16, i0 = tile % (kChunk / 16) * 16;
        wmma::fill_fragment(acc, 0.0f);
        for (int64_t d0 = 0; d0 < at.di; d0 += 16) {
            wmma::load_matrix_sync(fq, Qb + j0 * at.di + d0, unsigned(at.di));
            wmma::load_matrix_sync(fk, Kb + i0 * at.di + d0, unsigned(at.di));
            wmma::mma_sync(acc, fq, fk, acc);
        }
        wmma::store_matrix_sync(D + j0 * kChunk + i0, acc, unsigned(kChunk), wmma::mem_row_major);
    }
    __syncthreads();
    for (int64_t x = threadIdx.x; x < kChunk * s.HI; x += nt) {
        const int64_t i = x % kChunk, j = x / kChunk;
        A[i * s.HI + j] = pos[i] >= 0 ? D[j * kChunk + i] : 0.0f;
    }
    __syncthreads();
}

// The support chunk [x0, x0 + kChunk) of query bt into shared memory: positions (−1 outside the support), the keys
// [kChunk][DI + 1] and the head dots a_ij = q_j·k_i as A [kChunk][HI]. The chunk's keys are gathered once, then a
// thread per (entry, head) takes each dot (a warp: one head, consecutive entries), or at s.bf16 the tensor cores do.
// Every thread takes part.
template <class T>
__device__ void chunk_dots(const KlShape& s,
                           const T* q,
                           const T* k,
                           const int32_t* idx,
                           int64_t bt,
                           int64_t x0,
                           int64_t hi,
                           int64_t* pos,
                           T* A,
                           T* keys) {
    const int64_t b = bt / s.T, ld = s.DI + 1, nt = blockDim.x;
    for (int64_t i = threadIdx.x; i < kChunk; i += nt) {
        int64_t pi = 0;
        pos[i] = x0 + i < hi ? support_pos(s, idx, bt, x0 + i, pi) : -1;
    }
    __syncthreads();
    for (int64_t x = threadIdx.x; x < kChunk * s.DI; x += nt) {
        const int64_t i = x / s.DI, d = x % s.DI;
        keys[i * ld + d] = pos[i] >= 0 ? k[(b * s.T + pos[i]) * s.DI + d] : T(0);
    }
    __syncthreads();
    if constexpr (std::is_same_v<T, float>) {
        if (s.bf16) return chunk_dots_tc(s, q, bt, pos, keys, A);
    }
    for (int64_t x = threadIdx.x; x < kChunk * s.HI; x += nt) {
        const int64_t i = x % kChunk, j = x / kChunk;
        const T* qj = q + (bt * s.HI + j) * s.DI;
        T acc = 0;
        if (pos[i] >= 0)
            for (int64_t d = 0; d < s.DI; ++d) acc += qj[d] * keys[i * ld + d];
        A[i * s.HI + j] = acc;
    }
    __syncthreads();
}

// I = Σ_j w_j·relu(a_j) of one entry from its head dots a (heads in order, in double).
template <class T>
__device__ inline double score(const KlShape& s, const T* w, int64_t bt, const T* a) {
    double I = 0;
    for (int64_t j = 0; j < s.HI; ++j) I += double(w[bt * s.HI + j]) * (a[j] > T(0) ? double(a[j]) : 0.0);
    return I;
}

// chunk_dots, then a thread per entry turns its dots into dI·w_j·[a > 0] as DA [kChunk][HI] and dI·relu(a) in A
// (0 outside the support). Every thread takes part.
template <class T>
__device__ void chunk_grads(const KlShape& s,
                            const T* q,
                            const T* k,
                            const T* w,
                            const T* p,
                            const int32_t* idx,
                            const KlRows& rows,
                            double g,
                            int64_t bt,
                            int64_t x0,
                            int64_t hi,
                            int64_t* pos,
                            T* A,
                            T* DA,
                            T* keys) {
    chunk_dots<T>(s, q, k, idx, bt, x0, hi, pos, A, keys);
    for (int64_t i = threadIdx.x; i < kChunk; i += blockDim.x) {
        if (pos[i] < 0) {
            for (int64_t j = 0; j < s.HI; ++j) DA[i * s.HI + j] = A[i * s.HI + j] = T(0);
            continue;
        }
        int64_t pi = 0;
        support_pos(s, idx, bt, x0 + i, pi);
        const double dI = g * (exp(score<T>(s, w, bt, A + i * s.HI) - rows.lse[bt]) * rows.psum[bt] - double(p[pi]));
        for (int64_t j = 0; j < s.HI; ++j) {
            const T a = A[i * s.HI + j];
            DA[i * s.HI + j] = a > T(0) ? T(dI * double(w[bt * s.HI + j])) : T(0);
            A[i * s.HI + j] = T(dI * (a > T(0) ? double(a) : 0.0));  // now dI·relu(a): dw's term
        }
    }
    __syncthreads();
}

// The tensor-core gradient products (s.bf16, f32 data), after chunk_grads at s.bf16 (whose dots left q[t]'s heads and
// the chunk's keys as bf16 in the tensor-core part): DA rounded to bf16, then by WMMA with f32 sums, a warp per
// 16 × 16 output tile in turn, either dQ [HI'][DI'] += DAᵀ·keys (the running sum in shared memory) or
// V [kChunk][DI'] = DA·q[t] (dk's rows of the chunk). Every thread takes part.
__device__ void chunk_grad_products_tc(const KlShape& s, const float* DA, bool dq) {
    namespace wmma = nvcuda::wmma;
    const TcDots at(s);
    unsigned char* tc = dynamic_shared() + scalar_smem(s, sizeof(float));
    const auto* Qb = reinterpret_cast<const __nv_bfloat16*>(tc);            // [hi][di]
    const auto* Kb = reinterpret_cast<const __nv_bfloat16*>(tc + at.keys);  // [kChunk][di]
    auto* Gb = reinterpret_cast<__nv_bfloat16*>(tc + at.grads);             // [kChunk][hi]
    auto* Out = reinterpret_cast<float*>(tc + at.out);
    const int64_t nt = blockDim.x;
    stage_rows_bf16(DA, s.HI, kChunk, kChunk, s.HI, at.hi, Gb);
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    const int64_t rows = dq ? at.hi : kChunk, tiles = rows / 16 * (at.di / 16);
    for (int64_t tile = threadIdx.x / 32; tile < tiles; tile += nt / 32) {
        const int64_t r0 = tile / (at.di / 16) * 16, d0 = tile % (at.di / 16) * 16;
        float* o = Out + r0 * at.di + d0;
        if (dq) {  // DAᵀ: DA's columns as the rows of A (col-major), summed over the chunk's entries
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa;
            wmma::load_matrix_sync(acc, o, unsigned(at.di), wmma::mem_row_major);
            for (int64_t i0 = 0; i0 < kChunk; i0 += 16) {
                wmma::load_matrix_sync(fa, Gb + i0 * at.hi + r0, unsigned(at.hi));
                wmma::load_matrix_sync(fb, Kb + i0 * at.di + d0, unsigned(at.di));
                wmma::mma_sync(acc, fa, fb, acc);
            }
        } else {  // DA's rows by q[t]'s heads
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fill_fragment(acc, 0.0f);
            for (int64_t j0 = 0; j0 < at.hi; j0 += 16) {
                wmma::load_matrix_sync(fa, Gb + r0 * at.hi + j0, unsigned(at.hi));
                wmma::load_matrix_sync(fb, Qb + j0 * at.di + d0, unsigned(at.di));
                wmma::mma_sync(acc, fa, fb, acc);
            }
        }
        wmma::store_matrix_sync(o, acc, unsigned(at.di), wmma::mem_row_major);
    }
    __syncthreads();
}

// Per query: kl, whether it has support, lse and Σp of its support, in one pass over the support (the scores of
// kThreads entries at a time, by chunk_dots; thread tid then takes entry x0 + tid): each thread keeps an online
// softmax (its max and the sum of exp(I − max)) and the sums Σp, Σ_{p>0} p·log p and Σ_{p>0} p·I; the
// block combines them in a fixed order, and KL = Σ p·log p − Σ p·I + (Σ_{p>0} p)·lse.
template <class T>
__global__ void row_kernel(
    KlShape s, const int64_t* cu, const T* q, const T* k, const T* w, const T* p, const int32_t* idx, KlRows rows) {
    __shared__ double red[kThreads / 32];
    __shared__ double scores[kThreads];  // I of entries x0 + tid
    int64_t* pos = reinterpret_cast<int64_t*>(dynamic_shared());
    T* A = reinterpret_cast<T*>(pos + kChunk);
    T* keys = A + 2 * kChunk * s.HI;  // (the gradient kernels' layout; DA unused)
    const int64_t bt = blockIdx.x, tid = threadIdx.x;
    int64_t lo, hi;
    support_slots(s, cu, bt, lo, hi);
    double m = -INFINITY, z = 0, psum = 0, ppos = 0, plogp = 0, pI = 0;
    for (int64_t x0 = lo; x0 < hi; x0 += kThreads) {
        for (int64_t c = 0; c < kThreads; c += kChunk) {  // the scores of kThreads entries, kChunk at a time
            __syncthreads();                              // the previous chunk is consumed
            chunk_dots<T>(s, q, k, idx, bt, x0 + c, hi, pos, A, keys);
            if (tid < kChunk && pos[tid] >= 0) scores[c + tid] = score<T>(s, w, bt, A + tid * s.HI);
        }
        __syncthreads();
        const int64_t x = x0 + tid;
        int64_t pi;
        if (x >= hi || support_pos(s, idx, bt, x, pi) < 0) continue;
        const double I = scores[tid], pv = double(p[pi]);
        if (I > m) {
            z = z * exp(m - I) + 1.0;  // exp(−inf) = 0 for the first entry
            m = I;
        } else {
            z += exp(I - m);
        }
        psum += pv;
        if (pv > 0) {
            ppos += pv;
            plogp += pv * log(pv);
            pI += pv * I;
        }
    }
    const double M = block_max(m, red);
    if (M == -INFINITY) {  // no support (uniform over the block)
        if (tid == 0) {
            rows.kl[bt] = rows.lse[bt] = rows.psum[bt] = 0;
            rows.has[bt] = 0;
        }
        return;
    }
    const double Z = block_sum(m == -INFINITY ? 0.0 : z * exp(m - M), red);
    psum = block_sum(psum, red);
    ppos = block_sum(ppos, red);
    plogp = block_sum(plogp, red);
    pI = block_sum(pI, red);
    const double lse = M + log(Z);
    if (tid == 0) {
        rows.kl[bt] = plogp - pI + ppos * lse;
        rows.lse[bt] = lse;
        rows.psum[bt] = psum;
        rows.has[bt] = 1;
    }
}

// dw[t, j] += Σ_i dI_i·relu(a_ij), dq[t, j] += Σ_i da_ij·k_i, entries in order (a thread per output element).
template <class T>
__global__ void dqw_kernel(KlShape s,
                           const int64_t* cu,
                           const T* q,
                           const T* k,
                           const T* w,
                           const T* p,
                           const int32_t* idx,
                           KlRows rows,
                           double g,
                           T* dq,
                           T* dw) {
    int64_t* pos = reinterpret_cast<int64_t*>(dynamic_shared());
    T* A = reinterpret_cast<T*>(pos + kChunk);
    T* DA = A + kChunk * s.HI;
    T* keys = DA + kChunk * s.HI;
    const int64_t bt = blockIdx.x, tid = threadIdx.x;
    if (!rows.has[bt]) return;  // uniform over the block
    int64_t lo, hi;
    support_slots(s, cu, bt, lo, hi);
    bool tc = false;  // dq's products on tensor cores, the running sum in shared memory
    float* DQ = nullptr;
    if constexpr (std::is_same_v<T, float>) {
        tc = s.bf16;
        const TcDots at(s);
        DQ = reinterpret_cast<float*>(dynamic_shared() + scalar_smem(s, sizeof(float)) + at.out);
        for (int64_t x = tid; tc && x < at.hi * at.di; x += blockDim.x) DQ[x] = 0.0f;
    }
    for (int64_t x0 = lo; x0 < hi; x0 += kChunk) {
        __syncthreads();  // the previous chunk is consumed
        chunk_grads<T>(s, q, k, w, p, idx, rows, g, bt, x0, hi, pos, A, DA, keys);
        if constexpr (std::is_same_v<T, float>)
            if (tc) chunk_grad_products_tc(s, DA, true);
        for (int64_t o = tid; !tc && o < s.HI * s.DI; o += blockDim.x) {
            const int64_t j = o / s.DI, d = o % s.DI;
            T acc = dq[bt * s.HI * s.DI + o];
            for (int i = 0; i < kChunk; ++i)
                if (pos[i] >= 0) acc += DA[i * s.HI + j] * keys[i * (s.DI + 1) + d];
            dq[bt * s.HI * s.DI + o] = acc;
        }
        for (int64_t j = tid; j < s.HI; j += blockDim.x) {
            T acc = dw[bt * s.HI + j];
            for (int i = 0; i < kChunk; ++i) acc += A[i * s.HI + j];
            dw[bt * s.HI + j] = acc;
        }
    }
    if (!tc) return;
    const int64_t di = round16(s.DI);
    for (int64_t o = tid; o < s.HI * s.DI; o += blockDim.x) dq[bt * s.HI * s.DI + o] += T(DQ[o / s.DI * di + o % s.DI]);
}

// Slab sl of batch row b: acc[sl][b·T + s_i] += Σ_j da_ij·q[t, j] over its queries ascending and their support in
// order; blockIdx.z picks kThreads dims.
template <class T>
__global__ void dk_kernel(KlShape s,
                          int64_t slabs,
                          const int64_t* cu,
                          const T* q,
                          const T* k,
                          const T* w,
                          const T* p,
                          const int32_t* idx,
                          KlRows rows,
                          double g,
                          T* acc) {
    int64_t* pos = reinterpret_cast<int64_t*>(dynamic_shared());
    T* A = reinterpret_cast<T*>(pos + kChunk);
    T* DA = A + kChunk * s.HI;
    T* keys = DA + kChunk * s.HI;
    const int64_t b = blockIdx.x, sl = blockIdx.y, d = blockIdx.z * int64_t(blockDim.x) + threadIdx.x;
    T* slab = acc + (sl * s.B * s.T + b * s.T) * s.DI;
    for (int64_t t = s.T * sl / slabs; t < s.T * (sl + 1) / slabs; ++t) {
        const int64_t bt = b * s.T + t;
        if (!rows.has[bt]) continue;  // uniform over the block
        int64_t lo, hi;
        support_slots(s, cu, bt, lo, hi);
        for (int64_t x0 = lo; x0 < hi; x0 += kChunk) {
            __syncthreads();
            chunk_grads<T>(s, q, k, w, p, idx, rows, g, bt, x0, hi, pos, A, DA, keys);
            const T* V = nullptr;  // the chunk's rows DA·q[t] on tensor cores, [kChunk][DI']
            if constexpr (std::is_same_v<T, float>)
                if (s.bf16) {
                    chunk_grad_products_tc(s, DA, false);
                    V = reinterpret_cast<const float*>(dynamic_shared() + scalar_smem(s, sizeof(float)) +
                                                       TcDots(s).out);
                }
            if (d >= s.DI) continue;
            for (int i = 0; i < kChunk; ++i) {
                if (pos[i] < 0) continue;
                T v = 0;
                if (V) {
                    v = V[i * round16(s.DI) + d];
                } else {
                    for (int64_t j = 0; j < s.HI; ++j) v += DA[i * s.HI + j] * q[(bt * s.HI + j) * s.DI + d];
                }
                slab[pos[i] * s.DI + d] += v;
            }
        }
    }
}
}  // namespace

// the chunk's support positions, then A and DA [kChunk][HI] and the chunk's key rows [kChunk][DI + 1] (T); at s.bf16
// (f32) the tensor-core dots' part after them
size_t indexer_kl_smem(KlShape s, size_t elem) {
    return size_t(scalar_smem(s, elem)) + (s.bf16 && elem == sizeof(float) ? size_t(TcDots(s).bytes) : 0);
}

template <class T>
cudaError_t launch_indexer_kl_rows(KlShape s,
                                   const int64_t* cu,
                                   const T* q,
                                   const T* k,
                                   const T* w,
                                   const T* p,
                                   const int32_t* idx,
                                   KlRows rows,
                                   cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    const size_t smem = indexer_kl_smem(s, sizeof(T));
    const cudaError_t e = cudaFuncSetAttribute(row_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    launch_kernel(row_kernel<T>, unsigned(s.B * s.T), kThreads, smem, stream, s, cu, q, k, w, p, idx, rows);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_indexer_kl_backward(KlShape s,
                                       int64_t slabs,
                                       const int64_t* cu,
                                       const T* q,
                                       const T* k,
                                       const T* w,
                                       const T* p,
                                       const int32_t* idx,
                                       KlRows rows,
                                       double g,
                                       T* acc,
                                       T* dq,
                                       T* dk,
                                       T* dw,
                                       cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    const size_t smem = indexer_kl_smem(s, sizeof(T));
    for (const void* f : {(const void*)dqw_kernel<T>, (const void*)dk_kernel<T>}) {
        const cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (e != cudaSuccess) return e;
    }
    launch_kernel(dqw_kernel<T>, unsigned(s.B * s.T), kThreads, smem, stream, s, cu, q, k, w, p, idx, rows, g, dq, dw);
    cudaError_t err = cudaMemsetAsync(acc, 0, sizeof(T) * size_t(slabs * s.B * s.T * s.DI), stream);
    if (err != cudaSuccess) return err;
    const dim3 grid(unsigned(s.B), unsigned(slabs), unsigned((s.DI + kThreads - 1) / kThreads));
    launch_kernel(dk_kernel<T>, grid, kThreads, smem, stream, s, slabs, cu, q, k, w, p, idx, rows, g, acc);
    const int64_t n = s.B * s.T * s.DI;
    launch_kernel(slab_sum_kernel<T>, grid_for(n), kBlock, 0, stream, n, slabs, acc, dk);
    return cudaGetLastError();
}

#define TESSERA_KL(T)                                                                                                  \
    template cudaError_t launch_indexer_kl_rows<T>(KlShape, const int64_t*, const T*, const T*, const T*, const T*,    \
                                                   const int32_t*, KlRows, cudaStream_t);                              \
    template cudaError_t launch_indexer_kl_backward<T>(KlShape, int64_t, const int64_t*, const T*, const T*, const T*, \
                                                       const T*, const int32_t*, KlRows, double, T*, T*, T*, T*,       \
                                                       cudaStream_t);
TESSERA_KL(float)
TESSERA_KL(double)
#undef TESSERA_KL

}  // namespace tessera::ops::cuda
