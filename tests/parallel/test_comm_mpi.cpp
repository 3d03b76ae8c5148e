// The collectives over MPI: run by ctest under mpirun with 2 and 4 ranks (label mpi). Every rank runs
// the same checks as the in-process tests; a failure on any rank fails the run. MpiCommCuda: the same checks on GPU
// buffers, which travel over the world's NCCL link (ctest's MpiCommCuda.Ranks2 and 4, in builds with the CUDA
// backend; they need a GPU per rank, or the CUDA emulator).
#include <gtest/gtest.h>

#include "core/device.h"
#include "parallel/comm_checks.h"
#include "parallel/comm_mpi.h"
#include "parallel/nccl_link.h"

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

#define SKIP_WITHOUT_LINK() \
    if (!g_world->has_device_link()) GTEST_SKIP() << "no GPU for each rank (nor the CUDA emulator)"
TEST(MpiCommCuda, AllGather) {
    SKIP_WITHOUT_LINK();
    test::check_all_gather(*g_world, Device::cuda);
}
TEST(MpiCommCuda, AllGatherUneven) {
    SKIP_WITHOUT_LINK();
    test::check_all_gather_uneven(*g_world, Device::cuda);
}
TEST(MpiCommCuda, AllToAllVUnevenEmptyAndAllToOne) {
    SKIP_WITHOUT_LINK();
    test::check_all_to_all_v_uneven(*g_world, Device::cuda);
}
TEST(MpiCommCuda, Broadcast) {
    SKIP_WITHOUT_LINK();
    test::check_broadcast(*g_world, Device::cuda);
}
TEST(MpiCommCuda, ReductionsSumInRankOrder) {
    SKIP_WITHOUT_LINK();
    test::check_reductions_sum_in_rank_order(*g_world, Device::cuda);
}
TEST(MpiCommCuda, SplitIntoMeshGroups) {
    SKIP_WITHOUT_LINK();
    test::check_split_into_mesh_groups(*g_world, Device::cuda);
}
TEST(MpiCommCuda, HostAndGpuBuffersInOneCollectiveAreAOneLineError) {
    SKIP_WITHOUT_LINK();
    void* gpu = device_alloc(Device::cuda, 64);
    std::vector<std::byte> host(64 * size_t(g_world->size()));
    try {
        g_world->all_gather({static_cast<const std::byte*>(gpu), 64}, host);
        ADD_FAILURE() << "a GPU send and a host receive were accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("all_gather: some buffers are in host memory and some in GPU memory"),
                  std::string::npos)
            << e.what();
    }
    device_free(Device::cuda, gpu);
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    tessera::parallel::MpiRuntime mpi;
    auto world = mpi.world();
    tessera::g_world = world.get();
    // GPU buffers over NCCL where each rank has a GPU of its own (the CUDA emulator shows 8)
    const int gpus = tessera::cuda_device_count(), local = tessera::parallel::local_ranks();
    if (gpus > 0 && gpus >= local) {
        tessera::use_cuda_device(tessera::parallel::local_rank() % gpus);
        world->use_device_link(tessera::parallel::make_nccl_link(*world));
    }
    if (world->rank() != 0) {  // one rank prints; every rank's result counts (the exit codes)
        auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
    }
    const int rc = RUN_ALL_TESTS();
    world->barrier();
    world.reset();
    return rc;
}
