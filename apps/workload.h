// What plan, simulate and onboard share: the model, the cluster and the workload (the options and their reading).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/options.h"
#include "plan/cluster.h"
#include "train/config.h"

namespace tessera::apps {

struct Workload {
    std::string model, cluster, mode = "full", routing = "uniform";
    int64_t ranks = 0, batch = 0, seq = 0;
    std::vector<std::string> overrides;
};

// The options: the model (positional), --cluster (required unless cluster_optional), --ranks, --global-batch, --seq,
// --mode, --routing, --set.
void add_workload_options(CLI::App* cmd, Workload& w, bool cluster_optional = false);

// The workload read: the model's document, its run config (--mode, --set, --global-batch, --seq), the cluster (when
// one is named).
struct Loaded {
    ModelDoc doc;
    train::RunConfig cfg;
    plan::Cluster cluster;
};
Loaded load_workload(const Workload& w);

}  // namespace tessera::apps
