// The host-side plan of the CUDA attention kernels (ops/cuda/attention.cu), plain C++ so that it is tested on any
// machine: which query (or key) tiles exist, and how many rows a block takes for a head dim and element size.
//
// A tile is `rows` consecutive positions of one sequence (a batch row, or a packed segment of cu_seqlens); tiles
// never cross a sequence boundary, so a block's masking is the causal mask within its sequence only. A block has
// one thread per row of its tile; the thread walks the other side (keys for a query tile, queries for a key tile)
// kAttnChunk at a time, the chunk's scores held in registers. Shared memory holds the tile's rows (padded to D + 1
// so that threads reading a column hit distinct banks), the row accumulators and one chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::ops {

struct AttnTile {
    int64_t b;      // batch row
    int64_t first;  // the sequence's first position within the row
    int64_t len;    // the sequence's length
    int64_t t0;     // the tile's first position within the sequence
};

// The tiles of `rows` positions covering every sequence of [B, T] (or, with `num_cu` > 0, the packed sequences of
// the offsets cu[0..num_cu), B = 1), sequence by sequence, in order. `out` is overwritten (its capacity reused).
// (Pointer and count, not a span: nvcc compiles this header as C++17.)
void attention_tiles(int64_t B, int64_t T, const int64_t* cu, size_t num_cu, int64_t rows, std::vector<AttnTile>& out);

constexpr int64_t kAttnChunk = 32;  // positions of the other side per step of the inner loop

enum class AttnKernel {
    forward,  // query tile: Q and O accumulators [rows, D + 1]; K, V chunk [kAttnChunk, D]
    dq,       // query tile: Q, dO and dQ accumulators; K, V chunk
    dkv,      // key tile: K, V, dK and dV accumulators; Q, dO chunk and its lse and Δ values
};

// Dynamic shared memory of one block of `kernel` with `rows` rows, head dim D, elements of `elem` bytes.
size_t attention_smem_bytes(AttnKernel kernel, int64_t rows, int64_t D, size_t elem);

// The rows per block for `kernel`: 64, or 32 when 64 does not fit in `smem_limit` bytes; 0 when neither does.
int64_t attention_block_rows(AttnKernel kernel, int64_t D, size_t elem, size_t smem_limit);

}  // namespace tessera::ops
