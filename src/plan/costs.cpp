// The planner's cost model (see costs.h). Formulas: spec/scale.md §2 (bytes per parameter: here the runtime's own
// groups), §6 (all-to-all bytes: k·d per token each way, twice in training, three times with recompute; FSDP gathers),
// §7 (FLOPs per token: 3 × forward, 2 × for a frozen base, + 1 forward with recompute), §8 (per-op roofline at a
// measured fraction of peak, α-β links, the MoE imbalance factor of the busiest rank).
#include "plan/costs.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "core/rng.h"
#include "model/model.h"
#include "parallel/mesh.h"

namespace tessera::plan {

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

namespace {
double dtype_size(const std::string& dt) { return dt == "f32" ? 4.0 : dt == "bf16" ? 2.0 : 1.0; }
}  // namespace

// The whole model's, or a pipeline stage's (its layers; the head on the last); tp: in tensor groups of tp ranks.
ModelCosts model_costs(const train::RunConfig& cfg, model::LayerRange layers, int64_t tp) {
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

namespace {
// The elements AdamW updates on a rank: its range of the dense ones (over the shard group), and of the experts.
double updated_elements(const ModelCosts& c, const Layout& l) {
    return c.dense_grad_elements / double(l.shard_ranks()) + c.expert_grad_elements / double(l.ranks);
}
}  // namespace

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

// The weight budget (memory.weights_budget, train/weight_budget.h): a micro-batch's forward visits the units in order
// and its backward in reverse (a recomputed block's forward runs inside its backward visit). Releasing
// the unit whose next use is farthest, each sweep finds the budget's worth of the base resident and reads the rest
// back: (mapped − budget) bytes a sweep (a budget below the two largest units: mapped − half of them, the unit in use
// and the next, which are never released), two sweeps a micro-batch, at the host's measured read rate (storage: a base
// that does not fit in a CPU device's memory does not fit in the page cache beside it either). Priced as not hidden:
// the prefetch thread reads the next unit while this one computes, but the budgeted runs of bench/RESULTS.md took
// longer than resident by more than their reads. Not priced: a step computes 8–12% slower on weights in the file
// mapping than in the arena on this machine, nothing released (bench/RESULTS.md).
double page_in_seconds(const RankMemory& m, const train::RunConfig& cfg, const Cluster& cl, const Layout& l) {
    if (l.weights_budget <= 0 || m.mapped_bytes == 0) return 0;
    TESSERA_CHECK(cl.host.read_bandwidth > 0,
                  "{}: no host.read_bandwidth_gbs, so memory.weights_budget's page-ins are not priced", cl.name);
    // (a budget below the two largest units still keeps the unit in use and the next: about half of them)
    const double kept = std::max(double(l.weights_budget) * double(1 << 20), double(m.mapped_floor_bytes) / 2);
    const double sweeps = 2.0 * double(with_layout(cfg, l).train.accumulation(int(l.data_groups())));
    return sweeps * std::max(0.0, double(m.mapped_bytes) - kept) / cl.host.read_bandwidth;
}

void add_page_ins(StepTime& t, const RankMemory& m, const train::RunConfig& cfg, const Cluster& cl, const Layout& l) {
    t.page_in = page_in_seconds(m, cfg, cl, l);
    t.total += t.page_in;
}

// Each micro-batch clears this rank's gradient buffers (4 bytes per element) and, accumulating without FSDP (whose
// reduce-scatter does the sum), adds them into the step's sum (reads two, writes one: 12 bytes).
double gradient_seconds(const ModelCosts& c, const Cluster& cl, const Layout& l, double accumulation) {
    const double local = c.dense_grad_elements + c.expert_grad_elements / double(l.ep);
    const bool adding = accumulation > 1 && !(l.fsdp && l.ranks > 1);
    return accumulation * local * (4.0 + (adding ? 12.0 : 0.0)) / cl.device.memory_bandwidth;
}

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
// norm, latent down-projections, the DSA indexer), any other block 1/tp of them. The part takes s + (1 − s) / tp of
// the whole block's time with s the measured Device::tensor_shared, else the part's FLOPs (BlockCost::rank_flops) at
// the class's rate.
BlockPass rank_block_pass(const Cluster::Device& dev,
                          const BlockCost& b,
                          double tokens,
                          int64_t tp,
                          double ep,
                          double skew,
                          bool frozen_base,
                          bool fsdp) {
    if (tp == 1 || !b.sliced) return block_pass(dev, b, tokens / double(tp), ep, skew, frozen_base, fsdp);
    const auto measured = dev.tensor_shared.find(b.cls);
    if (measured == dev.tensor_shared.end()) {  // the FLOPs' share
        BlockCost part = b;
        part.flops = b.rank_flops;
        return block_pass(dev, part, tokens, ep, skew, frozen_base, fsdp);
    }
    const double s = measured->second, share = s + (1.0 - s) / double(tp);
    BlockPass p = block_pass(dev, b, tokens, ep, skew, frozen_base, fsdp);  // the whole block on every token
    p.forward *= share;
    p.backward *= share;
    return p;
}

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
                   bool reforward) {
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

StepTime predict_step(const train::RunConfig& cfg, const Cluster& cl, const Layout& l, const PlanOptions& o) {
    StepTime t = layout_step(cfg, stage_costs(cfg, l), loads_of(cfg, o), cl, l);
    if (l.weights_budget > 0) add_page_ins(t, predict_rank_memory(cfg, l, 0, 1), cfg, cl, l);
    return t;
}

}  // namespace tessera::plan
