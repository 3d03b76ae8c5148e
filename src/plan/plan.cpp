// The planner (see plan.h). Formulas: spec/scale.md §2 (bytes per parameter: here the runtime's own groups), §6
// (all-to-all bytes: k·d per token each way, twice in training, three times with recompute; FSDP gathers), §7 (FLOPs
// per token: 3 × forward, 2 × for a frozen base, + 1 forward with recompute), §8 (per-op roofline at a measured
// fraction of peak, α-β links, the MoE imbalance factor of the busiest rank).
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "core/rng.h"
#include "model/inspect.h"
#include "model/model.h"
#include "parallel/mesh.h"
#include "train/pipeline.h"

namespace tessera::plan {

namespace {

// Per MoE layer, each expert's share of the routed tokens (any scale).
std::vector<std::vector<double>> expert_loads(const std::string& routing, int64_t experts) {
    const size_t E = size_t(experts);
    if (routing == "uniform") return {std::vector<double>(E, 1.0)};
    if (routing.rfind("zipf:", 0) == 0) {
        double s = 0;
        try {
            s = std::stod(routing.substr(5));
        } catch (const std::exception&) {
            s = -1;
        }
        TESSERA_CHECK(s >= 0 && s <= 8, "--routing {}: zipf:S needs an exponent S in [0, 8]", routing);
        // popularity rank i gets 1/(i+1)^s; the experts take the ranks in a fixed scrambled order (by a hash), so
        // the hot ones are not all on the first expert-parallel rank
        std::vector<size_t> order(E);
        std::iota(order.begin(), order.end(), size_t(0));
        std::sort(order.begin(), order.end(), [](size_t a, size_t b) { return mix64(a) < mix64(b); });
        std::vector<double> load(E);
        for (size_t i = 0; i < E; ++i) load[order[i]] = 1.0 / std::pow(double(i + 1), s);
        return {load};
    }
    // a run's metrics.jsonl: the mean load of each MoE layer over its last (up to 50) records
    std::ifstream in(routing);
    TESSERA_CHECK(in, "--routing {}: not uniform, zipf:S or a readable metrics.jsonl", routing);
    std::vector<Json> records;
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
        if (line.empty()) continue;
        Json r = Json::parse(line, nullptr, false);
        TESSERA_CHECK(r.is_object(), "{}:{}: not a JSON record", routing, n);
        if (r.contains("moe") && r["moe"].is_array()) records.push_back(std::move(r));
        if (records.size() > 50) records.erase(records.begin());
    }
    TESSERA_CHECK(!records.empty(), "--routing {}: no record holds MoE loads (a run of a MoE model?)", routing);
    std::vector<std::vector<double>> layers;
    for (const Json& r : records) {
        for (size_t l = 0; l < r["moe"].size(); ++l) {
            const Json& load = r["moe"][l]["load"];
            TESSERA_CHECK(load.is_array() && load.size() == E,
                          "--routing {}: layer {} holds {} expert loads, the model {}", routing, l,
                          load.is_array() ? load.size() : 0, E);
            if (layers.size() <= l) layers.emplace_back(E, 0.0);
            for (size_t e = 0; e < E; ++e) layers[l][e] += load[e].get<double>();
        }
    }
    return layers;
}

// The busiest expert-parallel rank's routed tokens over the mean (each rank holds E/ep consecutive experts), averaged
// over the layers: every layer's all-to-all waits for its busiest rank.
double imbalance(const std::vector<std::vector<double>>& loads, int64_t ep) {
    double sum = 0;
    for (const std::vector<double>& layer : loads) {
        const size_t per = layer.size() / size_t(ep);
        const double total = std::accumulate(layer.begin(), layer.end(), 0.0);
        double worst = 0;
        for (size_t r = 0; r < size_t(ep); ++r)
            worst = std::max(worst,
                             std::accumulate(layer.begin() + long(r * per), layer.begin() + long((r + 1) * per), 0.0));
        sum += total > 0 ? worst / (total / double(ep)) : 1.0;
    }
    return sum / double(loads.size());
}

double dtype_size(const std::string& dt) { return dt == "f32" ? 4.0 : dt == "bf16" ? 2.0 : 1.0; }

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

// The whole model's, or a pipeline stage's (its layers; the head on the last); tp: in tensor groups of tp ranks.
ModelCosts model_costs(const train::RunConfig& cfg, model::LayerRange layers = {}, int64_t tp = 1) {
    const std::unique_ptr<parallel::Mesh> group =
        tp > 1 ? parallel::Mesh::layout(int(tp), 0, 1, 0, 1, int(tp)) : nullptr;
    const model::Model m(cfg.model, nullptr, 1, layers, group ? group->tensor() : nullptr);  // specs only
    ModelCosts c;
    const auto& moe = cfg.model.moe;
    const int64_t seq = cfg.train.seq_len;
    double blocks = 0;
    for (size_t j = 0; j < m.block_kinds().size(); ++j) {
        const std::string& kind = m.block_kinds()[j];
        const double f = m.block_forward_flops_per_token(j, seq);
        blocks += f;
        BlockCost b{kind, block_class(kind), f, 0};
        b.sliced = kind != "mlp" && kind != "moe";
        b.rank_flops = m.block_rank_flops_per_token(j, seq);
        if (kind == "moe") {
            const double width = double(moe.latent_dim > 0 ? moe.latent_dim : cfg.model.d_model);
            b.routed = double(moe.topk) * 6.0 * width * double(moe.ffn_dim);
            ++c.moe_layers;
        }
        c.blocks.push_back(b);
    }
    c.kinds = m.block_kinds();
    const std::vector<bool> recomputable = m.recomputed_blocks(model::Recompute::every());
    for (size_t j = 0; j < c.blocks.size(); ++j) c.blocks[j].recomputable = recomputable[j];
    c.head_flops = m.forward_flops_per_token(seq) - blocks;
    c.units = int64_t(m.param_units().size());  // FSDP's: one per block, the embedding, the head
    const auto params = [](const BufferSpec& s) { return double(s.nbytes()); };
    const auto grads = [](const BufferSpec& s) { return s.trainable ? double(s.shape.numel()) * 4.0 : 0.0; };
    for (const BufferSpec& s : m.param_specs()) {
        const bool expert = s.sharding == Sharding::expert;
        (expert ? c.expert_param_bytes : c.dense_param_bytes) += params(s);
        (expert ? c.expert_grad_bytes : c.dense_grad_bytes) += grads(s);
        if (s.trainable) (expert ? c.expert_grad_elements : c.dense_grad_elements) += double(s.shape.numel());
    }
    for (const model::ParamUnit& u : m.param_units()) {
        ModelCosts::UnitBytes& b = c.units_bytes.emplace_back();
        const auto add = [&](size_t first, size_t last, double& p, double& g) {
            for (size_t i = first; i < last; ++i) p += params(m.param_specs()[i]), g += grads(m.param_specs()[i]);
        };
        add(u.first, u.last, b.params, b.grads);
        add(u.frozen_first, u.frozen_last, b.params, b.grads);
        add(u.expert_first, u.expert_last, b.expert_params, b.expert_grads);
        add(u.frozen_expert_first, u.frozen_expert_last, b.expert_params, b.expert_grads);
        c.unit_slot.push_back(u.slot);
    }
    for (size_t j = 0; j < c.blocks.size(); ++j) c.block_unit.push_back(m.block_unit(j));
    c.embed_unit = m.embed_unit();
    c.head_unit = m.head_unit();
    return c;
}

// One pass (the forward's, or one of the backward's) of one MoE layer's exchange: dispatch and combine of k rows of the
// expert width for each of `tokens` tokens, the remote share, received by the busiest rank (× imbalance); ep_chunks
// messages to each peer each way.
double a2a_pass_seconds(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, double tokens, double skew) {
    if (l.ep == 1) return 0.0;
    const double ep = double(l.ep), chunks = double(std::max<int64_t>(1, cfg.parallel.ep_chunks));
    const double width = double(cfg.model.moe.latent_dim > 0 ? cfg.model.moe.latent_dim : cfg.model.d_model);
    const double bytes =
        tokens * 2.0 * double(cfg.model.moe.topk) * width * dtype_size(cl.device.compute_dtype) * (ep - 1) / ep * skew;
    return cl.link_for(l.ep).seconds(Collective::all_to_all, l.ep, bytes, 2.0 * chunks * (ep - 1));
}

// FSDP's or ZeRO-2's transfers of parameters (all-gathers) or gradients (reduce-scatters): `dense` bytes (as held,
// whole) over the S ranks that shard them (every rank, or HSDP's shard group of consecutive ranks) on the link that
// holds such a group, `expert` bytes (this rank's experts, as held) over the expert-data group on the link for every
// rank, in `dense_calls` and `expert_calls` collectives (one message to each peer each).
double shard_seconds(const Cluster& cl,
                     const Layout& l,
                     Collective k,
                     double dense,
                     double expert,
                     double dense_calls,
                     double expert_calls) {
    const double S = double(l.shard_ranks()), edp = double(l.ranks) / double(l.ep);
    double t =
        dense > 0 && S > 1
            ? cl.link_for(l.shard_ranks()).seconds(k, l.shard_ranks(), dense * (S - 1) / S, dense_calls * (S - 1))
            : 0.0;
    if (edp > 1 && expert > 0)
        t += cl.link_for(l.ranks).seconds(k, l.ranks / l.ep, expert * (edp - 1) / edp, expert_calls * (edp - 1));
    return t;
}

// HSDP, after the last micro-batch: the shard groups' sums of the dense gradient all-reduced over the replica group
// (W / S ranks, one at each shard group's same place: spread over the cluster): a reduce-scatter and broadcasts of the
// rank's range, 1/S of the dense gradient.
double replica_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l) {
    const int64_t S = l.shard_ranks(), R = l.ranks / S;
    if (!l.fsdp || R <= 1) return 0.0;
    const double range = c.dense_grad_bytes / double(S), moved = range * double(R - 1) / double(R);
    const Link& link = cl.link_for(l.ranks);
    return link.seconds(Collective::reduce_scatter, R, moved, double(R - 1)) +
           link.seconds(Collective::all_gather, R, moved, double(R - 1));
}

