// The collectives on the in-process communicator, 1 to 4 ranks as threads (the same checks run under
// mpirun in test_comm_mpi.cpp).
#include <gtest/gtest.h>

#include "core/check.h"
#include "parallel/comm_checks.h"
#include "parallel/comm_local.h"

namespace tessera {
namespace {

class LocalComm : public ::testing::TestWithParam<int> {};

TEST_P(LocalComm, AllGather) { parallel::run_local(GetParam(), test::check_all_gather); }
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

}  // namespace
}  // namespace tessera
