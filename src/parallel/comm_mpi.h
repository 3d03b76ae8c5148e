// The MPI communicator (OpenMPI from Debian; launched by mpirun or srun). One MpiRuntime per
// process initialises MPI (threads: serialized; every MPI call runs on the process's communication
// thread) and finalises it when destroyed.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace tessera::parallel {

// True when this process was started by an MPI launcher (mpirun, srun): the environment names a rank.
bool launched_by_mpi();

// The ranks of this job on this host, and this process's index among them, from the launcher's environment (1 and 0
// when it does not say).
int local_ranks();
int local_rank();

class MpiRuntime {
  public:
    MpiRuntime();  // MPI_Init_thread; throws when MPI is not usable
    ~MpiRuntime();
    MpiRuntime(const MpiRuntime&) = delete;
    MpiRuntime& operator=(const MpiRuntime&) = delete;
    std::unique_ptr<Comm> world();  // a communicator over MPI_COMM_WORLD
    // Ends every process of the job (after one rank failed: the others may be waiting in a collective).
    [[noreturn]] void abort(int status);
};

}  // namespace tessera::parallel
