// Checks of a communicator's collectives, written once against parallel/comm.h and run both on the
// in-process communicator (test_comm.cpp, 1–4 ranks as threads) and under mpirun (test_comm_mpi.cpp).
// Each check uses gtest assertions on the calling rank.
#pragma once

#include "parallel/comm.h"

namespace tessera::test {

void check_all_gather(parallel::Comm& c);
void check_all_gather_uneven(parallel::Comm& c);    // uneven and empty blocks
void check_all_to_all_v_uneven(parallel::Comm& c);  // uneven, empty and all-to-one loads
void check_broadcast(parallel::Comm& c);
void check_reductions_sum_in_rank_order(parallel::Comm& c);  // incl. uneven blocks, accumulating
void check_async_progresses_while_the_caller_computes(parallel::Comm& c);
void check_split_into_mesh_groups(parallel::Comm& c);

}  // namespace tessera::test