// ZeRO-2, after the last micro-batch: the summed gradient reduce-scattered and the updated parameters all-gathered,
// the dense ones over every rank, this rank's experts over the expert-data group.
double zero2_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l) {
    const double ep = double(l.ep);
    return shard_seconds(cl, l, Collective::reduce_scatter, c.dense_grad_bytes, c.expert_grad_bytes / ep, 1, 1) +
           shard_seconds(cl, l, Collective::all_gather, c.dense_param_bytes, c.expert_param_bytes / ep, 1, 1);
}

// The elements AdamW updates on a rank: its range of the dense ones (over the shard group), and of the experts.
double updated_elements(const ModelCosts& c, const Layout& l) {
    return c.dense_grad_elements / double(l.shard_ranks()) + c.expert_grad_elements / double(l.ranks);
}

// The step's optimizer (trainer.cpp): the gradient norm reads the gradient, clipping rescales it, AdamW reads
// parameter, gradient, m and v and writes parameter, m and v (f32) of this rank's ranges: 40 bytes per element (32
// unclipped).
double optimizer_seconds(const ModelCosts& c, const train::RunConfig& cfg, const Cluster& cl, const Layout& l) {
    return updated_elements(c, l) * (cfg.train.grad_clip > 0 ? 40.0 : 32.0) / cl.device.memory_bandwidth;
}

// Optimizer offload (train/optimizer.h): the update's extra time for streaming this rank's m and v (f32 each) through
// their file, at the rate `tessera calibrate` measures as the offloaded update's extra seconds per moment byte.
double offload_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l) {
    if (!l.offload) return 0;
    TESSERA_CHECK(cl.host.offload_bandwidth > 0,
                  "{}: no host.offload_bandwidth_gbs, so optimizer offload is not priced", cl.name);
    return updated_elements(c, l) * 8.0 / cl.host.offload_bandwidth;
}

// Each micro-batch clears this rank's gradient buffers (4 bytes per element) and, accumulating without FSDP (whose
// reduce-scatter does the sum), adds them into the step's sum (reads two, writes one: 12 bytes).
double gradient_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l, double accumulation) {
    const double local = c.dense_grad_elements + c.expert_grad_elements / double(l.ep);
    const bool adding = accumulation > 1 && !(l.fsdp && l.ranks > 1);
    return accumulation * local * (4.0 + (adding ? 12.0 : 0.0)) / cl.device.memory_bandwidth;
}

// One micro-batch of `tokens` tokens through one block on the busiest rank: forward and backward seconds at the
// device's rate for calls of that size (the routed experts' at the tokens the expert-parallel group routes over the
// whole expert set, × the busiest rank's skew), split by the measured forward share; and the routed experts' part.
struct BlockPass {
    double forward = 0, backward = 0;
    double expert_forward = 0, expert_backward = 0;  // of which the routed experts'
};
BlockPass block_pass(const Cluster::Device& dev,
                     const BlockCost& b,
                     double tokens,
                     double ep,
                     double skew,
                     bool frozen_base,
                     bool fsdp) {
    const auto both = [&](OpClass cls, double flops, double n) {  // (slower beside FSDP's transfers, as measured)
        return 3.0 * tokens * flops / (dev.peak() * dev.efficiency_at(cls, n)) *
               (fsdp ? dev.beside_fsdp_factor(cls) : 1.0);
    };
    const double dense = both(b.cls, b.flops - b.routed, tokens);
    const double routed = b.routed > 0 ? both(OpClass::grouped_gemm, b.routed, tokens * ep) * skew : 0.0;
    const double fd = dev.forward_fraction(b.cls), fr = dev.forward_fraction(OpClass::grouped_gemm);
    const double bwd = frozen_base ? 0.5 : 1.0;  // a frozen base: input gradients only, half the backward's FLOPs
    BlockPass p;
    p.forward = fd * dense + fr * routed;
    p.backward = bwd * ((1 - fd) * dense + (1 - fr) * routed);
    p.expert_forward = fr * routed;
    p.expert_backward = bwd * (1 - fr) * routed;
    return p;
}

// The same on one rank of a tensor group of tp that shares the micro-batch's `tokens` (model/layers/tensor_slice.h): an
// attention block runs all of them through its part (1/tp of the heads, and what every rank computes whole: input
// norm, latent down-projections, the DSA indexer; BlockCost::rank_flops), any other block 1/tp of them.
BlockPass rank_block_pass(const Cluster::Device& dev,
                          const BlockCost& b,
                          double tokens,
                          int64_t tp,
                          double ep,
                          double skew,
                          bool frozen_base,
                          bool fsdp) {
    if (tp == 1 || !b.sliced) return block_pass(dev, b, tokens / double(tp), ep, skew, frozen_base, fsdp);
    BlockCost part = b;
    part.flops = b.rank_flops;
    return block_pass(dev, part, tokens, ep, skew, frozen_base, fsdp);
}

