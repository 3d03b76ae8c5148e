// The run configuration: a JSON file with sections "model", "train" and "data" (docs/config.md).
// Every key has a default; unknown keys are errors. The default demo config is configs/demo.json,
// compiled into the binary.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "core/config_reader.h"
#include "model/config.h"
#include "model/recompute.h"

namespace tessera::train {

struct TrainConfig {
    int64_t seq_len = 256;
    int64_t batch_size = 16;  // global: sequences per optimizer step, whatever the number of ranks
    int64_t steps = 1000;
    int64_t micro_batch_size = 0;  // sequences per forward/backward on each rank; 0 = batch_size / ranks
    double lr = 3e-3;
    double min_lr_ratio = 0.1;  // floor of the decay, as a fraction of lr
    int64_t warmup_steps = 50;
    std::string schedule = "cosine";  // cosine | wsd | constant
    double decay_fraction = 0.2;      // wsd: the last fraction of steps decays linearly
    double weight_decay = 0.1;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double grad_clip = 1.0;       // global L2 norm; 0 = off
    int64_t eval_interval = 100;  // 0 = only at the end
    int64_t eval_batches = 8;
    int64_t checkpoint_interval = 500;  // 0 = only at the end
    int64_t log_interval = 10;
    uint64_t seed = 1234;
    model::Recompute recompute;  // blocks that recompute their activations in backward (model/recompute.h)
    // Where the model trains: "cpu", or "cuda" (the whole step on the GPU: parameters, gradients, optimizer state and
    // activations in one device arena; batches go up, losses and statistics come back; one process: NCCL is not
    // built yet). Checkpoints are the same files either way.
    std::string device = "cpu";
    // The GEMMs' precision (ops/gemm.h, GemmPrecision): "f32", or "bf16" (operands rounded to bf16, products summed
    // in f32: the GPU's tensor cores; on the CPU the same arithmetic up to the sums' order, by oneDNN's AMX GEMM
    // where the CPU has AMX and slower than f32 elsewhere); parameters, gradients, AdamW state and activations stay
    // f32.
    std::string precision = "f32";
    // The dtype of the activations blocks keep for their backward (model/model.h, set_activation_dtype): "f32", or
    // "bf16" (held in bf16 between forward and backward by every block of a kind but its last; computed in f32)
    DType activation_dtype = DType::f32;
    // checkpoints written by a thread of their own while training goes on (a copy of the state is taken at the
    // step; docs/operations.md); false: the step loop writes them
    bool async_checkpoints = true;
    // Fine-tuning: the model to start from (a tessera checkpoint or run directory, or a Hugging Face checkpoint
    // directory), whose architecture the run takes; with model.lora its weights stay frozen and checkpoints hold
    // only what trains, naming this base. "" = train from an initialisation.
    std::string base;

