// The collectives on the in-process communicator, 1 to 4 ranks as threads (the same checks run under
// mpirun in test_comm_mpi.cpp).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "parallel/comm_checks.h"
#include "parallel/comm_local.h"
#include "parallel/nccl_link.h"
#include "parallel/shard.h"

namespace tessera {
namespace {

class LocalComm : public ::testing::TestWithParam<int> {};

// a check on host buffers
template <auto Check>
void on_host(parallel::Comm& c) {
    Check(c, Device::cpu);
}

TEST_P(LocalComm, AllGather) { parallel::run_local(GetParam(), on_host<test::check_all_gather>); }
TEST_P(LocalComm, AllGatherUneven) { parallel::run_local(GetParam(), on_host<test::check_all_gather_uneven>); }
TEST_P(LocalComm, AllToAllVUnevenEmptyAndAllToOne) {
    parallel::run_local(GetParam(), on_host<test::check_all_to_all_v_uneven>);
}
TEST_P(LocalComm, Broadcast) { parallel::run_local(GetParam(), on_host<test::check_broadcast>); }
TEST_P(LocalComm, ReductionsSumInRankOrder) {
    parallel::run_local(GetParam(), on_host<test::check_reductions_sum_in_rank_order>);
}
TEST_P(LocalComm, AsyncProgressesWhileTheCallerComputes) {
    parallel::run_local(GetParam(), test::check_async_progresses_while_the_caller_computes);
}
TEST_P(LocalComm, SplitIntoMeshGroups) { parallel::run_local(GetParam(), on_host<test::check_split_into_mesh_groups>); }

INSTANTIATE_TEST_SUITE_P(Ranks, LocalComm, ::testing::Values(1, 2, 3, 4));

// GPU buffers travel over a device link (NCCL), which the in-process communicator has none of: a one-line error, not
// a host copy reading device memory.
TEST(LocalComm, GpuBuffersWithoutADeviceLinkAreAOneLineError) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device (nor the CUDA emulator)";
    void* gpu = device_alloc(Device::cuda, 64);
    parallel::run_local(1, [&](parallel::Comm& c) {
        try {
            c.broadcast({static_cast<std::byte*>(gpu), 64}, 0);
            ADD_FAILURE() << "a GPU buffer went over the local communicator";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(
                          "broadcast: the buffers are in GPU memory and this local communicator has no device link"),
                      std::string::npos)
                << e.what();
        }
    });
    device_free(Device::cuda, gpu);
}

// The NCCL link of a one-rank communicator: real NCCL on a GPU (scripts/device-check.sh runs this there, where
// several ranks would need several GPUs), the emulator's here. The checks on GPU buffers go through the link's stream
// and events, its own-block copies and the rank-order sum kernel; the splits get links of their own.
TEST(CudaNcclLink, OneRankCarriesEveryCollectiveOnGpuBuffers) {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device (nor the CUDA emulator)";
    parallel::run_local(1, [](parallel::Comm& c) {
        try {
            c.use_device_link(parallel::make_nccl_link(c));
        } catch (const Error& e) {
            if (std::string(e.what()).find("cannot load") == std::string::npos) throw;
            GTEST_SKIP() << e.what();  // a machine whose CUDA toolkit has no NCCL
        }
        test::check_all_gather(c, Device::cuda);
        test::check_all_gather_uneven(c, Device::cuda);
        test::check_all_to_all_v_uneven(c, Device::cuda);
        test::check_broadcast(c, Device::cuda);
        test::check_reductions_sum_in_rank_order(c, Device::cuda);
        test::check_split_into_mesh_groups(c, Device::cuda);
    });
}

TEST(LocalComm, MismatchedCountsAreAnErrorNotAHang) {
    EXPECT_THROW(
        parallel::run_local(
            2,
            [](parallel::Comm& c) {
                std::vector<std::byte> send(8), recv(8);
                // rank 0 sends 4 bytes to rank 1, which expects 8
                const std::vector<int64_t> sb = c.rank() == 0 ? std::vector<int64_t>{4, 4} : std::vector<int64_t>{4, 4};
                const std::vector<int64_t> rb = c.rank() == 1 ? std::vector<int64_t>{0, 8} : std::vector<int64_t>{4, 4};
                c.all_to_all_v(send, sb, recv, rb);
            }),
        Error);
}