// Tensor parallelism's transfers per micro-batch of `tokens` on the group's link (T consecutive ranks), all blocking:
// an attention block's forward all-gathers its input rows and reduce-scatters its output ([tokens, d_model] f32, each
// rank sending (T − 1)/T of it), its backward gathers the input and the output's gradient and reduce-scatters the
// input's; a DSA layer's backward also all-reduces the indexer's teacher ([tokens, top-k] f32).
struct TensorComm {
    double collective = 0;  // one all-gather or reduce-scatter of the rows
    double teacher = 0;     // a DSA layer's all-reduce
    double forward(const BlockCost& b) const { return b.sliced ? 2 * collective : 0.0; }
    double backward(const BlockCost& b) const {
        return b.sliced ? 3 * collective + (b.kind == "dsa" ? teacher : 0) : 0;
    }
};
TensorComm tensor_comm(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, double tokens) {
    TensorComm t;
    if (l.tp == 1) return t;
    const double T = double(l.tp), rows = tokens * double(cfg.model.d_model) * 4.0 * (T - 1) / T;
    const Link& link = cl.link_for(l.tp);
    t.collective = link.seconds(Collective::all_gather, l.tp, rows, T - 1);
    const double teacher = tokens * double(cfg.model.mla.dsa.topk) * 4.0 * (T - 1) / T;
    t.teacher = link.seconds(Collective::reduce_scatter, l.tp, teacher, T - 1) +
                link.seconds(Collective::all_gather, l.tp, teacher, T - 1);
    return t;
}

// The embedding and head of one micro-batch (at the GEMM rate), forward + backward.
double head_seconds(const Cluster::Device& dev, const ModelCosts& c, double tokens, bool frozen_base, bool fsdp) {
    return (frozen_base ? 2.0 : 3.0) * tokens * c.head_flops / (dev.peak() * dev.efficiency_at(OpClass::gemm, tokens)) *
           (fsdp ? dev.beside_fsdp_factor(OpClass::gemm) : 1.0);
}

// One data-parallel group's step (a layout without pipeline stages, or one stage's: reforward, a stage before the last,
// re-runs every block's forward before its backward, train/pipeline.h).
StepTime step_time(const train::RunConfig& run,
                   const ModelCosts& c,
                   const std::vector<std::vector<double>>& loads,
                   const Cluster& cl,
                   const Layout& l,
                   bool reforward = false) {
    const train::RunConfig cfg = with_layout(run, l);
    const double forwards = reforward ? 2.0 : 1.0;  // a block's forwards before its backward
    const int groups = int(l.data_groups());        // the ranks (tensor groups) taking micro-batches of their own
    const double ep = double(l.ep);
    const double micro_tokens = double(cfg.train.micro_batch(groups) * cfg.train.seq_len);  // a tensor group's
    const double rows = micro_tokens / double(l.tp);                                        // one rank's of them
    const double accumulation = double(cfg.train.accumulation(groups));
    const TensorComm tc = tensor_comm(cfg, cl, l, micro_tokens);
    const bool frozen_base = cfg.model.lora.enabled();
    StepTime t;
    t.imbalance = loads.empty() ? 1.0 : imbalance(loads, l.ep);
    // per micro-batch: every block forward and backward, the recomputed ones' forward once more, the head
    const bool fsdp = l.ranks > 1 && l.fsdp;  // (its transfers run beside the blocks)
    for (const BlockCost& b : c.blocks) {
        const BlockPass p = rank_block_pass(cl.device, b, micro_tokens, l.tp, ep, t.imbalance, frozen_base, fsdp);
        const double again = forwards + (b.reruns(l.recompute) ? 1.0 : 0.0);
        t.compute += accumulation * (p.forward * again + p.backward);
        t.expert_compute += accumulation * (p.expert_forward * again + p.expert_backward);
        t.tensor += accumulation * (tc.forward(b) * again + tc.backward(b));
    }
    t.compute += accumulation * head_seconds(cl.device, c, rows, frozen_base, fsdp);
    if (l.ep > 1 && c.moe_layers > 0) {
        // every MoE layer of every micro-batch: forward and backward (+ recompute)
        double passes = 0;  // forward and backward of every MoE layer, and the recomputed ones' forward again
        for (const BlockCost& b : c.blocks)
            if (b.kind == "moe") passes += forwards + 1.0 + (b.reruns(l.recompute) ? 1.0 : 0.0);
        t.a2a = a2a_pass_seconds(cfg, cl, l, rows, t.imbalance) * passes * accumulation;
        // chunked overlap: the first chunk's exchange is exposed, the rest hides behind the other chunks' experts
        const double chunks = double(std::max<int64_t>(1, cfg.parallel.ep_chunks));
        t.a2a_exposed = t.a2a / chunks + std::max(0.0, (t.a2a - t.expert_compute) * (chunks - 1) / chunks);
    }
    if (fsdp) {
        // every micro-batch gathers each unit twice (forward, backward; a stage before the last thrice) and
        // reduce-scatters its gradient: one collective per unit over every rank, and one per MoE layer for its experts
        // over the expert-data group
        const double units = double(c.units), moe = double(c.moe_layers), visits = forwards + 1.0;
        const double gathers = shard_seconds(cl, l, Collective::all_gather, visits * c.dense_param_bytes,
                                             visits * c.expert_param_bytes / ep, visits * units, visits * moe);
        const double scatters =
            shard_seconds(cl, l, Collective::reduce_scatter, c.dense_grad_bytes, c.expert_grad_bytes / ep, units, moe);
        t.fsdp = accumulation * (gathers + scatters);
        // the next unit's gather arrives while this one computes: the first is exposed, the rest beyond compute
        t.fsdp_exposed = t.fsdp / double(c.units) + std::max(0.0, t.fsdp - t.compute);
        t.grad_sync = replica_seconds(c, cl, l);
    } else if (l.ranks > 1) {
        t.grad_sync = zero2_seconds(c, cl, l);
    }
    t.optimizer = optimizer_seconds(c, cfg, cl, l);
    t.offload = offload_seconds(c, cl, l);
    t.gradients = gradient_seconds(c, cl, l, accumulation);
    t.total =
        t.compute + t.a2a_exposed + t.fsdp_exposed + t.grad_sync + t.optimizer + t.offload + t.gradients + t.tensor;
    return t;
}

// The stages' costs of a layout (one entry without pipeline stages).
std::vector<ModelCosts> stage_costs(const train::RunConfig& run, const Layout& l) {
    const train::RunConfig cfg = with_layout(run, l);
    std::vector<ModelCosts> out;
    for (int64_t s = 0; s < l.pp; ++s)
        out.push_back(
            model_costs(cfg, l.pp > 1 ? cfg.parallel.stage_layers(s, cfg.model.n_layers) : model::LayerRange{}, l.tp));
    return out;
}

// One pipeline stage's data-parallel group (every rank without stages), and the layout's recompute checked against the
// whole model's block kinds (every stage's).
Layout stage_group(const std::vector<ModelCosts>& stages, const Layout& l) {
    std::vector<std::string> kinds;
    for (const ModelCosts& c : stages) kinds.insert(kinds.end(), c.kinds.begin(), c.kinds.end());
    l.recompute.check(kinds);
    Layout group = l;
    group.ranks = l.stage_ranks();
    group.pp = 1;
    group.split.clear();
    return group;
}

