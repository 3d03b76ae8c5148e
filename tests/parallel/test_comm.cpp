// The collectives on the in-process communicator, 1 to 4 ranks as threads (the same checks run under
// mpirun in test_comm_mpi.cpp).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "parallel/comm_checks.h"
#include "parallel/comm_local.h"
#include "parallel/shard.h"

namespace tessera {
namespace {

class LocalComm : public ::testing::TestWithParam<int> {};

TEST_P(LocalComm, AllGather) { parallel::run_local(GetParam(), test::check_all_gather); }
TEST_P(LocalComm, AllGatherUneven) { parallel::run_local(GetParam(), test::check_all_gather_uneven); }
TEST_P(LocalComm, AllToAllVUnevenEmptyAndAllToOne) { parallel::run_local(GetParam(), test::check_all_to_all_v_uneven); }
TEST_P(LocalComm, Broadcast) { parallel::run_local(GetParam(), test::check_broadcast); }
TEST_P(LocalComm, ReductionsSumInRankOrder) {
    parallel::run_local(GetParam(), test::check_reductions_sum_in_rank_order);
}
TEST_P(LocalComm, AsyncProgressesWhileTheCallerComputes) {
    parallel::run_local(GetParam(), test::check_async_progresses_while_the_caller_computes);
}
TEST_P(LocalComm, SplitIntoMeshGroups) { parallel::run_local(GetParam(), test::check_split_into_mesh_groups); }

INSTANTIATE_TEST_SUITE_P(Ranks, LocalComm, ::testing::Values(1, 2, 3, 4));

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

// ZeRO's cut of a flat buffer: consecutive ranges tiling [0, N), whole quanta except where N ends, the same
// cut from every rank's view.
TEST(FlatShard, RangesTileTheBufferInWholeQuanta) {
    for (int64_t n : {0, 1, 63, 64, 65, 640, 1000}) {
        for (int world : {1, 2, 3, 4, 7}) {
            int64_t next = 0;
            for (int r = 0; r < world; ++r) {
                const parallel::FlatShard s(n, r, world, 64);
                ASSERT_EQ(s.lo, next) << n << " / " << world << " rank " << r;
                ASSERT_EQ(s.per_rank % 64, 0);
                ASSERT_TRUE(s.hi == n || s.size() == s.per_rank) << "only the end cuts a range short";
                ASSERT_EQ(s.lo_of(r), s.lo);
                ASSERT_EQ(parallel::FlatShard(n, 0, world, 64).hi_of(r), s.hi);
                next = s.hi;
            }
            EXPECT_EQ(next, n);
            EXPECT_LT(parallel::FlatShard(n, 0, world, 64).per_rank, n / world + 64 + 1) << "balanced within a quantum";
        }
    }
    EXPECT_THROW(parallel::FlatShard(10, 2, 2, 64), Error);
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
