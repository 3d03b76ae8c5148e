// Checks of a communicator's collectives, written once against parallel/comm.h and run both on the
// in-process communicator (test_comm.cpp, 1–4 ranks as threads) and under mpirun (test_comm_mpi.cpp), there also
// on GPU buffers over NCCL where the build has the CUDA backend and a device (or the emulator).
// Each check uses gtest assertions on the calling rank.
#pragma once

#include "parallel/comm.h"

namespace tessera::test {

// side: where the buffers live; Device::cuda runs the collectives over the communicator's device link (NCCL)
void check_all_gather(parallel::Comm& c, Device side = Device::cpu);
void check_all_gather_uneven(parallel::Comm& c, Device side = Device::cpu);    // uneven and empty blocks
void check_all_to_all_v_uneven(parallel::Comm& c, Device side = Device::cpu);  // uneven, empty and all-to-one loads
void check_broadcast(parallel::Comm& c, Device side = Device::cpu);
void check_reductions_sum_in_rank_order(parallel::Comm& c, Device side = Device::cpu);  // uneven, accumulating, ...
void check_async_progresses_while_the_caller_computes(parallel::Comm& c);
void check_split_into_mesh_groups(parallel::Comm& c, Device side = Device::cpu);

}  // namespace tessera::test