// One pipeline exchange of a micro-batch's activations ([tokens, d_model] f32, each way) on the link that spans a stage
// of D ranks and the next one's first.
double exchange_seconds(const train::RunConfig& cfg, const Cluster& cl, int64_t D) {
    const double bytes = double(cfg.train.micro_batch(int(D)) * cfg.train.seq_len * cfg.model.d_model) * 4.0;
    return cl.link_for(D + 1).seconds(Collective::all_to_all, 2, bytes, 1.0);
}

// A layout's step. With pipeline stages (train/pipeline.h, 1F1B over M micro-batches): each stage's group runs its
// layers as above (with parallel.pipeline_rerun the stages before the last forward twice), plus per micro-batch an
// exchange of the activations
// ([tokens, d_model] f32, each way) with each neighbour stage, on the link that spans the stage's ranks and the next
// one's first. A micro-batch's time u_s on stage s is its share of that; the first micro-batch crosses every stage and
// the other M − 1 follow at the slowest stage's pace: Σ u_s + (M − 1) max u_s. Then the slowest stage's gradient
// sync and optimizer. The breakdown is the slowest stage's; `bubble` is what the other stages add.
StepTime layout_step(const train::RunConfig& run,
                     const std::vector<ModelCosts>& stages,
                     const std::vector<std::vector<double>>& loads,
                     const Cluster& cl,
                     const Layout& l) {
    const Layout group = stage_group(stages, l);
    if (l.pp == 1) return step_time(run, stages.front(), loads, cl, l);
    const train::RunConfig cfg = with_layout(run, l);
    const double M = double(cfg.train.accumulation(int(group.data_groups())));
    const double exchange = exchange_seconds(cfg, cl, group.ranks);
    StepTime slowest, largest;  // the stage with the longest micro-batch; with the longest after the loop
    double sum_u = 0, max_u = -1, max_after = -1;
    for (size_t s = 0; s < stages.size(); ++s) {
        StepTime t = step_time(run, stages[s], loads, cl, group, l.rerun && s + 1 < stages.size());
        t.p2p = M * exchange * double((s > 0) + (s + 1 < stages.size()));
        const double u = (t.compute + t.a2a_exposed + t.fsdp_exposed + t.gradients + t.p2p + t.tensor) / M;
        const double after = t.grad_sync + t.optimizer + t.offload;
        sum_u += u;
        if (u > max_u) max_u = u, slowest = t;
        if (after > max_after) max_after = after, largest = t;
    }
    slowest.grad_sync = largest.grad_sync;
    slowest.optimizer = largest.optimizer;
    slowest.offload = largest.offload;
    slowest.bubble = sum_u - max_u;
    slowest.total = sum_u + (M - 1.0) * max_u + max_after;
    return slowest;
}

std::vector<std::vector<double>> loads_of(const train::RunConfig& cfg, const PlanOptions& o) {
    return cfg.model.moe.experts > 0 ? expert_loads(o.routing, cfg.model.moe.experts)
                                     : std::vector<std::vector<double>>{};
}

}  // namespace

StepTime predict_step(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, const PlanOptions& o) {
    return layout_step(cfg, stage_costs(cfg, l), loads_of(cfg, o), cl, l);
}

namespace {

// The simulation's Chrome trace: one process per pipeline stage (one without stages), each with a compute track, a
// communication track (FSDP's transfers, the all-to-alls) and, with stages, the exchanges with the neighbour stages.
struct Trace {
    Json events = Json::array();
    void span(const std::string& name, const char* cat, int pid, int tid, double t0, double dur, int64_t layer) {
        Json e = {{"name", name}, {"cat", cat},     {"ph", "X"},       {"pid", pid},
                  {"tid", tid},   {"ts", t0 * 1e6}, {"dur", dur * 1e6}};
        if (layer >= 0) e["args"] = {{"layer", layer}};
        events.push_back(std::move(e));
    }
};

// An exchange's span: with which stage, what it sends and receives (m: micro-batch m's activations; ∂m: their
// gradient), e.g. "stage 2: 3 out, ∂1 in".
std::string exchange_name(const train::PipelineOp& op, size_t with) {
    const char* out = op.next ? "" : "∂";  // (to the next stage go activations, to the one before gradients)
    const char* in = op.next ? "∂" : "";
    std::string name = fmt::format("stage {}:", with);
    if (op.send >= 0) name += fmt::format(" {}{} out", out, op.send);
    if (op.receive >= 0) name += fmt::format("{} {}{} in", op.send >= 0 ? "," : "", in, op.receive);
    return name;
}

// One stage's busiest rank (the whole model's without stages) in time: its passes over micro-batches on the compute
// track, and its transfers on the communication track (each MoE layer's all-to-all; FSDP's unit by unit as
// train/fsdp.h makes them). A pass's unit visits are the model's (Model::block_unit): the embedding's, each block's
// forward, the head's (forward and backward), each block's backward in reverse, the embedding's backward; a stage
// before the last runs the forward alone, then the backward alone (its activations kept) or the forward again and the
// backward (parallel.pipeline_rerun; Model::stage_forward, stage_backward). FSDP keeps each unit in its slot until
// another unit needs the slot: entering a visit issues the next visit's gather unless its unit is still in its slot,
// the visit waits for its own, and a unit's last backward visit of the pass reduce-scatters its gradient. The slots
// start empty (the optimizer step left them stale) and keep their units from one pass to the next.
class StageSim {
  public:
    // a micro-batch's forward and backward at once; a stage before the last: its forward, and later its backward
    // alone (its activations kept) or with the forward re-run first (parallel.pipeline_rerun)
    enum class Pass { whole, forward, backward, rerun_backward };

    // group: the stage's data-parallel layout (pp 1); micros: its micro-batches
    StageSim(Trace& trace,
             int pid,
             const train::RunConfig& cfg,
             const ModelCosts& c,
             const Cluster& cl,
             const Layout& group,
             double imbalance,
             int64_t micros)
        : trace_(trace), pid_(pid), cfg_(cfg), c_(c), cl_(cl), l_(group), fsdp_(group.ranks > 1 && group.fsdp) {
        // a tensor group's micro-batch, and this rank's rows of it
        const double tokens = double(cfg.train.micro_batch(int(group.data_groups())) * cfg.train.seq_len);
        const double rows = tokens / double(group.tp);
        const bool frozen_base = cfg.model.lora.enabled();
        for (const BlockCost& b : c.blocks)
            pass_.push_back(
                rank_block_pass(cl.device, b, tokens, group.tp, double(group.ep), imbalance, frozen_base, fsdp_));
        grads_ = gradient_seconds(c, cl, group, double(micros)) / double(micros);
        a2a_ = a2a_pass_seconds(cfg, cl, group, rows, imbalance);
        tensor_ = tensor_comm(cfg, cl, group, tokens);
        chunks_ = double(std::max<int64_t>(1, cfg.parallel.ep_chunks));
        head_ = head_seconds(cl.device, c, rows, frozen_base, fsdp_);
        head_forward_ = head_ / (frozen_base ? 2 : 3);
        ready_.assign(c.units_bytes.size(), 0.0);
    }

    double now = 0;  // the compute track's clock

