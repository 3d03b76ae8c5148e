// tessera calibrate (docs/plan.md): measures this machine and writes what it measured as a cluster file: the GEMM
// rate of a rank's threads as the f32 peak, each op class's fraction of it from timing one block of each kind of a
// model (forward and backward, the FLOPs the planner counts for it), memory bandwidth (memcpy), and with several
// ranks (under mpirun) the all-to-all's bandwidth and per-message latency between them.
#pragma once

#include <ostream>

#include "parallel/comm.h"
#include "plan/cluster.h"
#include "train/config.h"

namespace tessera::plan {

// world: null or one rank for this process alone (no link measured: shared-memory defaults). Collective over world.
Cluster calibrate(const train::RunConfig& cfg, parallel::Comm* world, std::ostream* log);

// The cluster file text load_cluster reads back.
std::string cluster_json(const Cluster& c);

}  // namespace tessera::plan
