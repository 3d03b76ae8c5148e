// Buddy allocator: split/coalesce, statistics, out-of-memory errors, and a randomized stress test
// checked against an independent model of which bytes are in use.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <map>
#include <set>

#include "core/arena.h"
#include "core/buffer_spec.h"
#include "core/rng.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(Buddy, SplitsAndCoalesces) {
    BuddyAllocator b(1024, 64);  // 16 min-blocks, one free block of 1024
    EXPECT_EQ(b.stats().num_free_blocks, 1u);
    size_t a = b.allocate(64);  // splits 1024 -> 512 + 256 + 128 + 64 + 64
    EXPECT_EQ(a, 0u);
    EXPECT_EQ(b.stats().num_free_blocks, 4u);
    EXPECT_EQ(b.stats().bytes_in_use, 64u);
    size_t c = b.allocate(100);  // rounds to 128
    EXPECT_EQ(b.stats().bytes_in_use, 64u + 128u);
    EXPECT_EQ(b.stats().bytes_requested, 164u);
    EXPECT_EQ(c % 128, 0u);
    b.free(a);
    b.free(c);
    EXPECT_EQ(b.stats().num_free_blocks, 1u);  // everything coalesced back
    EXPECT_EQ(b.stats().largest_free_block, 1024u);
    EXPECT_EQ(b.stats().peak_bytes_in_use, 192u);
    EXPECT_DOUBLE_EQ(b.stats().fragmentation(), 0.0);
}

TEST(Buddy, ExactSizedAllocationReturnsTheTail) {
    BuddyAllocator b(8 * 64, 64);
    size_t a = b.allocate(5 * 64 - 10);  // 5 units inside an 8-unit block: 4 + 1 kept, 1 + 2 returned
    EXPECT_EQ(b.stats().bytes_in_use, 5u * 64u);
    EXPECT_EQ(b.stats().bytes_requested, 5u * 64u - 10u);
    EXPECT_EQ(b.stats().num_free_blocks, 2u);
    EXPECT_EQ(b.stats().largest_free_block, 128u);
    size_t c = b.allocate(128), d = b.allocate(64);
    EXPECT_EQ(b.stats().bytes_in_use, 8u * 64u);
    EXPECT_THROW(b.allocate(1), Error);
    b.free(a);
    EXPECT_THROW(b.free(a + 4 * 64), Error);  // inside an allocation, not its start
    b.free(d);
    b.free(c);
    EXPECT_EQ(b.stats().num_free_blocks, 1u);
    EXPECT_EQ(b.stats().largest_free_block, 512u);
}

TEST(Buddy, CapacityForFindsTheTightestFit) {
    // 3 units cannot sit in a 3-unit arena (2 + 1 seeds); 4 units is the tightest that works
    EXPECT_EQ(buddy_capacity_for({3 * 64}, 64), 4u * 64u);
    // exact totals when they pack: 5 + 2 + 1 units in an 8-unit arena
    EXPECT_EQ(buddy_capacity_for({5 * 64, 2 * 64, 64}, 64), 8u * 64u);
    // whatever the sizes, the answer is checked by replaying the allocations
    std::vector<size_t> sizes = {1000000, 333333, 4097, 65536, 12, 777777};
    size_t cap = buddy_capacity_for(sizes, 256);
    BuddyAllocator b(cap, 256);
    std::sort(sizes.begin(), sizes.end(), std::greater<>());
    for (size_t s : sizes) b.allocate(s);
    size_t exact = 0;
    for (size_t s : sizes) exact += b.rounded_size(s);
    EXPECT_LE(cap, exact + exact / 4) << "more than 25% above the exact total";
}

TEST(Buddy, CapacityForSizesBeyondTheIndexRangeIsAnErrorNotAnEndlessSearch) {
    test::expect_error([] { buddy_capacity_for({size_t(1) << 50}, 256); }, "exceeds 2^30 blocks");
    test::expect_error([] { buddy_capacity_for({size_t(3) << 36, size_t(3) << 36}, 256); }, "exceed 2^30 blocks");
}

TEST(Buddy, NonPowerOfTwoCapacityIsSeededAsBinaryDecomposition) {
    BuddyAllocator b(64 * 11, 64);  // 8 + 2 + 1 blocks
    EXPECT_EQ(b.stats().capacity, 704u);
    EXPECT_EQ(b.stats().num_free_blocks, 3u);
    EXPECT_EQ(b.stats().largest_free_block, 512u);
    size_t x = b.allocate(512), y = b.allocate(128), z = b.allocate(64);
    EXPECT_EQ(b.stats().bytes_in_use, 704u);
    EXPECT_THROW(b.allocate(1), Error);
    b.free(y);
    b.free(x);
    b.free(z);
    EXPECT_EQ(b.stats().num_free_blocks, 3u);  // blocks across the seed boundaries never merge
}