    void run(Pass p) {
        const size_t B = c_.blocks.size();
        visits_.clear();
        if (p != Pass::backward) {
            visits_.push_back({c_.embed_unit, -1, false});
            for (size_t j = 0; j < B; ++j)
                visits_.push_back({c_.block_unit[j], int64_t(j), false, p == Pass::rerun_backward});
        }
        if (p == Pass::whole) visits_.push_back({c_.head_unit, -1, true, false, true});
        if (p != Pass::forward) {
            for (size_t j = B; j-- > 0;) visits_.push_back({c_.block_unit[j], int64_t(j), true});
            visits_.push_back({c_.embed_unit, -1, true});
            trace_.span("gradients (clear, accumulate)", "step", pid_, 0, now, grads_, -1);
            now += grads_;
        }
        last_backward_.assign(c_.units_bytes.size(), visits_.size());
        for (size_t v = 0; v < visits_.size(); ++v)
            if (visits_[v].unit >= 0 && visits_[v].backward) last_backward_[size_t(visits_[v].unit)] = v;
        for (size_t v = 0; v < visits_.size(); ++v) {
            const Visit& vis = visits_[v];
            gather(vis);  // (prefetched when the previous visit began, unless it was the first)
            if (v + 1 < visits_.size()) gather(visits_[v + 1]);
            if (fsdp_ && vis.unit >= 0) now = std::max(now, ready_[size_t(vis.unit)]);
            compute(vis);
            if (fsdp_ && vis.unit >= 0 && last_backward_[size_t(vis.unit)] == v)
                transfer("reduce-scatter " + unit_name(vis), now, unit_seconds(vis.unit, true), layer_of(vis));
        }
    }

    // the compute track waits (for a neighbour stage) from now until t
    void wait(double t, const std::string& why) {
        if (t > now) trace_.span(why, "bubble", pid_, 0, now, t - now, -1);
        now = std::max(now, t);
    }
    // an exchange with a neighbour stage, from `at` for `dur` (both sides blocked)
    void exchange(const std::string& name, double at, double dur) {
        trace_.span(name, "exchange", pid_, 2, at, dur, -1);
        now = at + dur;
    }

    // after the last micro-batch: FSDP's transfers drained, the gradient sync, the optimizer
    void finish() {
        if (fsdp_) now = std::max(now, comm_free_);
        if (fsdp_ && l_.shard_ranks() < l_.ranks)
            now = transfer("replica all-reduce of the dense gradient (HSDP)", now, replica_seconds(c_, cl_, l_), -1);
        if (l_.ranks > 1 && !l_.fsdp)
            now = transfer("gradient reduce-scatter + parameter all-gather (ZeRO-2)", now, zero2_seconds(c_, cl_, l_),
                           -1);
        const double opt = optimizer_seconds(c_, cfg_, cl_, l_);
        trace_.span("AdamW", "optimizer", pid_, 0, now, opt, -1);
        now += opt;
        if (l_.offload) {
            const double moments = offload_seconds(c_, cl_, l_);
            trace_.span("moments from and back to their file (offload)", "optimizer", pid_, 0, now, moments, -1);
            now += moments;
        }
    }

  private:
    struct Visit {
        int unit;
        int64_t block;  // −1: the embedding or the head
        bool backward;
        bool again = false;  // a block's forward run again before its backward (a stage before the last)
        bool head = false;
    };

    double transfer(const std::string& name, double at, double dur, int64_t layer) {
        const double t0 = std::max(at, comm_free_);
        trace_.span(name, "comm", pid_, 1, t0, dur, layer);
        comm_free_ = t0 + dur;
        return comm_free_;  // when it is done
    }
    // a unit's FSDP transfer, of its parameters or its gradient
    double unit_seconds(int u, bool grads) const {
        const ModelCosts::UnitBytes& b = c_.units_bytes[size_t(u)];
        return shard_seconds(cl_, l_, grads ? Collective::reduce_scatter : Collective::all_gather,
                             grads ? b.grads : b.params, (grads ? b.expert_grads : b.expert_params) / double(l_.ep), 1,
                             1);
    }
    // a sliced block's transfers over the tensor group (model/layers/tensor_slice.h): blocking, the compute track waits
    void tensor(double dur, int64_t layer) {
        if (dur <= 0) return;
        now = transfer("tensor all-gather / reduce-scatter", now, dur, layer);
    }
    std::string unit_name(const Visit& v) const {
        return v.block >= 0 ? c_.blocks[size_t(v.block)].kind : v.head ? "head" : "embedding";
    }
    static int64_t layer_of(const Visit& v) { return v.block >= 0 ? v.block / 2 : int64_t(-1); }
    void gather(const Visit& v) {  // unless the unit is in its slot
        if (!fsdp_ || v.unit < 0) return;
        int& in = occupant_[size_t(c_.unit_slot[size_t(v.unit)])];
        if (in == v.unit) return;
        in = v.unit;
        ready_[size_t(v.unit)] = transfer("gather " + unit_name(v), now, unit_seconds(v.unit, false), layer_of(v));
    }
    void compute(const Visit& vis) {
        const int64_t layer = layer_of(vis);
        if (vis.head) {
            trace_.span("embedding+head", "forward", pid_, 0, now, head_forward_, -1);
            now += head_forward_;
            trace_.span("embedding+head", "backward", pid_, 0, now, head_ - head_forward_, -1);
            now += head_ - head_forward_;
            return;
        }
        if (vis.block < 0) return;
        const size_t j = size_t(vis.block);
        const std::string& kind = c_.blocks[j].kind;
        const bool moe = kind == "moe" && a2a_ > 0;
        if (!vis.backward) {
            tensor(tensor_.forward(c_.blocks[j]), layer);
            double d = pass_[j].forward;
            if (moe) {
                transfer("all-to-all", now, a2a_, layer);
                d += a2a_ / chunks_ + std::max(0.0, (a2a_ - pass_[j].expert_forward) * (chunks_ - 1) / chunks_);
            }
            trace_.span(kind, vis.again ? "reforward" : "forward", pid_, 0, now, d, layer);
            now += d;
            return;
        }
        const bool again = c_.blocks[j].reruns(l_.recompute);
        double extra = 0;
        if (moe) {
            const double passes = again ? 2.0 : 1.0;  // the backward's exchange (+ the recompute's)
            transfer("all-to-all", now, a2a_ * passes, layer);
            extra = (a2a_ * passes) / chunks_;
        }
        if (again) {
            tensor(tensor_.forward(c_.blocks[j]), layer);
            trace_.span(kind, "recompute", pid_, 0, now, pass_[j].forward, layer);
            now += pass_[j].forward;
        }
        tensor(tensor_.backward(c_.blocks[j]), layer);
        trace_.span(kind, "backward", pid_, 0, now, pass_[j].backward + extra, layer);
        now += pass_[j].backward + extra;
    }

    Trace& trace_;
    int pid_;
    const train::RunConfig& cfg_;
    const ModelCosts& c_;
    const Cluster& cl_;
    Layout l_;
    bool fsdp_;
    std::vector<BlockPass> pass_;
    double grads_ = 0, a2a_ = 0, chunks_ = 1, head_ = 0, head_forward_ = 0;
    TensorComm tensor_;
    double comm_free_ = 0;
    std::array<int, 3> occupant_{-1, -1, -1};
    std::vector<double> ready_;
    std::vector<Visit> visits_;
    std::vector<size_t> last_backward_;
};

}  // namespace

