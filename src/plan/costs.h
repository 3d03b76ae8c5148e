// The planner's cost model (docs/plan.md, "Step time"): a model's costs per block and FSDP unit, and the seconds of
// each term of a layout's step on its busiest rank (compute per op class, the expert all-to-all, FSDP's and ZeRO-2's
// transfers, tensor groups' transfers, the optimizer, pipeline exchanges). plan.cpp assembles a step from them,
// searches the layouts and lays a step out in time (tessera simulate). Formulas: spec/scale.md §2, §6–§8.
#pragma once

#include <string>
#include <vector>

#include "model/recompute.h"
#include "plan/cluster.h"
#include "plan/memory.h"
#include "plan/plan.h"
#include "train/config.h"

namespace tessera::plan {

struct BlockCost {  // one block (two per layer)
    std::string kind;
    OpClass cls = OpClass::gemm;
    double flops = 0, routed = 0;  // forward per token; of which the routed experts' (grouped GEMM)
    bool recomputable = false;     // re-runs its forward when train.recompute covers its kind (not the kind's last)
    bool sliced = false;           // an attention block: tensor parallelism splits its heads (the rest: its tokens)
    double rank_flops = 0;         // with tensor groups: forward per token of the group's micro-batch on one rank
    bool reruns(const model::Recompute& r) const { return recomputable && r.covers(kind); }
};

struct ModelCosts {
    std::vector<BlockCost> blocks;   // two per layer
    std::vector<std::string> kinds;  // each block's (Model::block_kinds)
    double head_flops = 0;           // embedding and head, forward per token
    struct UnitBytes {
        double params = 0, grads = 0, expert_params = 0, expert_grads = 0;  // as held; gradients f32
    };
    std::vector<UnitBytes> units_bytes;  // per FSDP unit (Model::param_units)
    std::vector<int> unit_slot;          // its gather slot
    std::vector<int> block_unit;         // the unit of each block (−1: none)
    int embed_unit = -1, head_unit = -1;
    int64_t moe_layers = 0, units = 0;
    double dense_param_bytes = 0, dense_grad_bytes = 0;  // whole model, as held
    double expert_param_bytes = 0, expert_grad_bytes = 0;
    double dense_grad_elements = 0, expert_grad_elements = 0;  // trained elements (gradient buffers), whole model
};

// One micro-batch of `tokens` tokens through one block on the busiest rank: forward and backward seconds at the
// device's rate for calls of that size (the routed experts' at the tokens the expert-parallel group routes over the
// whole expert set, × the busiest rank's skew), split by the measured forward share; and the routed experts' part.
struct BlockPass {
    double forward = 0, backward = 0;
    double expert_forward = 0, expert_backward = 0;  // of which the routed experts'
};

// Tensor parallelism's transfers per micro-batch of `tokens` on the group's link (T consecutive ranks), all blocking:
// an attention block's forward all-gathers its input rows and reduce-scatters its output ([tokens, d_model] f32, each
// rank sending (T − 1)/T of it), its backward gathers the input and the output's gradient and reduce-scatters the
// input's; a DSA layer's backward also all-reduces the indexer's teacher ([tokens, top-k] f32).
struct TensorComm {
    double collective = 0;  // one all-gather or reduce-scatter of the rows (both at the all-gather's rate)
    double teacher = 0;     // a DSA layer's all-reduce
    double forward(const BlockCost& b) const { return b.sliced ? 2 * collective : 0.0; }
    double backward(const BlockCost& b) const {
        return b.sliced ? 3 * collective + (b.kind == "dsa" ? teacher : 0) : 0;
    }
};

// Per MoE layer, each expert's share of the routed tokens ("uniform", "zipf:S" or a run's metrics.jsonl).
std::vector<std::vector<double>> expert_loads(const std::string& routing, int64_t experts);
// The busiest expert-parallel rank's routed tokens over the mean, averaged over the layers.
double imbalance(const std::vector<std::vector<double>>& loads, int64_t ep);
// The routing PlanOptions names, for this model's experts (none without MoE layers).
std::vector<std::vector<double>> loads_of(const train::RunConfig& cfg, const PlanOptions& o);
// The whole model's costs, or a pipeline stage's (its layers; the head on the last); tp: on a rank of a tensor group.
ModelCosts model_costs(const train::RunConfig& cfg, model::LayerRange layers = {}, int64_t tp = 1);
// A layout's stages' costs (one entry without stages), and one stage's data-parallel group (recompute checked).
std::vector<ModelCosts> stage_costs(const train::RunConfig& run, const Layout& l);
Layout stage_group(const std::vector<ModelCosts>& stages, const Layout& l);

// The terms, each in seconds (their formulas beside their definitions, costs.cpp):
double a2a_pass_seconds(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, double tokens, double skew);
double shard_seconds(const Cluster& cl,
                     const Layout& l,
                     Collective k,
                     double dense,
                     double expert,
                     double dense_calls,
                     double expert_calls);
double replica_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l);
double zero2_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l);
double optimizer_seconds(const ModelCosts& c, const train::RunConfig& cfg, const Cluster& cl, const Layout& l);
double offload_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l);
double page_in_seconds(const RankMemory& m, const train::RunConfig& cfg, const Cluster& cl, const Layout& l);
// The step with the weight budget's page-ins of the rank whose memory is m (StepTime::page_in, in the total).
void add_page_ins(StepTime& t, const RankMemory& m, const train::RunConfig& cfg, const Cluster& cl, const Layout& l);
double gradient_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l, double accumulation);
BlockPass block_pass(
    const Cluster::Device& dev, const BlockCost& b, double tokens, double ep, double skew, bool frozen_base, bool fsdp);
BlockPass rank_block_pass(const Cluster::Device& dev,
                          const BlockCost& b,
                          double tokens,
                          int64_t tp,
                          double ep,
                          double skew,
                          bool frozen_base,
                          bool fsdp);
TensorComm tensor_comm(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, double tokens);
double head_seconds(const Cluster::Device& dev, const ModelCosts& c, double tokens, bool frozen_base, bool fsdp);
double exchange_seconds(const train::RunConfig& cfg, const Cluster& cl, int64_t D);

// One data-parallel group's step (reforward: a stage before the last re-running its forwards), and a layout's.
StepTime step_time(const train::RunConfig& run,
                   const ModelCosts& c,
                   const std::vector<std::vector<double>>& loads,
                   const Cluster& cl,
                   const Layout& l,
                   bool reforward = false);
StepTime layout_step(const train::RunConfig& run,
                     const std::vector<ModelCosts>& stages,
                     const std::vector<std::vector<double>>& loads,
                     const Cluster& cl,
                     const Layout& l);

}  // namespace tessera::plan
