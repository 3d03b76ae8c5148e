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

#include "core/host_device.h"

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

// The tensor-core kernels (train.precision = bf16, f32 data): a block of `warps` warps, each owning 16 rows of the
// tile, walks the other side `chunk` positions per step. Operands are bf16 rows of D' + 8 values (D' = D padded to
// whole 16s; the 8 pad values keep WMMA's row loads off one bank), f32 tiles rows of width + 4. Per warp: the scores
// (and dO·V) [16][chunk] in f32, the probabilities (and dS) [16][chunk] in bf16, the accumulators [16][D'] in f32
// (O; dQ; dK and dV) — except dQ where D' ≤ 16·kAttnRegTiles, which the warps hold in WMMA accumulator fragments
// (`regs`; no rescaling, unlike O), so that two blocks of 4 warps fit an SM at D = 128. Offsets are bytes into the
// block's dynamic shared memory, each a multiple of 32 (WMMA's alignment): forward Q [rows], K and V [chunk]; dq Q
// and dO [rows], K and V [chunk]; dkv K and V [rows], Q and dO [chunk] with the chunk's lse and Δ; then the warps'
// parts.
constexpr int64_t kAttnRegTiles = 8;
struct AttnTcLayout {
    int64_t warps, chunk;  // rows per block 16 · warps; positions of the other side per step
    // D', then the row lengths (values) of the bf16 rows, the f32 scores, the bf16 probabilities, the f32 accumulators
    int64_t dp, ldb, lds, ldp, ldo;
    bool regs;                                          // dq: dQ in fragments, no `acc` region
    int64_t other, rowvals, warp, part;                 // block-wide offsets; the first warp's part, and a part's bytes
    int64_t scores, dscores, probs, dprobs, acc, acc2;  // offsets within a warp's part
    int64_t bytes;
    TESSERA_HOST_DEVICE AttnTcLayout(AttnKernel kernel, int64_t warps_, int64_t chunk_, int64_t D)
        : warps(warps_), chunk(chunk_) {
        const bool dkv = kernel == AttnKernel::dkv, fwd = kernel == AttnKernel::forward;
        dp = (D + 15) / 16 * 16, ldb = dp + 8, lds = chunk + 4, ldp = chunk + 8, ldo = dp + 4;
        regs = kernel == AttnKernel::dq && dp <= 16 * kAttnRegTiles;
        const int64_t row_bytes = ldb * 2;
        other = (fwd ? 1 : 2) * 16 * warps * row_bytes;
        rowvals = other + 2 * chunk * row_bytes;
        warp = rowvals + (dkv ? (2 * chunk * 4 + 31) / 32 * 32 : 0);
        scores = 0;
        dscores = scores + 16 * lds * 4;  // dO·V (dq, dkv)
        probs = dscores + (fwd ? 0 : 16 * lds * 4);
        dprobs = probs + (dkv ? 16 * ldp * 2 : 0);  // dS (dkv; dq keeps dS in `probs`)
        acc = dprobs + 16 * ldp * 2;
        acc2 = acc + (regs ? 0 : 16 * ldo * 4);  // dV (dkv)
        part = acc2 + (dkv ? 16 * ldo * 4 : 0);
        bytes = warp + warps * part;
    }
};

// The tensor-core layout for `kernel` at head dim D: the most rows (4 warps, then 2, then 1) and then the longest
// chunk (64, then 32, then 16) whose shared memory fits `smem_limit`; warps = 0 when none does.
AttnTcLayout attention_tc_layout(AttnKernel kernel, int64_t D, size_t smem_limit);

}  // namespace tessera::ops