Simulation simulate(const train::RunConfig& run, const Cluster& cl, const Layout& l, const PlanOptions& o) {
    const std::vector<ModelCosts> stages = stage_costs(run, l);
    const Layout group = stage_group(stages, l);
    const train::RunConfig cfg = with_layout(run, l);
    const auto loads = loads_of(cfg, o);
    const double I = loads.empty() ? 1.0 : imbalance(loads, l.ep);
    const int64_t M = cfg.train.accumulation(int(group.data_groups()));
    const int64_t P = l.pp;
    Trace trace;
    std::vector<StageSim> sims;
    sims.reserve(size_t(P));
    for (int64_t s = 0; s < P; ++s) sims.emplace_back(trace, int(s), cfg, stages[size_t(s)], cl, group, I, M);
    using Pass = StageSim::Pass;
    if (P == 1) {
        for (int64_t m = 0; m < M; ++m) sims[0].run(Pass::whole);
    } else {
        // 1F1B (train/pipeline.h): each stage walks its schedule; an exchange starts when both neighbours reach it
        // (parallel::exchange is pairwise and blocking) and takes the activations' time on the link that spans the two
        // stages' ranks, as the planner prices it; the stage that came first waits, a bubble on its compute track
        const double exchange = exchange_seconds(cfg, cl, group.ranks);
        std::vector<std::vector<train::PipelineOp>> ops;
        for (int64_t s = 0; s < P; ++s) ops.push_back(train::one_f_one_b(s, P, M));
        std::vector<size_t> at(size_t(P), 0);
        using K = train::PipelineOp::Kind;
        for (bool moved = true; moved;) {
            moved = false;
            for (size_t s = 0; s < size_t(P); ++s) {
                for (; at[s] < ops[s].size(); ++at[s], moved = true) {
                    const train::PipelineOp& op = ops[s][at[s]];
                    if (op.kind == K::load) continue;
                    if (op.kind != K::exchange) {
                        sims[s].run(op.kind == K::forward    ? Pass::forward
                                    : op.kind == K::backward ? (l.rerun ? Pass::rerun_backward : Pass::backward)
                                                             : Pass::whole);
                        continue;
                    }
                    const size_t n = op.next ? s + 1 : s - 1;  // the neighbour: at the matching exchange yet?
                    if (at[n] >= ops[n].size() || ops[n][at[n]].kind != K::exchange || ops[n][at[n]].next == op.next)
                        break;
                    const double start = std::max(sims[s].now, sims[n].now);
                    for (const size_t who : {s, n}) {
                        const train::PipelineOp& mine = ops[who][at[who]];
                        const size_t other = who == s ? n : s;
                        sims[who].wait(start, fmt::format("wait for stage {}", other));
                        sims[who].exchange(exchange_name(mine, other), start, exchange);
                    }
                    ++at[n];
                }
            }
        }
        for (size_t s = 0; s < size_t(P); ++s)
            TESSERA_CHECK(at[s] == ops[s].size(), "simulate: the 1F1B schedule of stage {} does not finish", s);
    }
    double end = 0;
    for (StageSim& sim : sims) {
        sim.finish();
        end = std::max(end, sim.now);
    }
    Json meta = Json::array();
    for (int64_t s = 0; s < P; ++s) {
        std::string pname = fmt::format("{}: busiest rank, {}", cl.name, l.str());
        if (P > 1) {
            const model::LayerRange r = cfg.parallel.stage_layers(s, cfg.model.n_layers);
            pname = fmt::format("stage {} (layers {}–{}): busiest rank, {}", s, r.first, r.last - 1, l.str());
        }
        const int pid = int(s);
        meta.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", pname}}}});
        meta.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
        for (const auto& [tid, name] : std::vector<std::pair<int, const char*>>{
                 {0, "compute"}, {1, "communication"}, {2, "exchanges with the neighbour stages"}}) {
            if (tid == 2 && P == 1) continue;
            meta.push_back(
                {{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}});
        }
    }
    for (Json& e : trace.events) meta.push_back(std::move(e));
    return {Json{{"traceEvents", meta}, {"displayTimeUnit", "ms"}}.dump() + "\n", end};
}

int64_t plan_ranks(const train::RunConfig& cfg, const Cluster& cl, int64_t ranks) {
    const int64_t W = ranks > 0 ? ranks : cl.devices;
    TESSERA_CHECK(W <= cl.devices, "plan: {} ranks but the cluster {} has {} devices", W, cl.name, cl.devices);
    TESSERA_CHECK(cfg.train.batch_size % W == 0,
                  "plan: train.batch_size {} does not split over {} ranks (a multiple of them)", cfg.train.batch_size,
                  W);
    return W;
}

namespace {
// train.recompute's choices: off, and every combination of the kinds with more than one block (the last block of a
// kind is never re-run, so recomputing a kind with one block changes nothing); all of them is `true`
std::vector<model::Recompute> recompute_choices(const ModelCosts& c) {
    std::vector<std::string> kinds;
    for (const BlockCost& b : c.blocks)
        if (b.recomputable && std::find(kinds.begin(), kinds.end(), b.kind) == kinds.end()) kinds.push_back(b.kind);
    std::vector<model::Recompute> out;
    for (uint32_t mask = 0; mask < (1u << kinds.size()); ++mask) {
        std::vector<std::string> some;
        for (size_t i = 0; i < kinds.size(); ++i)
            if (mask >> i & 1) some.push_back(kinds[i]);
        out.push_back(some.size() == kinds.size() && !some.empty() ? model::Recompute::every()
                                                                   : model::Recompute::of(some));
    }
    return out;
}

// The split of L layers into P stages that balances their work per micro-batch: block forward FLOPs per token, × 3
// (forward and backward; × 4 on a stage before the last that re-runs its forward) and on the last the head's too
// (3 × its forward); the largest stage's work minimised (dynamic programming over contiguous cuts). Returns the first
// layer of each stage after the first.
std::vector<int64_t> balanced_split(const ModelCosts& whole, int64_t P, bool rerun) {
    const size_t L = whole.blocks.size() / 2;
    std::vector<double> prefix(L + 1, 0.0);
    for (size_t l = 0; l < L; ++l)
        prefix[l + 1] = prefix[l] + whole.blocks[2 * l].flops + whole.blocks[2 * l + 1].flops;
    auto cost = [&](size_t i, size_t j, bool last) {
        return (last || !rerun ? 3.0 : 4.0) * (prefix[j] - prefix[i]) + (last ? 3.0 * whole.head_flops : 0.0);
    };
    const double inf = std::numeric_limits<double>::infinity();
    // best[s][j]: the least largest work of stages 0..s over layers [0, j); from[s][j]: stage s's first layer
    std::vector<std::vector<double>> best(size_t(P), std::vector<double>(L + 1, inf));
    std::vector<std::vector<size_t>> from(size_t(P), std::vector<size_t>(L + 1, 0));
    for (size_t j = 1; j <= L; ++j) best[0][j] = cost(0, j, P == 1);
    for (size_t st = 1; st < size_t(P); ++st)
        for (size_t j = st + 1; j <= L; ++j)
            for (size_t i = st; i < j; ++i) {
                const double w = std::max(best[st - 1][i], cost(i, j, st + 1 == size_t(P)));
                if (w < best[st][j]) best[st][j] = w, from[st][j] = i;
            }
    std::vector<int64_t> split(size_t(P - 1));
    for (size_t st = size_t(P) - 1, j = L; st > 0; j = from[st][j], --st) split[st - 1] = int64_t(from[st][j]);
    return split;
}
}  // namespace

