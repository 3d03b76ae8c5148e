// The in-process communicator: W ranks as threads of one process, collectives through shared
// memory (each rank's collectives run on its own communication thread, as with MPI). For fast unit
// tests of everything built on parallel/comm.h; the same code then runs under mpirun.
#pragma once

#include <functional>
#include <memory>

#include "parallel/comm.h"

namespace tessera::parallel {

// Runs fn(world communicator) on `ranks` threads and waits for all; the first error is rethrown. A rank that throws
// breaks every communicator's barrier, so the others fail at their next collective ("another rank failed") instead
// of waiting for it forever. Errors inside collectives (mismatched counts) are still raised after the collective's
// last barrier, so every member sees the same data.
void run_local(int ranks, const std::function<void(Comm&)>& fn);

}  // namespace tessera::parallel