TEST(Buddy, FragmentationIsReported) {
    BuddyAllocator b(1024, 64);
    std::vector<size_t> blocks;
    for (int i = 0; i < 16; ++i) blocks.push_back(b.allocate(64));
    for (int i = 0; i < 16; i += 2) b.free(blocks[i]);  // every other block free: no two buddies free
    EXPECT_EQ(b.stats().num_free_blocks, 8u);
    EXPECT_EQ(b.stats().largest_free_block, 64u);
    EXPECT_NEAR(b.stats().fragmentation(), 1.0 - 64.0 / 512.0, 1e-12);
    EXPECT_THROW(b.allocate(128), Error);  // 512 bytes free, but no 128-byte block
}

TEST(Buddy, OutOfMemoryMessageSaysWhy) {
    BuddyAllocator b(4096, 64);
    try {
        b.allocate(8192);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
    }
}

TEST(Buddy, DoubleFreeIsAnError) {
    BuddyAllocator b(1024, 64);
    size_t a = b.allocate(64);
    b.free(a);
    EXPECT_THROW(b.free(a), Error);
    EXPECT_THROW(b.free(3), Error);
}

TEST(Buddy, RandomStressNeverOverlapsAndFullyCoalesces) {
    const size_t cap = 1 << 20, minb = 64;
    BuddyAllocator b(cap, minb);
    std::map<size_t, size_t> live;  // offset -> block size
    Rng rng(42, 1);
    for (int it = 0; it < 20000; ++it) {
        if (live.empty() || rng.uniform() < 0.55) {
            size_t req = 1 + rng.below(20000);
            size_t off;
            try {
                off = b.allocate(req);
            } catch (const Error&) {
                continue;
            }
            size_t blk = b.rounded_size(req);
            ASSERT_EQ(off % std::bit_ceil(blk), 0u) << "allocation not aligned to its enclosing block";
            ASSERT_LE(off + blk, cap);
            auto next = live.lower_bound(off);
            if (next != live.end()) {
                ASSERT_LE(off + blk, next->first) << "overlap with a later block";
            }
            if (next != live.begin()) {
                auto prev = std::prev(next);
                ASSERT_LE(prev->first + prev->second, off) << "overlap with an earlier block";
            }
            live[off] = blk;
        } else {
            auto it2 = live.begin();
            std::advance(it2, rng.below(live.size()));
            b.free(it2->first);
            live.erase(it2);
        }
        size_t in_use = 0;
        for (auto& [o, s] : live) in_use += s;
        ASSERT_EQ(b.stats().bytes_in_use, in_use);
        ASSERT_EQ(b.stats().num_allocations, live.size());
    }
    for (auto& [o, s] : live) b.free(o);
    EXPECT_EQ(b.stats().num_free_blocks, 1u);
    EXPECT_EQ(b.stats().largest_free_block, cap);
}

TEST(Arena, GroupsPackExactlyIntoThePredictedCapacity) {
    BufferGroup g1("a", {{"x", DType::f32, Shape{1000}}, {"y", DType::f32, Shape{3, 5}}});
    BufferGroup g2("b", {{"z", DType::f64, Shape{4096}}});
    BufferGroup g3("c", {{"w", DType::i32, Shape{7}}});
    EXPECT_EQ(g1.nbytes(), 4032u + 64u);  // x pads 4000 -> 4032, the 60-byte y to 64
    size_t predicted = predict_arena_bytes({&g1, &g2, &g3}, 256);
    ASSERT_EQ(predicted, 4096u + 32768u + 256u);  // here the exact total packs
    auto arena = std::make_shared<Arena>(predicted, 256);
    allocate_groups(arena, {&g3, &g1, &g2});  // order is fixed up inside: largest first
    EXPECT_EQ(arena->stats().bytes_in_use, predicted);
    EXPECT_EQ(arena->stats().peak_bytes_in_use, predicted);
    g1.view("y").ptr<float>()[14] = 3.0f;
    EXPECT_EQ(g1.view(1).ptr<float>()[14], 3.0f);
    EXPECT_THROW(g1.view("nope"), Error);
}

}  // namespace
}  // namespace tessera
