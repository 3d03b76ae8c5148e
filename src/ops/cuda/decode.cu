// Decoding's cached attention and indexer selection on CUDA (ops/decode.h; the oracle is ops/cpu/decode.cpp).
//   cached_attention: split over the entries as flash-decoding does, kSplitEntries per block of (sequence, head,
//     split): a thread per entry scores it (the dot in double, in d order), the split's max and sum by fixed-order
//     reductions, a thread per value dim sums its entries in order; a second kernel adds the splits in order, each
//     rescaled to the largest max.
//   cached_index_topk: tiles of positions, a block each: a thread per cached position scores it (f32, j then d
//     order, as the CPU), the indexer's bitonic sort (ops/cuda/topk.cuh) orders the tile under the selection's total
//     order; pairs of tiles' best are merged level by level; the best topk are then sorted by position.
// Every sum has one order: bitwise run to run.
#include <algorithm>
#include <climits>
#include <cmath>
#include <utility>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"
#include "ops/cuda/topk.cuh"

namespace tessera::ops::cuda {

namespace {
constexpr int kDecodeThreads = 128;

// One split of sequence b, head h: entries [split·kSplitEntries, …) of its n. part[(b·H + h)·splits + split] gets
// the split's max score m, Σ e^(z − m) and Σ e^(z − m)·v (DV values).
__global__ void cached_attention_split_kernel(CachedAttentionArgs a, double* z, double* part, int64_t splits) {
    __shared__ double red[kDecodeThreads / 32];
    const int64_t b = blockIdx.x, h = blockIdx.y, split = blockIdx.z, tid = threadIdx.x, nt = blockDim.x;
    const int64_t kvh = h / (a.H / a.HKV), n = a.rows ? a.n : a.len;
    const int64_t i0 = split * kSplitEntries, i1 = min(n, i0 + kSplitEntries);
    double* zb = z + (b * a.H + h) * n;
    const float* q = a.q + b * a.qs0 + h * a.qs1;
    auto position = [&](int64_t i) -> int64_t {
        const int64_t s = a.rows ? a.rows[b * n + i] : i;
        return s >= 0 && s < a.len ? s : -1;
    };
    double m = -INFINITY;
    for (int64_t i = i0 + tid; i < i1; i += nt) {
        const int64_t s = position(i);
        if (s < 0) continue;
        const float* k = a.keys + b * a.ks0 + s * a.ks1 + kvh * a.ks2;
        double dot = 0;
        for (int64_t d = 0; d < a.D; ++d) dot += double(q[d]) * double(k[d]);
        zb[i] = dot * a.scale;
        m = max(m, zb[i]);
    }
    m = block_max(m, red);
    double sum = 0;
    for (int64_t i = i0 + tid; i < i1; i += nt) {
        const int64_t s = position(i);
        const double e = s < 0 || m == -INFINITY ? 0.0 : exp(zb[i] - m);
        zb[i] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // (its barriers also order the writes of zb before the reads below)
    double* p = part + ((b * a.H + h) * splits + split) * (2 + a.DV);
    if (tid == 0) {
        p[0] = m;
        p[1] = sum;
    }
    for (int64_t e = tid; e < a.DV; e += nt) {
        double acc = 0;
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t s = position(i);
            if (s >= 0) acc += zb[i] * double(a.values[b * a.vs0 + s * a.vs1 + kvh * a.vs2 + e]);
        }
        p[2 + e] = acc;
    }
}

// o[b, h] from the splits in order: each rescaled to the largest max.
__global__ void cached_attention_combine_kernel(CachedAttentionArgs a, const double* part, int64_t splits) {
    const int64_t b = blockIdx.x, h = blockIdx.y;
    const double* p = part + (b * a.H + h) * splits * (2 + a.DV);
    double m = -INFINITY;
    for (int64_t sp = 0; sp < splits; ++sp) m = max(m, p[sp * (2 + a.DV)]);
    double total = 0;
    for (int64_t sp = 0; sp < splits; ++sp) {
        const double* ps = p + sp * (2 + a.DV);
        if (ps[1] > 0) total += ps[1] * exp(ps[0] - m);
    }
    float* o = a.o + b * a.os0 + h * a.os1;
    for (int64_t e = threadIdx.x; e < a.DV; e += blockDim.x) {
        double acc = 0;
        for (int64_t sp = 0; sp < splits; ++sp) {
            const double* ps = p + sp * (2 + a.DV);
            if (ps[1] > 0) acc += ps[2 + e] * exp(ps[0] - m);
        }
        o[e] = total > 0 ? float(acc / total) : 0.f;
    }
}

// The selection goes by tiles of positions, so a long cache spreads over blocks: each tile of `tile` = 2·keep
// positions (keep the power of two ≥ topk) is scored and sorted by rank in a block; then pairs of tiles' best keep
// are merged and sorted, level by level, until one list holds the best. Lists: [B, tiles, tile] scores and positions.
__global__ void index_tiles_kernel(CachedIndexArgs a, float* score, int32_t* pos) {
    const int64_t b = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    float* sc = score + (b * a.tiles + t) * a.tile;
    int32_t* ps = pos + (b * a.tiles + t) * a.tile;
    const float* q = a.q + b * a.qs0;
    const float* w = a.w + b * a.ws0;
    for (int64_t i = tid; i < a.tile; i += nt) {
        const int64_t s = t * a.tile + i;
        float I = -INFINITY;  // (positions past the cache rank last)
        if (s < a.len) {
            const float* k = a.keys + b * a.ks0 + s * a.ks1;
            I = 0;
            for (int64_t j = 0; j < a.HI; ++j) {
                float dot = 0;
                for (int64_t d = 0; d < a.DI; ++d) dot += q[j * a.qs1 + d] * k[d];
                I += w[j * a.ws1] * max(dot, 0.f);
            }
        }
        sc[i] = I;
        ps[i] = s < a.len ? int32_t(s) : -1;
    }
    __syncthreads();
    bitonic(sc, ps, a.tile, true);
}

// Tile j of the next level: the best halves of tiles 2j and 2j + 1 of this one (`tiles` of them), sorted by rank.
__global__ void index_merge_kernel(
    CachedIndexArgs a, int64_t tiles, const float* score, const int32_t* pos, float* next_score, int32_t* next_pos) {
    const int64_t b = blockIdx.x, j = blockIdx.y, keep = a.tile / 2;
    float* sc = next_score + (b * a.tiles + j) * a.tile;
    int32_t* ps = next_pos + (b * a.tiles + j) * a.tile;
    for (int64_t i = threadIdx.x; i < a.tile; i += blockDim.x) {
        const int64_t from = (b * a.tiles + 2 * j + i / keep) * a.tile + i % keep;
        sc[i] = score[from];
        ps[i] = pos[from];
    }
    __syncthreads();
    bitonic(sc, ps, a.tile, true);
}

// The best n = min(topk, len) of the last list, by position, into rows (padded with −1).
__global__ void index_rows_kernel(CachedIndexArgs a, float* score, int32_t* pos) {
    const int64_t b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x, n = min(a.topk, a.len);
    float* sc = score + b * a.tiles * a.tile;
    int32_t* ps = pos + b * a.tiles * a.tile;
    for (int64_t i = n + tid; i < a.tile; i += nt) ps[i] = INT_MAX;
    __syncthreads();
    bitonic(sc, ps, a.tile, false);
    for (int64_t i = tid; i < a.topk; i += nt) a.rows[b * a.topk + i] = i < n ? ps[i] : -1;
}
}  // namespace

int64_t cached_attention_splits(int64_t n) { return std::max<int64_t>(1, (n + kSplitEntries - 1) / kSplitEntries); }

cudaError_t launch_cached_attention(const CachedAttentionArgs& a, double* z, double* part, cudaStream_t stream) {
    if (a.B == 0 || a.H == 0) return cudaSuccess;
    const int64_t splits = cached_attention_splits(a.rows ? a.n : a.len);
    launch_kernel(cached_attention_split_kernel, dim3(unsigned(a.B), unsigned(a.H), unsigned(splits)), kDecodeThreads,
                  0, stream, a, z, part, splits);
    launch_kernel(cached_attention_combine_kernel, dim3(unsigned(a.B), unsigned(a.H)), kDecodeThreads, 0, stream, a,
                  static_cast<const double*>(part), splits);
    return cudaGetLastError();
}

cudaError_t launch_cached_index_topk(
    const CachedIndexArgs& a, float* score, int32_t* pos, float* score2, int32_t* pos2, cudaStream_t stream) {
    if (a.B == 0) return cudaSuccess;
    launch_kernel(index_tiles_kernel, dim3(unsigned(a.B), unsigned(a.tiles)), kBlock, 0, stream, a, score, pos);
    for (int64_t tiles = a.tiles; tiles > 1; tiles /= 2) {
        launch_kernel(index_merge_kernel, dim3(unsigned(a.B), unsigned(tiles / 2)), kBlock, 0, stream, a, tiles,
                      static_cast<const float*>(score), static_cast<const int32_t*>(pos), score2, pos2);
        std::swap(score, score2);
        std::swap(pos, pos2);
    }
    launch_kernel(index_rows_kernel, unsigned(a.B), kBlock, 0, stream, a, score, pos);
    return cudaGetLastError();
}

}  // namespace tessera::ops::cuda