Plan make_plan(const train::RunConfig& cfg, const Cluster& cl, const PlanOptions& o) {
    TESSERA_CHECK(o.offload == "auto" || o.offload == "all" || o.offload == "off",
                  "plan: --offload {}: auto, all or off", o.offload);
    const int64_t W = plan_ranks(cfg, cl, o.ranks);
    const int64_t batch = cfg.train.batch_size;
    const int threads = o.threads > 0 ? o.threads : std::max<int>(1, int(cl.device.threads));
    Plan p;
    p.usable_bytes = cl.device.usable();
    p.tokens_per_step = batch * cfg.train.seq_len;
    p.routing = o.routing;
    const model::ModelSummary s = model::summarize(cfg.model, cfg.train.seq_len);
    p.params = double(s.params);
    p.active_params = s.active_params;
    p.train_flops_per_token = s.train_flops_per_token;
    const ModelCosts costs = model_costs(cfg);
    const std::vector<std::vector<double>> loads = loads_of(cfg, o);
    const std::vector<model::Recompute> choices = recompute_choices(costs);
    const int64_t experts = cfg.model.moe.experts;
    std::vector<int64_t> eps = {1};
    for (int64_t e = 2; e <= W; ++e)
        if (W % e == 0 && experts > 0 && experts % e == 0) eps.push_back(e);
    // FSDP over every rank, or HSDP over groups of s·2^k consecutive ranks (s: the innermost link level's span, or 2
    // on a one-level cluster) that divide W: fewer ranks per collective, more of the dense state per rank
    std::vector<int64_t> shards = {0};
    const int64_t inner = cl.links.size() > 1 && cl.links.front().span > 1 ? cl.links.front().span : 2;
    for (int64_t S = inner; S < W; S *= 2)
        if (W % S == 0) shards.push_back(S);
    struct Sharding {
        bool fsdp;
        int64_t shard;
    };
    // pipeline stages: every divisor P of W up to the layers (PlanOptions::pipeline), keeping the activations of the
    // micro-batches in flight or re-running their forwards, each with the split that balances the stages' work
    // (balanced_split; written into the config, empty where it is the runtime's even one)
    struct Stages {
        int64_t pp;
        bool rerun;
        std::vector<int64_t> split;
        std::vector<ModelCosts> costs;
    };
    std::vector<Stages> stagings{{1, false, {}, {costs}}};
    const bool cuttable = o.pipeline && !model::pipeline_obstacle(cfg.model);
    for (int64_t P = 2; P <= std::min<int64_t>(W, cfg.model.n_layers) && cuttable; ++P) {
        if (W % P != 0) continue;
        for (const bool rerun : {false, true}) {
            std::vector<int64_t> split = balanced_split(costs, P, rerun);
            train::ParallelConfig even;  // the runtime's default split
            even.pipeline = P;
            bool same = true;
            for (int64_t st = 1; st < P; ++st)
                same = same && split[size_t(st - 1)] == even.stage_layers(st, cfg.model.n_layers).first;
            if (same) split.clear();
            const Stages& kept = stagings.back();  // (rerun: the same costs where the split is the same)
            std::vector<ModelCosts> per_stage = rerun && kept.pp == P && kept.split == split
                                                    ? kept.costs
                                                    : stage_costs(cfg, Layout{W, 1, true, 1, {}, 0, false, P, split});
            stagings.push_back({P, rerun, split, std::move(per_stage)});
        }
    }
    // a layout's candidates, one per recompute choice; whether every one of them fits
    auto evaluate = [&](const Layout& base, const std::vector<ModelCosts>& per_stage) {
        std::vector<Candidate> cs(choices.size());
        // in the first stage, the stage after it (it keeps the most inputs in flight) and the last (the head): the
        // first and the last rank (a contiguous cut puts the remainder at one end), and the one with the most moments
        // (a spread cut deals the leftover chunks in turn)
        const int64_t D = base.stage_ranks();
        std::vector<int> ranks;
        for (int64_t st : {int64_t(0), std::min<int64_t>(1, base.pp - 1), base.pp - 1})
            for (int64_t r : {st * D, st * D + D - 1})
                if (std::find(ranks.begin(), ranks.end(), int(r)) == ranks.end()) ranks.push_back(int(r));
        for (size_t k = 0; k < ranks.size(); ++k) {
            const int rank = ranks[k];
            std::vector<RankMemory> ms = predict_rank_memory(cfg, base, choices, rank, threads);
            if (const int most = ms.front().largest_state_rank;
                k == 0 && std::find(ranks.begin(), ranks.end(), most) == ranks.end())
                ranks.push_back(most);
            for (size_t i = 0; i < cs.size(); ++i) {
                Candidate& c = cs[i];
                c.rank_arena_bytes.emplace_back(rank, ms[i].arena_bytes);
                if (rank == 0 || ms[i].peak_bytes() > c.memory.peak_bytes()) {
                    c.memory = std::move(ms[i]);
                    c.memory_rank = rank;
                }
            }
        }
        bool all_fit = true;
        for (size_t i = 0; i < cs.size(); ++i) {
            Candidate& c = cs[i];
            c.layout = base;
            c.layout.recompute = choices[i];
            // offloaded moments live on the host's disk, every device's of the host
            const bool host_holds =
                cl.host.disk <= 0 || double(c.memory.offloaded_bytes) * double(cl.host.devices) <= cl.host.disk;
            c.fits = double(c.memory.peak_bytes()) <= p.usable_bytes && host_holds;
            all_fit = all_fit && c.fits;
            c.time = layout_step(cfg, per_stage, loads, cl, c.layout);
            const double tokens = double(p.tokens_per_step) / double(W);
            c.tokens_per_s_per_device = tokens / c.time.total;
            c.mfu = c.tokens_per_s_per_device * p.train_flops_per_token / cl.device.peak();
            p.candidates.push_back(std::move(c));
        }
        return all_fit;
    };
    // tensor groups (without pipeline stages, as the runtime): every divisor T of W within the innermost link level
    // (every rank on a one-level cluster) that divides the sequence and every attention kind's heads (a model with
    // something tensor parallelism does not cover gets none)
    std::vector<int64_t> tps = {1};
    std::map<int64_t, std::vector<ModelCosts>> tp_costs;  // the costs on a rank of a tensor group of T
    const int64_t tp_span = cl.links.size() > 1 && cl.links.front().span > 1 ? cl.links.front().span : W;
    for (int64_t T = 2; T <= std::min(W, tp_span) && o.tensor && !model::tensor_obstacle(cfg.model); ++T) {
        if (W % T != 0 || cfg.train.seq_len % T != 0 || (batch * T) % W != 0) continue;
        try {  // the model's own checks: the head counts divide
            tp_costs[T] = {model_costs(cfg, {}, T)};
            tps.push_back(T);
        } catch (const Error&) {
        }
    }
    for (const Stages& stages : stagings) {
        const int64_t D = W / stages.pp;  // a stage's ranks
        std::vector<Sharding> shardings;
        for (int64_t S : shards)
            if (S == 0 || (S < D && D % S == 0)) shardings.push_back({true, S});
        if (D > 1) shardings.push_back({false, 0});
        for (int64_t tp : tps) {
            if (stages.pp > 1 && tp > 1) continue;  // (not in the runtime yet)
            const int64_t G = D / tp;               // the tensor groups, each taking batch / G sequences
            for (int64_t ep : eps)
                for (const auto [fsdp, shard] : shardings)
                    for (int64_t micro = 1; micro <= batch / G; ++micro) {
                        if (D % ep != 0 || (batch / G) % micro != 0) continue;
                        // 1F1B needs micro-batches to fill the stages: at least as many as stages
                        if (stages.pp > 1 && batch / G / micro < stages.pp) continue;
                        Layout base{W, ep, fsdp, micro, {}, shard, false, stages.pp, stages.split, stages.rerun, tp};
                        // optimizer offload where the moments in the arena do not fit (it is never faster;
                        // PlanOptions::offload), and where the cluster says how fast it streams
                        const std::vector<ModelCosts>& per_stage = tp > 1 ? tp_costs[tp] : stages.costs;
                        const bool fits = evaluate(base, per_stage);
                        if (cl.host.offload_bandwidth > 0 && o.offload != "off" && (!fits || o.offload == "all")) {
                            base.offload = true;
                            evaluate(base, per_stage);
                        }
                    }
        }
    }
    std::stable_sort(p.candidates.begin(), p.candidates.end(), [](const Candidate& a, const Candidate& b) {
        if (a.fits != b.fits) return a.fits;
        return a.fits ? a.time.total < b.time.total : a.memory.peak_bytes() < b.memory.peak_bytes();
    });
    return p;
}