// A rank that fails outside any collective, while the others wait in one (the world's and a split's): run_local
// rethrows that rank's error instead of hanging, and the waiting ranks come out of their collectives.
TEST(LocalComm, ARanksErrorEndsTheOthersCollectives) {
    for (bool in_split : {false, true}) {
        try {
            parallel::run_local(4, [&](parallel::Comm& c) {
                std::unique_ptr<parallel::Comm> half = c.split(c.rank() / 2, c.rank());
                if (c.rank() == 2) TESSERA_FAIL("rank 2 gives up");
                std::vector<std::byte> send(8), recv(8 * size_t(in_split ? half->size() : c.size()));
                (in_split ? *half : c).all_gather(send, recv);
            });
            ADD_FAILURE() << "no error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("rank 2 gives up"), std::string::npos) << e.what();
        }
    }
}

// ZeRO's contiguous cut of a flat buffer: consecutive ranges tiling [0, N), whole quanta except where N ends, the
// same cut from every rank's view.
TEST(FlatShard, RangesTileTheBufferInWholeQuanta) {
    for (int64_t n : {0, 1, 63, 64, 65, 640, 1000}) {
        for (int world : {1, 2, 3, 4, 7}) {
            int64_t next = 0;
            const parallel::FlatShard first(n, 0, world, 64);
            for (int r = 0; r < world; ++r) {
                const parallel::FlatShard s(n, r, world, 64);
                const auto [lo, hi] = s.stretch();
                if (s.size() == 0) continue;
                ASSERT_EQ(lo, next) << n << " / " << world << " rank " << r;
                ASSERT_EQ(lo % 64, 0);
                ASSERT_TRUE(hi == n || s.size() == s.longest()) << "only the end cuts a range short";
                ASSERT_EQ(first.stretch_of(r), s.stretch());
                next = hi;
            }
            EXPECT_EQ(next, n);
            EXPECT_LT(first.longest(), n / world + 64 + 1) << "balanced within a quantum";
        }
    }
    EXPECT_THROW(parallel::FlatShard(10, 2, 2, 64), Error);
    EXPECT_THROW(parallel::FlatShard(10, 0, 2, 64, {20}), Error);
}

