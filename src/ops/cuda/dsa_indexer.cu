// DSA's lightning indexer on CUDA (ops/dsa.h): I[t, s] = Σ_j w[t, j]·relu(q[t, j]·k[s]) for the candidates s of t
// (s <= t within t's sequence) and the top-k under dsa_ranks_before's total order (higher I first, ties to the
// larger s), written in ascending s and padded with −1. One block per query: a thread per candidate computes its
// score (heads and dims in order, so I is a pure function of (t, s)); the valid scores are appended to a running
// candidate list in shared memory by a fixed-order block scan; when the list could overflow, a bitonic sort under
// the total order keeps the best topk. A total order makes the result independent of the order of the work.
#include <climits>
#include <cmath>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"
#include "ops/cuda/topk.cuh"

namespace tessera::ops::cuda {

namespace {
constexpr int kThreads = 256;

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
    int64_t lo = 0;  // the first position of t's sequence
    if (cu) {
        for (int64_t i = 0; i < s.segments; ++i)
            if (cu[i] <= t) lo = cu[i];
    }
    for (int64_t i = tid; i < s.HI * s.DI; i += nt) qs[i] = q[bt * s.HI * s.DI + i];
    for (int64_t i = tid; i < s.HI; i += nt) ws[i] = w[bt * s.HI + i];
    for (int64_t i = tid; i < s.P; i += nt) {
        cs[i] = T(-INFINITY);
        cp[i] = -1;
    }
    __syncthreads();
    int64_t n = 0;  // entries in the list (the same in every thread)
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
            ok = !isnan(score) && score != T(-INFINITY);
        }
        if (n + nt > s.P) n = keep_best(cs, cp, s.P, n, s.topk);  // room for this chunk
        // append the valid ones in candidate order: a warp ballot, then the warps in order
        const unsigned mask = __ballot_sync(0xffffffffu, ok);
        const int lane = tid % 32, warp = tid / 32;
        if (lane == 0) warp_count[warp] = __popc(mask);
        __syncthreads();
        int64_t at = n, total = 0;
        for (int i = 0; i < int(nt / 32); ++i) {
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
    const int64_t m = keep_best(cs, cp, s.P, n, s.topk);
    for (int64_t i = m + tid; i < s.P; i += nt) cp[i] = INT_MAX;  // the selected ones first when sorted by s
    __syncthreads();
    bitonic(cs, cp, s.P, false);
    for (int64_t i = tid; i < s.topk; i += nt) {
        const bool valid = i < m;
        indices[bt * s.topk + i] = valid ? cp[i] : -1;
        scores[bt * s.topk + i] = valid ? cs[i] : T(0);
    }
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
        const int64_t t = n % T;
        int64_t lo = 0;  // the first position of t's sequence
        for (int64_t i = 0; cu && i < segments; ++i)
            if (cu[i] <= t) lo = cu[i];
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

size_t indexer_smem(int64_t HI, int64_t DI, int64_t topk, size_t elem) {
    const int64_t P = indexer_list_size(topk);
    return size_t(HI * DI + HI + P) * elem + size_t(P) * sizeof(int32_t);
}

template <class T>
cudaError_t launch_dsa_indexer(IndexerShape s,
                               const int64_t* cu,
                               const T* q,
                               const T* k,
                               const T* w,
                               int32_t* indices,
                               T* scores,
                               cudaStream_t stream) {
    if (s.B * s.T == 0) return cudaSuccess;
    const size_t smem = indexer_smem(s.HI, s.DI, s.topk, sizeof(T));
    cudaError_t err = cudaFuncSetAttribute(indexer_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    launch_kernel(indexer_kernel<T>, unsigned(s.B * s.T), kThreads, smem, stream, s, cu, q, k, w, indices, scores);
    return cudaGetLastError();
}

template cudaError_t launch_dsa_indexer<float>(
    IndexerShape, const int64_t*, const float*, const float*, const float*, int32_t*, float*, cudaStream_t);
template cudaError_t launch_dsa_indexer<double>(
    IndexerShape, const int64_t*, const double*, const double*, const double*, int32_t*, double*, cudaStream_t);

}  // namespace tessera::ops::cuda