namespace {
std::string gb(double b) { return fmt::format("{:.1f}", b / 1e9); }
std::string ms(double s) { return fmt::format("{:.1f}", s * 1e3); }
// the table's memory unit: GB, or MB when every arena is below a GB
struct Unit {
    double bytes;
    const char* name;
    std::string operator()(double b) const { return fmt::format("{:.1f}", b / bytes); }
};
}  // namespace

std::string plan_report(const Plan& p, const Cluster& cl, size_t rows) {
    std::string s = fmt::format(
        "{:.4g}B parameters ({:.4g}B active per token), {} tokens per step; cluster {}: {} x {} ({:.0f} GB, {:.0f}% "
        "usable{}), {} at {:.4g} TFLOP/s; routing {}\n",
        p.params / 1e9, p.active_params / 1e9, p.tokens_per_step, cl.name, cl.devices, cl.device.name,
        cl.device.memory / 1e9, cl.device.usable_fraction * 100,
        cl.device.reserved > 0 ? fmt::format(" less {:.3g} GB reserved", cl.device.reserved / 1e9) : "",
        cl.device.compute_dtype, cl.device.peak() / 1e12, p.routing);
    size_t largest = 0;
    for (const Candidate& c : p.candidates) largest = std::max(largest, c.memory.peak_bytes());
    const Unit unit = largest >= size_t(1e9) ? Unit{1e9, "GB"} : Unit{1e6, "MB"};
    s += fmt::format(
        "memory is per device ({}: the busiest rank's arena, byte-exact from the runtime's buffer groups); time per "
        "step (ms)\n",
        unit.name);
    size_t width = 33;    // the layout column: its longest row
    bool staged = false;  // a pipeline column (exchanges and bubble) when a row has stages
    bool tensor = false;  // a tensor parallelism column (its transfers) when a row has tensor groups
    for (size_t i = 0; i < std::min(rows, p.candidates.size()); ++i) {
        width = std::max(width, p.candidates[i].layout.str().size());
        staged = staged || p.candidates[i].layout.pp > 1;
        tensor = tensor || p.candidates[i].layout.tp > 1;
    }
    s += fmt::format(
        "{:>3}  {:<{}} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>5}  {:>9} {:>8} {:>7} {:>7} {:>7}{}{} {:>10} "
        "{:>6}\n",
        "#", "layout", width, "memory", "params", "grads", "optim", "activ", "comm", "fits", "step", "compute", "a2a",
        "fsdp", "optim", staged ? fmt::format(" {:>7}", "pipe") : "", tensor ? fmt::format(" {:>7}", "tp") : "",
        "tok/s/dev", "MFU");
    for (size_t i = 0; i < std::min(rows, p.candidates.size()); ++i) {
        const Candidate& c = p.candidates[i];
        auto cat = c.memory.by_category();
        s += fmt::format(
            "{:>3}  {:<{}} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>5}  {:>9} {:>8} {:>7} {:>7} {:>7}{}{} {:>10.4g} "
            "{:>5.1f}%\n",
            i + 1, c.layout.str(), width, unit(double(c.memory.peak_bytes())), unit(double(cat["parameters"])),
            unit(double(cat["gradients"])), unit(double(cat["optimizer"])), unit(double(cat["activations"])),
            unit(double(cat["communication"] + cat["workspace"])), c.fits ? "yes" : "NO", ms(c.time.total),
            ms(c.time.compute), ms(c.time.a2a_exposed), ms(c.time.fsdp_exposed + c.time.grad_sync),
            ms(c.time.optimizer + c.time.offload + c.time.gradients),
            staged ? fmt::format(" {:>7}", ms(c.time.p2p + c.time.bubble)) : "",
            tensor ? fmt::format(" {:>7}", ms(c.time.tensor)) : "", c.tokens_per_s_per_device, c.mfu * 100);
    }
    if (!p.candidates.empty() && p.candidates.front().memory.mapped_bytes > 0) {
        const RankMemory& m = p.candidates.front().memory;
        s += fmt::format(
            "memory.weights_budget: {} {} of the frozen base read in place from its files, at most {} {} of it "
            "resident "
            "(the budget and the two largest units; in the memory column, not in params)\n",
            unit(double(m.mapped_bytes)), unit.name, unit(double(m.mapped_resident_bytes)), unit.name);
    }
    const bool ep =
        std::any_of(p.candidates.begin(), p.candidates.end(), [](const Candidate& c) { return c.layout.ep > 1; });
    if (ep && p.routing == "uniform")
        s += "routing uniform is expert parallelism's best case: in a run's first steps the busiest EP rank routed "
             "1.1-1.9x the mean (docs/plan.md); --routing RUN/metrics.jsonl prices a recorded load\n";
    if (!p.candidates.empty() && !p.candidates.front().fits) {
        const Candidate& c = p.candidates.front();  // the smallest
        auto cat = c.memory.by_category();
        const double states = double(c.memory.model_state_bytes()) * double(c.layout.ranks);
        const double rest = double(c.memory.peak_bytes() - c.memory.model_state_bytes());
        s += fmt::format(
            "no layout fits {} GB per device: the smallest ({}) needs {} GB: model states {} GB, activations {} GB, "
            "communication buffers {} GB\n",
            gb(p.usable_bytes), c.layout.str(), gb(double(c.memory.peak_bytes())),
            gb(double(c.memory.model_state_bytes())), gb(double(cat["activations"])), gb(double(cat["communication"])));
        if (p.usable_bytes > rest)
            s += fmt::format(
                "  more devices: the model states ({} GB in all) fit at about {:.0f} devices of this kind{}\n",
                gb(states), std::ceil(states / (p.usable_bytes - rest)), c.layout.offload ? ", with offload" : "");
        if (c.layout.offload)
            s += fmt::format(
                "  optimizer offload is in it: the AdamW moments, {} GB per device, in a file on the host ({} GB "
                "for its {} devices; {} GB of disk)\n",
                gb(double(c.memory.offloaded_bytes)), gb(double(c.memory.offloaded_bytes) * double(cl.host.devices)),
                cl.host.devices, gb(cl.host.disk));
        else if (cl.host.offload_bandwidth <= 0)
            s += "  optimizer offload is not searched: the cluster file gives no host.offload_bandwidth_gbs\n";
    }
    return s;
}

}  // namespace tessera::plan