    // On `ranks` data-parallel ranks: the sequences of one forward (the micro-batch), and the micro-batches
    // each rank accumulates per optimizer step. One-line error when batch_size does not split so.
    int64_t micro_batch(int ranks) const;
    int64_t accumulation(int ranks) const;
};

struct DataConfig {
    std::string path;  // token shard, text file or directory; "" = the bundled corpus
    double val_fraction = 0.05;
    bool mask_documents = true;  // documents packed in a row never see each other
};

// How the ranks of an mpirun / srun job split the work (docs/parallel.md). Every rank is a data-parallel
// rank; ep > 1 also spreads each MoE layer's experts over groups of ep consecutive ranks.
struct ParallelConfig {
    // FSDP / ZeRO-3 (train/fsdp.h): each rank keeps a range of the dense parameters and gathers each block's
    // just before use; false: ZeRO-2 (whole parameters on every rank, sharded optimizer state)
    bool fsdp = true;
    // HSDP: FSDP shards the dense parameters over groups of this many consecutive ranks (a divisor of the world size,
    // at least 2), and the world size / shard groups hold replicas of them whose gradients are all-reduced once per
    // step (parallel/mesh.h). Fewer ranks per collective (latency), more dense state per rank. 0: every rank (plain
    // FSDP).
    int64_t shard = 0;
    int64_t ep = 1;         // expert parallelism: ranks per expert group (divides the world size and the experts)
    int64_t ep_chunks = 2;  // overlap: expert groups per rank whose exchanges pipeline with compute (1 = none)
    double link_delay_ns_per_byte = 0.0;  // test and bench option: the expert group's links made this much slower
    // Pipeline parallelism (docs/parallel.md): the world's ranks in this many stages of consecutive layers (every
    // group above is one stage's), scheduled 1F1B over train.accumulation micro-batches. pipeline_split: the first
    // layer of each stage after the first (pipeline − 1 increasing layers); empty: as even as the layers divide.
    int64_t pipeline = 1;
    std::vector<int64_t> pipeline_split;
    // A stage before the last: false, keep each micro-batch in flight's activations (a copy of what its backward reads
    // of the activation group, restored before its backward); true, keep only its input and re-run its forward before
    // the backward (one activation set, one forward more per micro-batch).
    bool pipeline_rerun = false;
    // Tensor parallelism (docs/parallel.md): groups of this many consecutive ranks of a stage take the same
    // micro-batches; each keeps 1/tensor of the tokens between attention blocks and runs 1/tensor of each attention
    // block's heads (model/layers/tensor_slice.h). A divisor of the ranks per stage and of train.seq_len.
    int64_t tensor = 1;
    // stage s's layers of a model of n_layers
    model::LayerRange stage_layers(int64_t stage, int64_t n_layers) const;
};

// Memory limits of a run (docs/train.md, "Weight budget").
struct MemoryConfig {
    // MiB of a LoRA fine-tune's frozen base kept resident; the base is read in place from its files
    // (train/weight_budget.h). 0 = the whole base in memory (copied into the arena).
    int64_t weights_budget = 0;
    // AdamW's moments in a file instead of the arena (docs/train.md, "Optimizer offload"; train/optimizer.h): the
    // kernel pages them to and from the disk, and the step streams them through a window at a time.
    bool optimizer_offload = false;
    std::string offload_dir;         // where that file is made (and at once unlinked); empty: the run's directory
    double offload_window_mib = 16;  // how much of each moment the step streams at a time
    // train.precision = bf16 on a GPU: the trained GEMM weights also held as bf16 copies (2 bytes a parameter),
    // rounded once per optimizer step and read in place by every GEMM (train/weight_copies.h); false: each GEMM
    // rounds its f32 weights per call. The same products either way.
    bool weight_copies = true;
};

// Operations (docs/operations.md): the metrics endpoint, the alert rules evaluated every step and what each
// does when it fires (warn: a line in alerts.jsonl and on stderr, and the webhook; checkpoint: also write one;
// stop: also checkpoint and end the run, exit status 3).
struct AlertRule {
    double threshold = 0;  // the rule's bound (0 = the rule is off, where that makes sense)
    int64_t steps = 1;     // consecutive steps past the bound before it fires
    int64_t window = 0;    // steps of history it compares with
    std::string action = "warn";
};
struct MonitorConfig {
    int64_t metrics_port = 0;  // Prometheus /metrics and the dashboard on this port of rank 0; 0 = off
    std::string webhook;       // http://host:port/path: every alert POSTed as JSON; "" = none
    // no update from a non-finite loss or gradient: "skip" the step (warn; stop after `steps` in a row) or "stop"
    AlertRule nonfinite{.threshold = 0, .steps = 3, .window = 0, .action = "skip"};
    AlertRule loss_spike{.threshold = 8, .steps = 1, .window = 50};       // robust z-score of the loss over the window
    AlertRule expert_overload{.threshold = 0, .steps = 10, .window = 0};  // any MoE layer's max/mean load (0 = off)
    AlertRule straggler{.threshold = 3, .steps = 3, .window = 0};      // a rank's compute time over the others' median
    AlertRule memory{.threshold = 0.9, .steps = 1, .window = 0};       // a rank's resident set over physical memory
    AlertRule throughput{.threshold = 0.3, .steps = 5, .window = 50};  // tokens/s under this share of the median
    // a rank whose step does not finish in this many seconds (a collective stuck, a rank lost): the alert, then
    // the process ends (exit 124) so that tessera launch restarts the job; 0 = off
    double watchdog_seconds = 0;
};
// The rules by their config names (monitor.alerts.NAME).
std::array<std::pair<const char*, AlertRule*>, 6> alert_rules(MonitorConfig& m);
std::array<std::pair<const char*, const AlertRule*>, 6> alert_rules(const MonitorConfig& m);

struct RunConfig {
    model::ModelConfig model;
    TrainConfig train;
    DataConfig data;
    ParallelConfig parallel;
    MemoryConfig memory;
    MonitorConfig monitor;
};

// Parses and validates; `where` names the source in messages (a file name).
RunConfig parse_run_config(const Json& doc, const std::string& where);
Json to_json(const RunConfig& c);

// The built-in demo config (configs/demo.json) as JSON.
Json demo_config_json();
// Upper bounds of train.steps (and --steps) and batch_size.
constexpr int64_t kMaxSteps = int64_t(1000000000000);
constexpr int64_t kMaxBatch = int64_t(1) << 20;

// Config files (run configs, checkpoint configs, Hugging Face config.json) larger than this are refused.
constexpr size_t kMaxConfigBytes = size_t(16) << 20;
// Reads a config file (or the demo config when path is empty; it must hold a JSON object) and applies --set
// overrides.
Json load_config_json(const std::string& path, const std::vector<std::string>& overrides);
// The bundled corpus directory (data/corpus in the source tree).
std::string bundled_corpus_path();

}  // namespace tessera::train
