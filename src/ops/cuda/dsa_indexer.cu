// DSA's lightning indexer on CUDA (ops/dsa.h): I[t, s] = Σ_j w[t, j]·relu(q[t, j]·k[s]) for the candidates s of t
// (s <= t within t's sequence) and the top-k under dsa_ranks_before's total order (higher I first, ties to the
// larger s), written in ascending s and padded with −1. One block per query. Two ways to score a round of candidates:
// - exact (f32, f64): a thread per candidate, heads and dims in order, so I is a pure function of (t, s);
// - bf16 on tensor cores (f32 at train.precision = bf16, as the GEMMs then compute; ops/gemm.h): q and k rounded to
//   bf16, q[t] as a [heads × dims] tile in shared memory times a round's 256 keys by WMMA (a warp per 32 keys,
//   products exact, f32 sums), the logits staged in shared memory, then a thread per candidate sums the heads in order.
// The valid scores join a running candidate list in shared memory by a fixed-order block scan; when the list could
// overflow, a bitonic sort under the total order keeps the best topk, and from then on a candidate that ranks behind
// the list's topk-th never joins (it can no longer be selected, so the selection is the same; the sorts become rare).
// A total order makes the result independent of the order of the work.
#include <climits>
#include <cmath>
#include <type_traits>

#include <cuda_bf16.h>
#include <mma.h>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"
#include "ops/cuda/topk.cuh"

namespace tessera::ops::cuda {

namespace {
constexpr int kThreads = 256;
constexpr int64_t kTcRound = 256;  // the tensor-core kernel's candidates per round: 32 per warp
static_assert(kTcRound == kThreads, "a thread per candidate of a round");

// The block's running list of candidates (scores cs, positions cp; P entries in shared memory). Every thread holds the
// same copy of the counts; every member is called by the whole block.
template <class T>
struct RunningTopk {
    T* cs;
    int32_t* cp;
    int* warp_count;  // [kThreads / 32]
    int64_t P, topk;
    int64_t n = 0;      // entries in the list
    bool full = false;  // the list holds topk entries, the worst of them (bar_s, bar_p)
    T bar_s = 0;
    int32_t bar_p = -1;

    __device__ void clear() {
        for (int64_t i = threadIdx.x; i < P; i += blockDim.x) {
            cs[i] = T(-INFINITY);
            cp[i] = -1;
        }
    }

    // This round's candidates, one (ok, score, c) per thread, join in candidate order: a warp ballot, then the warps
    // in order. Ends at a barrier.
    __device__ void add(bool ok, T score, int64_t c) {
        if (n + int64_t(blockDim.x) > P) {  // room for this round: keep the best topk
            n = keep_best(cs, cp, P, n, topk);
            if (n == topk) {
                full = true;
                bar_s = cs[n - 1];
                bar_p = cp[n - 1];
            }
        }
        ok = ok && (!full || ranks_before(score, int32_t(c), bar_s, bar_p));
        const unsigned mask = __ballot_sync(0xffffffffu, ok);
        const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
        if (lane == 0) warp_count[warp] = __popc(mask);
        __syncthreads();
        int64_t at = n, total = 0;
        for (int i = 0; i < int(blockDim.x / 32); ++i) {
            if (i < warp) at += warp_count[i];
            total += warp_count[i];
        }
        if (ok) {
            at += __popc(mask & ((1u << lane) - 1u));
            cs[at] = score;
            cp[at] = int32_t(c);
        }
        n += total;
        __syncthreads();
    }