// Segments (the model's units) under both cuts: chunks start afresh at each segment, and both cuts deal out the same
// chunks whole (what keeps the gradient norm's bits), every rank's intervals one after another in its range; the
// spread cut (FSDP) gives every rank an even share of every segment, in rank order (what an all-gather-v puts
// together), and the ranks' totals differ by one chunk at most; the contiguous one keeps each rank's range one stretch.
TEST(FlatShard, SegmentsAreDealtInWholeChunksSpreadOrContiguous) {
    const int64_t n = 9000, q = 64;
    const std::vector<int64_t> segments = {1000, 1100, 1130, 5000};  // (0 is one too)
    const std::vector<int64_t> bounds = {0, 1000, 1100, 1130, 5000, n};
    // the chunks of [lo, hi) cut every q elements from lo
    auto chunks = [&](int64_t lo, int64_t hi, std::vector<std::pair<int64_t, int64_t>>& out) {
        for (int64_t c = lo; c < hi; c += q) out.push_back({c, std::min(hi, c + q)});
    };
    std::vector<std::pair<int64_t, int64_t>> expected;  // every segment's chunks
    for (size_t k = 0; k + 1 < bounds.size(); ++k) chunks(bounds[k], bounds[k + 1], expected);
    for (bool spread : {false, true}) {
        for (int world : {1, 2, 3, 4, 7, 64}) {
            const parallel::FlatShard s(n, 0, world, q, segments, spread);
            std::vector<std::pair<int64_t, int64_t>> dealt;
            std::vector<int64_t> count(static_cast<size_t>(world), 0);
            for (int r = 0; r < world; ++r) {
                int64_t at = 0;
                for (const parallel::FlatShard::Interval& i : s.of(r)) {
                    ASSERT_EQ(i.at, at) << "rank " << r << "'s intervals one after another";
                    at += i.hi - i.lo;
                    const auto seg = std::upper_bound(bounds.begin(), bounds.end(), i.lo) - 1;
                    ASSERT_EQ((i.lo - *seg) % q, 0) << "an interval starts at one of its segment's chunks";
                    ASSERT_LE(i.hi, *(seg + 1)) << "an interval ends in its segment";
                    chunks(i.lo, i.hi, dealt);
                    count[size_t(r)] += s.chunks(i);
                }
                ASSERT_EQ(s.size_of(r), at);
                if (!spread) {
                    ASSERT_EQ(s.stretch_of(r).second - s.stretch_of(r).first, at) << "one stretch";
                }
            }
            std::sort(dealt.begin(), dealt.end());
            ASSERT_EQ(dealt, expected) << "world " << world << (spread ? " spread" : " contiguous");
            const auto [few, most] = std::minmax_element(count.begin(), count.end());
            if (!spread) continue;
            EXPECT_LE(*most - *few, 1) << "world " << world;
            for (size_t k = 0; k + 1 < bounds.size(); ++k) {
                const std::vector<int64_t> parts = s.parts(bounds[k], bounds[k + 1]);  // (checks rank order)
                const int64_t c = (bounds[k + 1] - bounds[k] + q - 1) / q;
                for (int r = 0; r < world; ++r) {
                    EXPECT_LE(parts[size_t(r)], (c + world - 1) / world * q);
                    if (c >= world) {
                        EXPECT_GE(parts[size_t(r)], c / world * q - q) << "every rank holds its share";
                    }
                }
            }
            if (world > 1) {
                EXPECT_THROW(s.parts(0, 5000), Error) << "two segments are not one piece per rank";
            }
        }
    }
}

// A reduce-scatter in rounds: every rank's piece is covered exactly once, a round's piece never exceeds the round,
// every rank with that much left receives a full round each time (no rank waits while another drains its piece), and
// the scratch does not grow with the pieces: 2^21 elements up to 64 ranks, 2 · 2^14 per rank beyond.
TEST(ReduceRounds, EveryRankReceivesInEveryRoundAndTheScratchIsBounded) {
    for (int W : {1, 2, 4, 128, 2048}) {
        for (int64_t piece : {int64_t(1), int64_t(1000), int64_t(1) << 20, int64_t(470) << 20}) {
            std::vector<int64_t> pieces(static_cast<size_t>(W), piece), offsets(static_cast<size_t>(W));
            pieces.back() = piece / 3;  // the last range short, as a flat cut leaves it
            for (int q = 0; q < W; ++q) offsets[size_t(q)] = int64_t(q) * piece;
            const parallel::ReduceRounds r(pieces, offsets);
            std::vector<int64_t> covered(static_cast<size_t>(W), 0), n;
            for (int64_t j = 0; j < r.rounds; ++j) {
                r.counts(j, n);
                for (int q = 0; q < W; ++q) {
                    ASSERT_LE(n[size_t(q)], r.round);
                    ASSERT_EQ(n[size_t(q)], std::min(r.round, pieces[size_t(q)] - covered[size_t(q)]));
                    covered[size_t(q)] += n[size_t(q)];
                }
            }
            EXPECT_EQ(covered, pieces) << W << " ranks, pieces of " << piece;
            EXPECT_LE(r.scratch_elements(), std::max<int64_t>(int64_t(1) << 21, 2 * int64_t(W) << 14)) << W;
            const int64_t longest = *std::max_element(pieces.begin(), pieces.end());
            EXPECT_EQ(r.rounds, std::max<int64_t>(1, (longest + r.round - 1) / r.round))
                << "as the longest piece needs";
        }
    }
    EXPECT_THROW(parallel::ReduceRounds({1, 2}, {0}), Error);
}

}  // namespace
}  // namespace tessera
