// Device helpers of DSA's top-k selections (the indexer over a sequence, ops/cuda/dsa_indexer.cu, and over the
// decoding cache, ops/cuda/decode.cu): a bitonic sort of (score, position) pairs under the selection's total order
// (ops/dsa.h's dsa_ranks_before: a higher score first, ties to the larger position) or by position. The block's
// threads sort a list of P (a power of two) pairs in shared or global memory; a total order makes the result
// independent of the order of the work.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace tessera::ops::cuda {

template <class T>
__device__ inline bool ranks_before(T sa, int32_t a, T sb, int32_t b) {
    return sa > sb || (sa == sb && a > b);
}

// Sorts the P (a power of two) pairs of the block's list: by rank (best first) or by s ascending.
template <class T>
__device__ void bitonic(T* score, int32_t* pos, int64_t P, bool by_rank) {
    for (int64_t k = 2; k <= P; k <<= 1) {
        for (int64_t j = k >> 1; j > 0; j >>= 1) {
            for (int64_t i = threadIdx.x; i < P; i += blockDim.x) {
                const int64_t x = i ^ j;
                if (x <= i) continue;
                // "before(a, b)": a belongs first in the ascending sequence
                const bool x_first = by_rank ? ranks_before(score[x], pos[x], score[i], pos[i]) : pos[x] < pos[i];
                const bool i_first = by_rank ? ranks_before(score[i], pos[i], score[x], pos[x]) : pos[i] < pos[x];
                const bool ascending = (i & k) == 0;
                if (ascending ? x_first : i_first) {
                    const T ts = score[i];
                    score[i] = score[x];
                    score[x] = ts;
                    const int32_t tp = pos[i];
                    pos[i] = pos[x];
                    pos[x] = tp;
                }
            }
            __syncthreads();
        }
    }
}

// Keeps the best `keep` of the list's n entries at its front; the rest become sentinels that rank last.
template <class T>
__device__ int64_t keep_best(T* score, int32_t* pos, int64_t P, int64_t n, int64_t keep) {
    bitonic(score, pos, P, true);
    const int64_t m = n < keep ? n : keep;
    for (int64_t i = m + threadIdx.x; i < P; i += blockDim.x) {
        score[i] = T(-INFINITY);
        pos[i] = -1;
    }
    __syncthreads();
    return m;
}

}  // namespace tessera::ops::cuda