    // The selection of query bt: the best topk in ascending position, then −1 (scores 0).
    __device__ void write(int64_t bt, int32_t* indices, T* scores) {
        const int64_t m = keep_best(cs, cp, P, n, topk);
        for (int64_t i = m + threadIdx.x; i < P; i += blockDim.x) cp[i] = INT_MAX;  // the selected first by position
        __syncthreads();
        bitonic(cs, cp, P, false);
        for (int64_t i = threadIdx.x; i < topk; i += blockDim.x) {
            const bool valid = i < m;
            indices[bt * topk + i] = valid ? cp[i] : -1;
            scores[bt * topk + i] = valid ? cs[i] : T(0);
        }
    }
};

// The first position of t's sequence
__device__ inline int64_t sequence_start(const int64_t* cu, int64_t segments, int64_t t) {
    int64_t lo = 0;
    for (int64_t i = 0; cu && i < segments; ++i)
        if (cu[i] <= t) lo = cu[i];
    return lo;
}

template <class T>
__device__ inline bool usable(T score) {
    return !isnan(score) && score != T(-INFINITY);
}

template <class T>
__global__ void indexer_kernel(
    IndexerShape s, const int64_t* cu, const T* q, const T* k, const T* w, int32_t* indices, T* scores) {
    unsigned char* smem_raw = dynamic_shared();
    T* qs = reinterpret_cast<T*>(smem_raw);              // [HI, DI]
    T* ws = qs + s.HI * s.DI;                            // [HI]
    T* cs = ws + s.HI;                                   // [P] candidate scores
    int32_t* cp = reinterpret_cast<int32_t*>(cs + s.P);  // [P] candidate positions
    __shared__ int warp_count[kThreads / 32];
    const int64_t bt = blockIdx.x, b = bt / s.T, t = bt % s.T, tid = threadIdx.x, nt = blockDim.x;
    const int64_t lo = sequence_start(cu, s.segments, t);
    for (int64_t i = tid; i < s.HI * s.DI; i += nt) qs[i] = q[bt * s.HI * s.DI + i];
    for (int64_t i = tid; i < s.HI; i += nt) ws[i] = w[bt * s.HI + i];
    RunningTopk<T> list{cs, cp, warp_count, s.P, s.topk};
    list.clear();
    __syncthreads();
    for (int64_t s0 = lo; s0 <= t; s0 += nt) {
        const int64_t c = s0 + tid;
        T score = 0;
        bool ok = c <= t;
        if (ok) {
            const T* kr = k + (b * s.T + c) * s.DI;
            for (int64_t j = 0; j < s.HI; ++j) {
                T a = 0;
                for (int64_t d = 0; d < s.DI; ++d) a += qs[j * s.DI + d] * kr[d];
                score += ws[j] * (a > T(0) ? a : T(0));
            }
            ok = usable(score);
        }
        list.add(ok, score, c);
    }
    list.write(bt, indices, scores);
}

// k [rows, DI] f32 as bf16 [rows + kTcRound, DIp], zeros past DI and past the last row (a round's keys are read
// whole).
__global__ void bf16_keys_kernel(const float* k, int64_t rows, int64_t DI, int64_t DIp, __nv_bfloat16* kb) {
    const int64_t n = (rows + kTcRound) * DIp;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / DIp, d = i % DIp;
        kb[i] = __float2bfloat16(r < rows && d < DI ? k[r * DI + d] : 0.0f);
    }
}

// The tensor-core scoring (f32 tensors, bf16 operands). Shared memory: q[t] as bf16 [HIp, DIp] (zero-padded to whole
// 16s), the round's logits [HIp, kTcRound] f32, w[t] [HIp], then the list.
__global__ void indexer_tc_kernel(IndexerShape s,
                                  const int64_t* cu,
                                  const float* q,
                                  const __nv_bfloat16* kb,
                                  const float* w,
                                  int32_t* indices,
                                  float* scores) {
    namespace wmma = nvcuda::wmma;
    const int64_t HIp = round16(s.HI), DIp = round16(s.DI);
    __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(dynamic_shared());
    float* logits = reinterpret_cast<float*>(qs + HIp * DIp);
    float* ws = logits + HIp * kTcRound;
    float* cs = ws + HIp;
    int32_t* cp = reinterpret_cast<int32_t*>(cs + s.P);
    __shared__ int warp_count[kThreads / 32];
    const int64_t bt = blockIdx.x, b = bt / s.T, t = bt % s.T, tid = threadIdx.x, nt = blockDim.x;
    const int64_t lo = sequence_start(cu, s.segments, t);
    stage_rows_bf16(q + bt * s.HI * s.DI, s.DI, s.HI, HIp, s.DI, DIp, qs);
    for (int64_t i = tid; i < HIp; i += nt) ws[i] = i < s.HI ? w[bt * s.HI + i] : 0.0f;
    RunningTopk<float> list{cs, cp, warp_count, s.P, s.topk};
    list.clear();
    __syncthreads();
    const int64_t warp = tid / 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> qf;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kf;  // keys as columns
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    for (int64_t s0 = lo; s0 <= t; s0 += kTcRound) {
        for (int64_t half = 0; half < 2; ++half) {  // the warp's two tiles of 16 keys
            const int64_t col = warp * 32 + half * 16;
            const __nv_bfloat16* keys = kb + (b * s.T + s0 + col) * DIp;
            for (int64_t r = 0; r < HIp; r += 16) {
                wmma::fill_fragment(acc, 0.0f);
                for (int64_t d0 = 0; d0 < DIp; d0 += 16) {
                    wmma::load_matrix_sync(qf, qs + r * DIp + d0, unsigned(DIp));
                    wmma::load_matrix_sync(kf, keys + d0, unsigned(DIp));
                    wmma::mma_sync(acc, qf, kf, acc);
                }
                wmma::store_matrix_sync(logits + r * kTcRound + col, acc, unsigned(kTcRound), wmma::mem_row_major);
            }
        }
        __syncthreads();
        const int64_t c = s0 + tid;
        float score = 0;
        bool ok = c <= t;
        if (ok) {
            for (int64_t j = 0; j < s.HI; ++j) {
                const float a = logits[j * kTcRound + tid];
                score += ws[j] * (a > 0.0f ? a : 0.0f);
            }
            ok = usable(score);
        }
        list.add(ok, score, c);  // ends at a barrier: the logits may be overwritten
    }
    list.write(bt, indices, scores);
}
}  // namespace

