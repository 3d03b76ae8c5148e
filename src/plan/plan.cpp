// The planner (see plan.h): the layout search, the simulation and the report, on the cost model of plan/costs.h.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "core/check.h"
#include "core/json.h"
#include "model/inspect.h"
#include "model/model.h"
#include "parallel/mesh.h"
#include "plan/costs.h"
#include "train/pipeline.h"

namespace tessera::plan {

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

    // after the last micro-batch: FSDP's transfers drained, the gradient sync, the optimizer; and the weight budget's
    // page-ins over the step (costs.h: page_in_seconds; priced as not hidden, so laid at the end)
    void finish(double page_in) {
        if (page_in > 0) {
            trace_.span("the released base read back from storage (weight budget)", "weights", pid_, 0, now, page_in,
                        -1);
            now += page_in;
        }
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
    for (size_t s = 0; s < sims.size(); ++s) {
        const double page_in =
            l.weights_budget > 0
                ? page_in_seconds(predict_rank_memory(run, l, int(s * size_t(group.ranks)), 1), run, cl, l)
                : 0.0;
        sims[s].finish(page_in);
        end = std::max(end, sims[s].now);
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

// The largest weight budget (MiB) under which every rank predicted (its memory with the base read in place) fits in
// `usable` bytes: what is left beside the arena and the offloaded moments' resident window, less the two largest units
// the budget cannot go below; no more than the whole base (nothing is released then); at least 1 MiB (where that does
// not fit, the candidate does not).
int64_t largest_weights_budget(const std::vector<RankMemory>& ranks, double usable) {
    double left = std::numeric_limits<double>::infinity(), mapped = 0;
    for (const RankMemory& m : ranks) {
        left = std::min(left, usable - double(m.arena_bytes + m.offload_resident_bytes + m.mapped_floor_bytes));
        mapped = std::max(mapped, double(m.mapped_bytes));
    }
    const double mib = double(1 << 20);
    return int64_t(std::clamp(std::floor(left / mib), 1.0, std::max(1.0, std::ceil(mapped / mib))));
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
    // a layout's candidates, one per recompute choice; whether every one of them fits. fit_budget: the base read in
    // place (base.weights_budget > 0), each candidate with the largest budget that fits on every rank predicted
    auto evaluate = [&](const Layout& base, const std::vector<ModelCosts>& per_stage, bool fit_budget) {
        // in the first stage, the stage after it (it keeps the most inputs in flight) and the last (the head): the
        // first and the last rank (a contiguous cut puts the remainder at one end), and the one with the most moments
        // (a spread cut deals the leftover chunks in turn)
        const int64_t D = base.stage_ranks();
        std::vector<int> ranks;
        for (int64_t st : {int64_t(0), std::min<int64_t>(1, base.pp - 1), base.pp - 1})
            for (int64_t r : {st * D, st * D + D - 1})
                if (std::find(ranks.begin(), ranks.end(), int(r)) == ranks.end()) ranks.push_back(int(r));
        std::vector<std::vector<RankMemory>> per_rank(choices.size());  // per recompute choice, per rank
        for (size_t k = 0; k < ranks.size(); ++k) {
            std::vector<RankMemory> ms = predict_rank_memory(cfg, base, choices, ranks[k], threads);
            if (const int most = ms.front().largest_state_rank;
                k == 0 && std::find(ranks.begin(), ranks.end(), most) == ranks.end())
                ranks.push_back(most);
            for (size_t i = 0; i < choices.size(); ++i) per_rank[i].push_back(std::move(ms[i]));
        }
        bool all_fit = true;
        for (size_t i = 0; i < choices.size(); ++i) {
            if (fit_budget && per_rank[i].front().mapped_bytes == 0) continue;  // (nothing of the base read in place)
            Candidate c;
            c.layout = base;
            c.layout.recompute = choices[i];
            if (fit_budget) c.layout.weights_budget = largest_weights_budget(per_rank[i], p.usable_bytes);
            for (size_t k = 0; k < ranks.size(); ++k) {
                RankMemory& m = per_rank[i][k];
                if (fit_budget) m.set_weights_budget(size_t(c.layout.weights_budget) << 20);
                c.rank_arena_bytes.emplace_back(ranks[k], m.arena_bytes);
                if (k == 0 || m.peak_bytes() > c.memory.peak_bytes()) {
                    c.memory = std::move(m);
                    c.memory_rank = ranks[k];
                }
            }
            // offloaded moments live on the host's disk, every device's of the host
            const bool host_holds =
                cl.host.disk <= 0 || double(c.memory.offloaded_bytes) * double(cl.host.devices) <= cl.host.disk;
            c.fits = double(c.memory.peak_bytes()) <= p.usable_bytes && host_holds;
            all_fit = all_fit && c.fits;
            c.time = layout_step(cfg, per_stage, loads, cl, c.layout);
            add_page_ins(c.time, c.memory, cfg, cl, c.layout);
            const double tokens = double(p.tokens_per_step) / double(W);
            c.tokens_per_s_per_device = tokens / c.time.total;
            c.mfu = c.tokens_per_s_per_device * p.train_flops_per_token / cl.device.peak();
            p.candidates.push_back(std::move(c));
        }
        return all_fit;
    };
    // the weight budget (memory.weights_budget, CPU only): a LoRA base read in place, searched where it is not given,
    // for layouts that do not fit with the base in the arena, when the cluster says how fast storage reads it back
    const bool budget_searched = cfg.model.lora.enabled() && !cfg.train.base.empty() &&
                                 cfg.memory.weights_budget == 0 && cfg.train.device != "cuda" &&
                                 cl.host.read_bandwidth > 0;
    const auto with_budget = [](Layout l) {
        l.weights_budget = 1;  // (a budget: the base opened as read in place; its size is fitted per candidate)
        return l;
    };
    // tensor groups (without pipeline stages, as the runtime): every divisor T of W within a host and the innermost
    // link level (every rank on a one-level cluster) that divides the sequence and every attention kind's heads (a
    // model with something tensor parallelism does not cover gets none)
    std::vector<int64_t> tps = {1};
    std::map<int64_t, std::vector<ModelCosts>> tp_costs;  // the costs on a rank of a tensor group of T
    const int64_t tp_span =
        std::min(cl.host.devices, cl.links.size() > 1 && cl.links.front().span > 1 ? cl.links.front().span : W);
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
                        Layout base{W,     ep,        fsdp,         micro,        {}, shard,
                                    false, stages.pp, stages.split, stages.rerun, tp, cfg.memory.weights_budget};
                        // optimizer offload where the moments in the arena do not fit (it is never faster;
                        // PlanOptions::offload), and where the cluster says how fast it streams; the weight budget
                        // likewise, for each of them
                        const std::vector<ModelCosts>& per_stage = tp > 1 ? tp_costs[tp] : stages.costs;
                        const bool fits = evaluate(base, per_stage, false);
                        if (budget_searched && !fits) evaluate(with_budget(base), per_stage, true);
                        if (cl.host.offload_bandwidth > 0 && o.offload != "off" && (!fits || o.offload == "all")) {
                            base.offload = true;
                            if (!evaluate(base, per_stage, false) && budget_searched)
                                evaluate(with_budget(base), per_stage, true);
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
    bool budget = false;  // a page-in column (the weight budget's reads) when a row has a budget
    for (size_t i = 0; i < std::min(rows, p.candidates.size()); ++i) {
        width = std::max(width, p.candidates[i].layout.str().size());
        staged = staged || p.candidates[i].layout.pp > 1;
        tensor = tensor || p.candidates[i].layout.tp > 1;
        budget = budget || p.candidates[i].layout.weights_budget > 0;
    }
    s += fmt::format(
        "{:>3}  {:<{}} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>5}  {:>9} {:>8} {:>7} {:>7} {:>7}{}{}{} {:>10} "
        "{:>6}\n",
        "#", "layout", width, "memory", "params", "grads", "optim", "activ", "comm", "fits", "step", "compute", "a2a",
        "fsdp", "optim", staged ? fmt::format(" {:>7}", "pipe") : "", tensor ? fmt::format(" {:>7}", "tp") : "",
        budget ? fmt::format(" {:>7}", "page-in") : "", "tok/s/dev", "MFU");
    for (size_t i = 0; i < std::min(rows, p.candidates.size()); ++i) {
        const Candidate& c = p.candidates[i];
        auto cat = c.memory.by_category();
        s += fmt::format(
            "{:>3}  {:<{}} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>5}  {:>9} {:>8} {:>7} {:>7} {:>7}{}{}{} {:>10.4g} "
            "{:>5.1f}%\n",
            i + 1, c.layout.str(), width, unit(double(c.memory.peak_bytes())), unit(double(cat["parameters"])),
            unit(double(cat["gradients"])), unit(double(cat["optimizer"])), unit(double(cat["activations"])),
            unit(double(cat["communication"] + cat["workspace"])), c.fits ? "yes" : "NO", ms(c.time.total),
            ms(c.time.compute), ms(c.time.a2a_exposed), ms(c.time.fsdp_exposed + c.time.grad_sync),
            ms(c.time.optimizer + c.time.offload + c.time.gradients),
            staged ? fmt::format(" {:>7}", ms(c.time.p2p + c.time.bubble)) : "",
            tensor ? fmt::format(" {:>7}", ms(c.time.tensor)) : "",
            budget ? fmt::format(" {:>7}", ms(c.time.page_in)) : "", c.tokens_per_s_per_device, c.mfu * 100);
    }
    if (!p.candidates.empty() && p.candidates.front().memory.mapped_bytes > 0) {
        const Candidate& c = p.candidates.front();
        const RankMemory& m = c.memory;
        s += fmt::format(
            "memory.weights_budget {} MiB: {} {} of the frozen base read in place from its files, at most {} {} of it "
            "resident (the budget and the two largest units; in the memory column, not in params); the rest read back "
            "from storage every forward and backward at {:.2g} GB/s ({} ms a step: page-in)\n",
            c.layout.weights_budget, unit(double(m.mapped_bytes)), unit.name, unit(double(m.mapped_resident_bytes)),
            unit.name, cl.host.read_bandwidth / 1e9, ms(c.time.page_in));
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
