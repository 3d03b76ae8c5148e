// The CUDA attention kernels' host-side plan (ops/attention_tiles.h), on any machine: the tiles cover every
// position of every sequence exactly once without crossing a sequence boundary, and the rows per block fit the
// shared memory the device allows (H100/H200: 227 KiB per block when opted in).
#include <gtest/gtest.h>

#include <vector>

#include "ops/attention_tiles.h"

namespace tessera::ops {
namespace {

// Marks every (batch row, position) the tiles cover; each must be covered once and lie inside its sequence.
void expect_cover(int64_t B, int64_t T, const std::vector<int64_t>& cu, int64_t rows) {
    std::vector<AttnTile> tiles{{9, 9, 9, 9}};  // overwritten
    attention_tiles(B, T, cu.data(), cu.size(), rows, tiles);
    std::vector<int> seen(size_t(B * T), 0);
    for (const AttnTile& t : tiles) {
        ASSERT_TRUE(t.b >= 0 && t.b < B && t.t0 >= 0 && t.t0 < t.len && t.first + t.len <= T);
        if (!cu.empty()) {  // a sequence of cu_seqlens, whole
            bool found = false;
            for (size_t s = 0; s + 1 < cu.size(); ++s) found |= cu[s] == t.first && cu[s + 1] - cu[s] == t.len;
            EXPECT_TRUE(found) << "tile at " << t.first << " of length " << t.len;
        } else {
            EXPECT_EQ(t.first, 0);
            EXPECT_EQ(t.len, T);
        }
        for (int64_t i = t.t0; i < std::min(t.len, t.t0 + rows); ++i) ++seen[size_t(t.b * T + t.first + i)];
    }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "position " << i;
}

TEST(AttentionTiles, CoverEverySequenceOnce) {
    expect_cover(3, 70, {}, 64);
    expect_cover(1, 200, {0, 1, 70, 200}, 64);  // seq 1: tiles at 0 and 64; seq 2: 0, 64, 128
    expect_cover(1, 200, {0, 1, 70, 200}, 32);
    std::vector<AttnTile> tiles;
    const std::vector<int64_t> cu{0, 1, 70, 200};
    attention_tiles(1, 200, cu.data(), cu.size(), 64, tiles);
    ASSERT_EQ(tiles.size(), 6u);
    EXPECT_EQ(tiles[2].first, 1);
    EXPECT_EQ(tiles[2].t0, 64);
    EXPECT_EQ(tiles[5].first, 70);
    EXPECT_EQ(tiles[5].t0, 128);
}

TEST(AttentionTiles, RowsPerBlockFitTheSharedMemory) {
    const size_t h200 = 227 * 1024;
    // f32, head dim 128 (the dense models): 64 rows everywhere
    EXPECT_EQ(attention_block_rows(AttnKernel::forward, 128, 4, h200), 64);
    EXPECT_EQ(attention_block_rows(AttnKernel::dkv, 128, 4, h200), 64);
    // dK/dV keep four [rows, D + 1] tiles: 4·64·193·4 + 2·32·192·4 + 2·32·4 bytes > 227 KiB at D = 192
    EXPECT_EQ(attention_block_rows(AttnKernel::dkv, 192, 4, h200), 32);
    EXPECT_EQ(attention_block_rows(AttnKernel::dkv, 128, 8, h200), 32);  // f64: half the rows
    EXPECT_EQ(attention_block_rows(AttnKernel::dkv, 512, 8, h200), 0);   // does not fit at all
    for (const AttnKernel k : {AttnKernel::forward, AttnKernel::dq, AttnKernel::dkv})
        for (int64_t D : {16, 40, 64, 128, 192, 256})
            for (size_t elem : {size_t(4), size_t(8)}) {
                const int64_t rows = attention_block_rows(k, D, elem, h200);
                if (rows > 0) {
                    EXPECT_LE(attention_smem_bytes(k, rows, D, elem), h200);
                }
                if (rows == 32) {
                    EXPECT_GT(attention_smem_bytes(k, 64, D, elem), h200);
                }
            }
    // the 48 KiB a block gets without opting in: D = 40 in f32 forward needs (2·64·41 + 2·32·40)·4 = 31,232 bytes
    EXPECT_EQ(attention_smem_bytes(AttnKernel::forward, 64, 40, 4), 31232u);
}

// The tensor-core kernels' shared memory: hand-counted for D = 128 (the forward: Q 64 rows of 136 bf16, K and V 64
// each, then per warp scores 16 × 68 f32, probabilities 16 × 72 bf16, O 16 × 132 f32), every region 32-byte aligned
// and inside the block's bytes, and smaller blocks where D is large (MLA's absorbed 576 dims).
TEST(AttentionTiles, TensorCoreLayoutsFitAndAlign) {
    const size_t h200 = 227 * 1024;
    const AttnTcLayout f = attention_tc_layout(AttnKernel::forward, 128, h200);
    EXPECT_EQ(f.warps, 4);
    EXPECT_EQ(f.chunk, 64);
    EXPECT_EQ(f.bytes, 3 * 64 * 136 * 2 + 4 * (16 * 68 * 4 + 16 * 72 * 2 + 16 * 132 * 4));  // 112,640
    // dQ: Q, dO, K, V 64 rows each, per warp scores, dO·V and dS; dQ in fragments: 111 KiB, two blocks per SM
    const AttnTcLayout q = attention_tc_layout(AttnKernel::dq, 128, h200);
    EXPECT_TRUE(q.regs);
    EXPECT_EQ(q.bytes, 4 * 64 * 136 * 2 + 4 * (2 * 16 * 68 * 4 + 16 * 72 * 2));  // 113,664
    EXPECT_FALSE(attention_tc_layout(AttnKernel::dq, 144, h200).regs);           // 9 tiles: in shared memory
    // dK/dV: K, V, Q, dO 64 rows each, lse and Δ, per warp scores and dO·V, P and dS, dK and dV
    const AttnTcLayout b = attention_tc_layout(AttnKernel::dkv, 128, h200);
    EXPECT_EQ(b.warps, 4);
    EXPECT_EQ(b.bytes, 4 * 64 * 136 * 2 + 2 * 64 * 4 + 4 * (2 * 16 * 68 * 4 + 2 * 16 * 72 * 2 + 2 * 16 * 132 * 4));
    const AttnTcLayout wide = attention_tc_layout(AttnKernel::dkv, 192, h200);  // rows first, then a shorter chunk
    EXPECT_EQ(wide.warps, 4);
    EXPECT_EQ(wide.chunk, 32);
    const AttnTcLayout mla = attention_tc_layout(AttnKernel::dkv, 576, h200);
    EXPECT_EQ(mla.warps, 1);
    EXPECT_GT(AttnTcLayout(AttnKernel::dkv, 1, mla.chunk * 2, 576).bytes, int64_t(h200));
    EXPECT_EQ(attention_tc_layout(AttnKernel::dkv, 2048, h200).warps, 0);  // nothing fits
    for (const AttnKernel k : {AttnKernel::forward, AttnKernel::dq, AttnKernel::dkv})
        for (int64_t D : {8, 40, 64, 128, 192, 576}) {
            const AttnTcLayout at = attention_tc_layout(k, D, h200);
            ASSERT_GT(at.warps, 0) << D;
            EXPECT_LE(at.bytes, int64_t(h200));
            EXPECT_GE(at.dp, D);
            EXPECT_EQ(at.dp % 16, 0);
            for (int64_t off :
                 {at.other, at.rowvals, at.warp, at.part, at.scores, at.dscores, at.probs, at.dprobs, at.acc, at.acc2})
                EXPECT_EQ(off % 32, 0) << "D " << D;
            // the regions in order, each as long as its rows
            const int64_t own = 16 * at.warps * at.ldb * 2, chunk = at.chunk * at.ldb * 2;
            EXPECT_EQ(at.other, (k == AttnKernel::forward ? 1 : 2) * own);
            EXPECT_GE(at.rowvals, at.other + 2 * chunk);
            EXPECT_GE(at.warp, at.rowvals + (k == AttnKernel::dkv ? 2 * at.chunk * 4 : 0));
            EXPECT_GE(at.probs, at.scores + (k == AttnKernel::forward ? 1 : 2) * 16 * at.lds * 4);
            EXPECT_GE(at.acc, at.probs + (k == AttnKernel::dkv ? 2 : 1) * 16 * at.ldp * 2);
            EXPECT_EQ(at.regs, k == AttnKernel::dq && D <= 128);
            EXPECT_GE(at.part, at.acc + (k == AttnKernel::dkv ? 2 : at.regs ? 0 : 1) * 16 * at.ldo * 4);
            EXPECT_EQ(at.bytes, at.warp + at.warps * at.part);
        }
}

}  // namespace
}  // namespace tessera::ops
