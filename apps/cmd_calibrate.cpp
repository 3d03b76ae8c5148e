// tessera calibrate: measure this machine (and, under mpirun / tessera launch, the links between its ranks) and
// write a cluster file for tessera plan (docs/plan.md).
#include <omp.h>

#include <filesystem>
#include <iostream>
#include <thread>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/check.h"
#include "core/file.h"
#include "parallel/comm_mpi.h"
#include "plan/calibrate.h"
#include "train/config.h"

namespace tessera::apps {

void add_calibrate_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "calibrate", "Measure this machine (GEMM and block rates, memory and link bandwidth) into a cluster file");
    struct Args {
        std::string out, model;
        int64_t seq = 0;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("--out", a->out, "The cluster file to write")->required();
    cmd->add_option("--model", a->model,
                    "The model whose blocks are timed: a tessera config or a Hugging Face config.json (default: the "
                    "demo)");
    add_int_option(cmd, "--seq", a->seq, 0, model::kMaxSeqLen, "Tokens per timed sequence (0 = the config's)");
    cmd->footer(
        "Example: tessera calibrate --out cluster.json\n"
        "         tessera launch -n 2 -- calibrate --model configs/moe_small.json --out cluster.json   (links too)");
    cmd->callback([a] {
        Json run = a->model.empty() ? train::demo_config_json() : load_model_doc(a->model).run;
        if (a->seq) run["train"]["seq_len"] = a->seq;
        const train::RunConfig cfg = train::parse_run_config(run, a->model.empty() ? "the demo config" : a->model);
        std::unique_ptr<parallel::MpiRuntime> mpi;
        std::unique_ptr<parallel::Comm> world;
        if (parallel::launched_by_mpi()) {
            mpi = std::make_unique<parallel::MpiRuntime>();
            world = mpi->world();
            const int share = std::max(1, int(std::thread::hardware_concurrency()) / parallel::local_ranks());
            if (!std::getenv("OMP_NUM_THREADS") && omp_get_max_threads() > share) omp_set_num_threads(share);
        }
        const bool lead = !world || world->rank() == 0;
        const plan::Cluster c = plan::calibrate(cfg, world.get(), lead ? &std::cout : nullptr);
        if (lead) {
            const std::filesystem::path dir = std::filesystem::path(a->out).parent_path();
            if (!dir.empty()) std::filesystem::create_directories(dir);
            write_text_atomic(a->out, plan::cluster_json(c));
            plan::load_cluster(a->out);  // what it wrote reads back
            std::cout << "wrote " << a->out << "\n";
        }
    });
}

}  // namespace tessera::apps