int64_t indexer_list_size(int64_t topk) {
    int64_t P = 32;
    while (P < 2 * topk || P < topk + kThreads) P <<= 1;
    return P;
}

namespace {
// The dense warm-up's selection: a block-row per token (y), x-threads over its K slots
__global__ void all_candidates_kernel(
    int32_t* out, int64_t B, int64_t T, int64_t K, const int64_t* cu, int64_t segments) {
    for (int64_t n = blockIdx.y; n < B * T; n += gridDim.y) {
        const int64_t t = n % T, lo = sequence_start(cu, segments, t);
        for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < K; k += int64_t(gridDim.x) * blockDim.x)
            out[n * K + k] = lo + k <= t ? int32_t(lo + k) : -1;
    }
}
}  // namespace

cudaError_t launch_dsa_all_candidates(
    int32_t* indices, int64_t B, int64_t T, int64_t K, const int64_t* cu, int64_t segments, cudaStream_t stream) {
    if (B * T == 0 || K == 0) return cudaSuccess;
    launch_kernel(all_candidates_kernel, rows_grid(B * T, K), kBlock, 0, stream, indices, B, T, K, cu, segments);
    return cudaGetLastError();
}

size_t indexer_smem(int64_t HI, int64_t DI, int64_t topk, size_t elem, bool tensor_cores) {
    const int64_t P = indexer_list_size(topk);
    if (tensor_cores) {
        const int64_t HIp = round16(HI), DIp = round16(DI);
        return size_t(HIp * DIp) * 2 + size_t(HIp * kTcRound + HIp + P) * sizeof(float) + size_t(P) * sizeof(int32_t);
    }
    return size_t(HI * DI + HI + P) * elem + size_t(P) * sizeof(int32_t);
}

size_t indexer_bf16_keys_bytes(int64_t B, int64_t T, int64_t DI) {
    return size_t((B * T + kTcRound) * round16(DI)) * 2;
}

template <class T>
cudaError_t launch_dsa_indexer(IndexerShape s,
                               const int64_t* cu,
                               const T* q,
                               const T* k,
                               const T* w,
                               void* keys,
                               int32_t* indices,
                               T* scores,
                               cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    if constexpr (std::is_same_v<T, float>) {
        if (keys) {  // on tensor cores: the keys rounded to bf16 once, then the blocks
            auto* kb = static_cast<__nv_bfloat16*>(keys);
            const int64_t DIp = round16(s.DI);
            launch_kernel(bf16_keys_kernel, grid_for((s.B * s.T + kTcRound) * DIp), kBlock, 0, stream, k, s.B * s.T,
                          s.DI, DIp, kb);
            const size_t smem = indexer_smem(s.HI, s.DI, s.topk, sizeof(float), true);
            cudaError_t err =
                cudaFuncSetAttribute(indexer_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
            if (err != cudaSuccess) return err;
            launch_kernel(indexer_tc_kernel, unsigned(s.B * s.T), kThreads, smem, stream, s, cu, q,
                          static_cast<const __nv_bfloat16*>(kb), w, indices, scores);
            return cudaGetLastError();
        }
    }
    const size_t smem = indexer_smem(s.HI, s.DI, s.topk, sizeof(T), false);
    cudaError_t err = cudaFuncSetAttribute(indexer_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    launch_kernel(indexer_kernel<T>, unsigned(s.B * s.T), kThreads, smem, stream, s, cu, q, k, w, indices, scores);
    return cudaGetLastError();
}

template cudaError_t launch_dsa_indexer<float>(
    IndexerShape, const int64_t*, const float*, const float*, const float*, void*, int32_t*, float*, cudaStream_t);
template cudaError_t launch_dsa_indexer<double>(
    IndexerShape, const int64_t*, const double*, const double*, const double*, void*, int32_t*, double*, cudaStream_t);

}  // namespace tessera::ops::cuda
