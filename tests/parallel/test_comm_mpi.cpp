// The collectives over MPI: run by ctest under mpirun with 2 and 4 ranks (label mpi). Every rank runs
// the same checks as the in-process tests; a failure on any rank fails the run.
#include <gtest/gtest.h>

#include "parallel/comm_checks.h"
#include "parallel/comm_mpi.h"

namespace tessera {
namespace {

parallel::Comm* g_world = nullptr;

TEST(MpiComm, AllGather) { test::check_all_gather(*g_world); }
TEST(MpiComm, AllGatherUneven) { test::check_all_gather_uneven(*g_world); }
TEST(MpiComm, AllToAllVUnevenEmptyAndAllToOne) { test::check_all_to_all_v_uneven(*g_world); }
TEST(MpiComm, Broadcast) { test::check_broadcast(*g_world); }
TEST(MpiComm, ReductionsSumInRankOrder) { test::check_reductions_sum_in_rank_order(*g_world); }
TEST(MpiComm, AsyncProgressesWhileTheCallerComputes) {
    test::check_async_progresses_while_the_caller_computes(*g_world);
}
TEST(MpiComm, SplitIntoMeshGroups) { test::check_split_into_mesh_groups(*g_world); }

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    tessera::parallel::MpiRuntime mpi;
    auto world = mpi.world();
    tessera::g_world = world.get();
    if (world->rank() != 0) {  // one rank prints; every rank's result counts (the exit codes)
        auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
    }
    const int rc = RUN_ALL_TESTS();
    world->barrier();
    world.reset();
    return rc;
}
