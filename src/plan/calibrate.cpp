// Calibration (see calibrate.h).
#include "plan/calibrate.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/file.h"
#include "core/json.h"
#include "core/rng.h"
#include "model/layers/block_rig.h"
#include "model/model.h"
#include "ops/gemm.h"
#include "ops/isa.h"
#include "ops/linear.h"
#include "parallel/comm_mpi.h"
#include "train/optimizer.h"
#include "train/telemetry.h"

namespace tessera::plan {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// fn's seconds (what it returns) over the runs after one warm-up run, sorted: at least 3 runs and ~0.5 s of wall time
// (what fn does untimed counts too), or exactly `runs` (a collective, where every rank must run it as often as the
// others)
template <class F>
std::vector<double> timed_runs(F&& fn, size_t runs = 0) {
    fn();
    std::vector<double> t;
    const auto t0 = std::chrono::steady_clock::now();
    while (runs > 0 ? t.size() < runs : t.size() < 3 || (seconds_since(t0) < 0.5 && t.size() < 50)) t.push_back(fn());
    std::sort(t.begin(), t.end());
    return t;
}

// median seconds of fn after one warm-up run (timed_runs)
template <class F>
double median_seconds(F&& fn, size_t runs = 0) {
    const std::vector<double> t = timed_runs(
        [&] {
            const auto t0 = std::chrono::steady_clock::now();
            fn();
            return seconds_since(t0);
        },
        runs);
    return t[t.size() / 2];
}

// values in [-scale, scale) from a counter hash: weights that keep a block's activations finite
void fill(TensorView v, uint64_t seed, float scale, float offset) {
    float* p = v.ptr<float>();
    for (int64_t i = 0; i < v.numel(); ++i)
        p[i] = offset + scale * (float(mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i)) >> 40) / float(1 << 23) - 1.f);
}

struct BlockSeconds {
    double forward = 0, both = 0;  // the forward alone; forward + backward
};

// Evicts the caches: writes one float per cache line over twice the last-level cache (64 MiB when the system does
// not say, at most 1 GiB). A training step meets each block's weights and saved activations after the other blocks
// have run, so from memory; a block timed over and over finds them in cache. On a Xeon with 260 MiB of L3 the demo's
// MoE block timed 24.4 ms warm and 27.1 ms cold at 2048 tokens, forward and backward; in a training step, 26.9 ms.
class CacheFlush {
  public:
    CacheFlush() {
        long llc = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
        llc = std::max(sysconf(_SC_LEVEL3_CACHE_SIZE), sysconf(_SC_LEVEL2_CACHE_SIZE));
#endif
        const size_t bytes =
            std::clamp<size_t>(llc > 0 ? 2 * size_t(llc) : size_t(64) << 20, size_t(1) << 20, size_t(1) << 30);
        lines_.assign(bytes / sizeof(float), 0.f);
    }
    void operator()() {
        float* p = lines_.data();
        const int64_t n = int64_t(lines_.size());
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i += 16) p[i] += 1.f;
    }

  private:
    std::vector<float> lines_;
};

// forward(shape, n) and backward(shape, n) at each of `shapes`, n = its tokens, each from cold caches (CacheFlush).
// Both are timed in the same runs: each run's forward is part of its pair, so the forward's median cannot exceed the
// pair's, however noisy the machine (timed apart, a busy moment in one and not the other could).
template <class Forward, class Backward>
std::vector<BlockSeconds> time_passes(const std::vector<model::StepShape>& shapes, Forward forward, Backward backward) {
    CacheFlush flush;
    std::vector<BlockSeconds> t;
    for (const model::StepShape& shape : shapes) {
        const int64_t n = shape.batch * shape.seq;
        std::vector<double> fwd;
        const std::vector<double> both = timed_runs([&] {
            flush();
            auto t0 = std::chrono::steady_clock::now();
            forward(shape, n);
            fwd.push_back(seconds_since(t0));
            flush();
            t0 = std::chrono::steady_clock::now();
            backward(shape, n);
            return fwd.back() + seconds_since(t0);
        });
        fwd.erase(fwd.begin());  // the warm-up's
        std::sort(fwd.begin(), fwd.end());
        t.push_back({fwd[fwd.size() / 2], both[both.size() / 2]});
    }
    return t;
}

// With several ranks (Device::beside_fsdp): how much slower a block's forward + backward at `shape` runs while FSDP's
// transfers of its unit run beside it, from cold caches, timed alone and beside the transfers in turn, every rank at
// once (the transfers are collectives over world; a barrier starts each pair): as FSDP issues them in a step, an
// all-gather of the unit's parameters (each rank's 1/W) as the forward starts, another and the reduce-scatter of its
// gradient as the backward starts. Only the passes are timed, not the transfers. The ratio of the medians less one, at
// least 0 (a pass cannot gain from traffic beside it: less is noise).
template <class Forward, class Backward>
double beside_fsdp(
    parallel::Comm& world, double unit_bytes, model::StepShape shape, Forward forward, Backward backward) {
    const int W = world.size();
    const int64_t piece = std::max<int64_t>(1, int64_t(unit_bytes / sizeof(float)) / W);
    std::vector<float> mine(static_cast<size_t>(piece), 1.f), gathered(static_cast<size_t>(piece * W)),
        grads(static_cast<size_t>(piece * W), 1.f), reduced(static_cast<size_t>(piece));
    CacheFlush flush;
    const int64_t n = shape.batch * shape.seq;
    std::vector<double> alone, beside;
    constexpr int kRuns = 7;            // the same on every rank: each runs the collectives as often as the others
    for (int r = 0; r <= kRuns; ++r) {  // (the first pair warms up)
        for (bool traffic : {false, true}) {
            world.barrier();
            std::vector<parallel::Handle> hs;
            flush();
            if (traffic)
                hs.push_back(world.all_gather_async(std::as_bytes(std::span(mine)),
                                                    std::as_writable_bytes(std::span(gathered))));
            auto t0 = std::chrono::steady_clock::now();
            forward(shape, n);
            double t = seconds_since(t0);
            flush();
            if (traffic) {
                hs.push_back(world.all_gather_async(std::as_bytes(std::span(mine)),
                                                    std::as_writable_bytes(std::span(gathered))));
                hs.push_back(world.reduce_scatter_async(DType::f32, grads.data(), reduced.data(), piece));
            }
            t0 = std::chrono::steady_clock::now();
            backward(shape, n);
            t += seconds_since(t0);
            for (auto& h : hs) h.wait();
            if (r > 0) (traffic ? beside : alone).push_back(t);
        }
    }
    std::sort(alone.begin(), alone.end());
    std::sort(beside.begin(), beside.end());
    return std::max(0.0, beside[beside.size() / 2] / alone[alone.size() / 2] - 1.0);
}

// What time_block and time_linear measure: the passes at each shape, and with several ranks the slowdown beside FSDP's
// transfers at the largest (0 on one rank)
struct Timed {
    std::vector<BlockSeconds> passes;
    double beside_fsdp = 0;
};

template <class Forward, class Backward>
Timed time_unit(const std::vector<model::StepShape>& shapes,
                parallel::Comm* world,
                double unit_bytes,
                Forward forward,
                Backward backward) {
    Timed t{time_passes(shapes, forward, backward), 0.0};
    if (world && world->size() > 1) t.beside_fsdp = beside_fsdp(*world, unit_bytes, shapes.back(), forward, backward);
    return t;
}

// block j's seconds at each of `shapes` (ascending), in one rig sized for the last
Timed time_block(
    model::Model& m, size_t j, const std::vector<model::StepShape>& shapes, int64_t d_model, parallel::Comm* world) {
    model::Block& block = m.block(j);
    model::BlockRig rig(block, shapes.back());
    // the parameters as training starts them: the same numbers a run's first steps compute on (random weights of
    // another scale can drive a linear-attention block's decays into subnormals, several times slower on some CPUs)
    for (size_t i = 0; i < rig.specs.size(); ++i)
        model::init_param(rig.params.view(rig.specs[i].name), rig.inits[i], 1, rig.specs[i].name);
    const int64_t rows = shapes.back().batch * shapes.back().seq;
    Tensor x(DType::f32, Shape{rows, d_model}), out(DType::f32, x.shape()), d(DType::f32, x.shape());
    fill(x.view(), 101, 1.f, 0.f);
    fill(d.view(), 102, 1.f, 0.f);
    return time_unit(
        shapes, world, double(rig.params.nbytes()),
        [&](model::StepShape s, int64_t n) {
            block.forward(s, x.view().slice0(0, n), out.view().slice0(0, n), rig.ws);
        },
        [&](model::StepShape s, int64_t n) {
            block.backward(s, x.view().slice0(0, n), d.view().slice0(0, n), rig.ws);
        });
}

// A linear layer [T, in] -> [T, out] at each of `shapes`, forward and backward (dx and dw): the GEMM class of a model
// with no dense block to time
Timed time_linear(int64_t in, int64_t out, const std::vector<model::StepShape>& shapes, parallel::Comm* world) {
    const int64_t rows = shapes.back().batch * shapes.back().seq;
    Tensor x(DType::f32, Shape{rows, in}), w(DType::f32, Shape{out, in}), y(DType::f32, Shape{rows, out}),
        dy(DType::f32, y.shape()), dx(DType::f32, x.shape()), dw(DType::f32, w.shape());
    fill(x.view(), 201, 1.f, 0.f);
    fill(w.view(), 202, 1.f / std::sqrt(float(in)), 0.f);
    fill(dy.view(), 203, 1.f, 0.f);
    return time_unit(
        shapes, world, double(w.view().nbytes()),
        [&](model::StepShape, int64_t n) {
            ops::linear_forward({}, x.view().slice0(0, n), w.view(), {}, y.view().slice0(0, n));
        },
        [&](model::StepShape, int64_t n) {
            ops::linear_backward(dy.view().slice0(0, n), x.view().slice0(0, n), w.view(), dx.view().slice0(0, n),
                                 dw.view(), {});
        });
}

double memcpy_bandwidth() {
    const size_t n = size_t(64) << 20;
    std::vector<char> a(n, 1), b(n, 0);
    const double s = median_seconds([&] { std::memcpy(b.data(), a.data(), n); });
    return 2.0 * double(n) / s;  // read and write
}

// Optimizer offload's rate (Cluster::Host::offload_bandwidth): one AdamW update of 16 Mi elements with its moments in
// the arena and with them in a scratch file in `dir`, streamed `window_mib` at a time (train/optimizer.h), a median of
// 5 each, every rank at once as in a step; the moment bytes over the extra seconds.
double offload_bandwidth(const std::string& dir, double window_mib, parallel::Comm* world) {
    const int64_t n = int64_t(1) << 24;
    const std::vector<BufferSpec> specs{
        BufferSpec{.name = "w", .dtype = DType::f32, .shape = Shape{n}, .kind = BufferKind::param}};
    std::vector<float> w(size_t(n), 0.01f), g(size_t(n), 0.001f);
    const train::TrainConfig tc;
    auto seconds = [&](bool offload) {
        train::AdamW opt(specs, nullptr, 0, {}, false, offload ? train::AdamW::offload_window_elements(window_mib) : 0);
        if (offload) opt.offload_to(dir);
        auto arena = std::make_shared<Arena>(predict_arena_bytes({&opt.m(), &opt.v()}, 256), 256);
        allocate_groups(arena, {&opt.m(), &opt.v()});
        train::ParamRanges p;
        train::GradRanges gr;
        p.region[train::AdamW::data] = std::span<float>(w);
        gr.region[train::AdamW::data] = std::span<float>(g);
        if (world) world->barrier();
        return median_seconds([&] { opt.update(tc, p, gr, 1e-4); }, 5);
    };
    const double plain = seconds(false), offloaded = seconds(true);
    return double(n) * 8.0 / std::max(offloaded - plain, 1e-6);
}

// The weight budget's read rate (Cluster::Host::read_bandwidth): a 128 MiB file written to `dir` and mapped as 16 units
// of 8 MiB, read back as a micro-batch's two sweeps read a base: the units in order (forward), then in reverse
// (backward), each unit page by page as the budget's prefetch thread faults it in (touch_pages: storage and the
// kernel's read-ahead, which a reversed order defeats in part), its pages released from this process (madvise) and
// dropped from the page cache (posix_fadvise) before each sweep; a median of 5 pairs, every rank at once with a file of
// its own as in a step; the bytes over the seconds.
double read_bandwidth(const std::string& dir, parallel::Comm* world) {
    const size_t n = size_t(128) << 20;
    const std::string path = (std::filesystem::path(dir) / ("tessera-read-rate-" + writer_tag())).string();
    struct Remove {
        std::string path;
        ~Remove() { std::filesystem::remove(path); }
    } remove{path};
    write_file_atomic(path, [&](const ByteSink& out) {
        std::vector<uint64_t> block(size_t(1) << 17);  // 1 MiB of counter-hash values (nothing for storage to squeeze)
        for (size_t at = 0; at < n; at += block.size() * 8) {
            for (size_t i = 0; i < block.size(); ++i) block[i] = mix64(uint64_t(at / 8 + i));
            out(std::as_bytes(std::span(block)));
        }
    });
    const MappedFile file(path);
    const std::span<const std::byte> bytes = file.bytes();
    const size_t units = 16, unit = n / units;
    const std::vector<double> t = timed_runs(
        [&] {
            double seconds = 0;
            for (const bool backward : {false, true}) {
                release_pages(bytes.data(), bytes.size());
                drop_cached_pages(path);
                if (world) world->barrier();
                const auto t0 = std::chrono::steady_clock::now();
                for (size_t u = 0; u < units; ++u)
                    touch_pages(bytes.data() + (backward ? units - 1 - u : u) * unit, unit);
                seconds += seconds_since(t0);
            }
            return seconds;
        },
        5);
    return 2.0 * double(n) / t[t.size() / 2];
}

// seconds of one call of collective k in c that sends `per_peer` bytes to each other rank of c (median of `runs` after
// a warm-up, every rank running it as often as the others)
double time_collective(parallel::Comm& c, Collective k, int64_t per_peer, size_t runs) {
    const int64_t g = c.size();
    std::vector<std::byte> send(size_t(k == Collective::all_gather ? per_peer : per_peer * g)),
        recv(size_t(k == Collective::reduce_scatter ? per_peer : per_peer * g)), scratch;
    std::vector<int64_t> counts(size_t(g), per_peer);
    if (k == Collective::reduce_scatter) scratch.resize(send.size());
    c.barrier();
    return median_seconds(
        [&] {
            switch (k) {
                case Collective::all_gather:
                    return c.all_gather(send, recv);
                case Collective::reduce_scatter:  // f32 sums, as FSDP's gradients
                    return c.reduce_scatter_async(DType::f32, send.data(), recv.data(), per_peer / 4, scratch).wait();
                case Collective::all_to_all:
                    return c.all_to_all_v(send, counts, recv, counts);
            }
        },
        runs);
}

// Every collective over groups of g consecutive ranks, for each g in `groups` (all groups at once, as the runtime's
// groups run): α-β fitted over calls of 8 B, 64 KiB, 1 MiB and 8 MiB per peer (fit_alpha_beta; a call's median over
// 30 runs for the small ones, as ranks sharing cores wake late, 10 for the large), rank 0's numbers on every rank (the
// file is one description). The link's own bandwidth and latency: the all-to-all over every rank.
void measure_links(parallel::Comm& world, const std::vector<int64_t>& groups, Link& link) {
    const std::vector<int64_t> sizes = {8, int64_t(64) << 10, int64_t(1) << 20, int64_t(8) << 20};
    std::vector<double> v;  // per group, per collective: bandwidth, latency
    for (int64_t g : groups) {
        std::unique_ptr<parallel::Comm> sub =
            g < world.size() ? world.split(world.rank() / int(g), world.rank()) : nullptr;
        parallel::Comm& c = sub ? *sub : world;
        for (Collective k : kCollectives) {
            std::vector<double> x, t;  // bytes per peer; seconds
            for (int64_t n : sizes) {
                x.push_back(double(n));
                t.push_back(time_collective(c, k, n, n < (int64_t(1) << 20) ? 30 : 10));
            }
            const AlphaBeta f = fit_alpha_beta(x, t);  // t = (g − 1) · (latency + per peer / bandwidth)
            v.push_back(f.beta * double(g - 1));
            v.push_back(f.alpha / double(g - 1));
        }
    }
    world.broadcast(std::as_writable_bytes(std::span(v)), 0);
    link.ranks.assign(groups.begin(), groups.end());
    size_t i = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi)
        for (Collective k : kCollectives) {
            link.bandwidth_by_ranks[k].push_back(v[i++]);
            link.latency_by_ranks[k].push_back(v[i++]);
        }
    link.bandwidth = link.bandwidth_by_ranks[Collective::all_to_all].back();
    link.latency = link.latency_by_ranks[Collective::all_to_all].back();
}

}  // namespace

Cluster calibrate(const train::RunConfig& cfg, parallel::Comm* world, std::ostream* log) {
    const auto note = [&](const std::string& s) {
        if (log) *log << s << '\n' << std::flush;
    };
    const int W = world ? world->size() : 1, threads = omp_get_max_threads();
    Cluster c;
    c.name = fmt::format("calibrated: {} rank{} x {} thread{} ({})", W, W == 1 ? "" : "s", threads,
                         threads == 1 ? "" : "s", ops::isa_summary());
    c.devices = W;
    c.device.name = fmt::format("{} with {} threads", ops::isa_summary(), threads);
    c.device.compute_dtype = "f32";
    c.device.threads = threads;
    const double peak = ops::measure_gemm_gflops(1024, 0.5) * 1e9;
    c.device.peak_flops["f32"] = peak;
    note(fmt::format("GEMM (1024^3, {} threads): {:.1f} GFLOP/s, taken as the peak", threads, peak / 1e9));
    // one block of each kind of the model, at its micro-batch of one sequence
    model::Model m(cfg.model);
    {  // a timed block holds its layer's parameters and their gradients: refuse a layer this machine cannot hold
        std::map<std::string, double> layer;
        for (const BufferSpec& s : m.param_specs()) {
            const size_t at = s.name.find("layers.");
            if (at != std::string::npos) layer[s.name.substr(0, s.name.find('.', at + 7))] += double(s.nbytes());
        }
        double largest = 0;
        for (const auto& [name, b] : layer) largest = std::max(largest, b);
        const double have = train::physical_memory_bytes();
        TESSERA_CHECK(have <= 0 || 2.0 * largest <= 0.5 * have,
                      "calibrate: a layer of this model holds {:.1f} GiB of parameters (and as much gradient) but this "
                      "machine has {:.1f} GiB; time a smaller model of the same kinds (--model)",
                      largest / 0x1p30, have / 0x1p30);
    }
    // micro-batches of 1, 2, 4, ... sequences, up to a rank's share of the batch (at most 16 sequences, 16K tokens)
    const int64_t seq = cfg.train.seq_len, share = std::max<int64_t>(1, cfg.train.batch_size / W);
    std::vector<model::StepShape> shapes;
    for (int64_t b = 1; b <= std::min<int64_t>(share, 16) && (b == 1 || b * seq <= 16384); b *= 2)
        shapes.push_back({b, seq});
    for (const model::StepShape& s : shapes) c.device.tokens.push_back(double(s.batch * s.seq));
    const size_t P = shapes.size();
    std::map<OpClass, std::vector<double>> eff;  // per shape
    std::map<OpClass, double> fwd;               // the forward's share of the time at the largest shape
    std::map<OpClass, double> beside;            // the slowdown beside FSDP's transfers (several ranks)
    // the fraction of the GEMM rate at each shape of something of `flops` forward FLOPs per token (3x with backward)
    const auto fractions = [&](const std::string& what, double flops, const std::vector<BlockSeconds>& t) {
        std::vector<double> e;
        for (size_t i = 0; i < P; ++i) {
            const double T = c.device.tokens[i], rate = 3.0 * T * flops / t[i].both;
            e.push_back(rate / peak);
            note(fmt::format(
                "{} at {:>5} tokens: {:7.2f} ms forward+backward ({:.0f}% forward), {:.1f} GFLOP/s ({:.0f}% "
                "of the GEMM rate)",
                what, T, t[i].both * 1e3, 100 * t[i].forward / t[i].both, rate / 1e9, 100 * e.back()));
        }
        return e;
    };
    std::vector<BlockSeconds> moe;
    size_t moe_block = 0;
    // the model over half the heads, whose attention blocks are a tensor group of 2's parts (Device::tensor_shared);
    // none where 2 does not divide the heads or such a part does not build
    std::optional<model::Model> half;
    const model::ModelConfig& mc = cfg.model;
    const bool kda = mc.has_layer_type("kda") || mc.has_layer_type("gdn");
    if (mc.n_heads % 2 != 0 || mc.n_kv_heads % 2 != 0 || (kda && (mc.kda.num_heads % 2 != 0 || mc.kda.hv() % 2 != 0))) {
        note("no block over half the heads (2 does not divide them): tensor groups priced by their FLOPs");
    } else {
        try {
            half.emplace(model::tensor_part(mc, 2));
        } catch (const Error& e) {
            note(fmt::format("no block over half the heads ({}): tensor groups priced by their FLOPs", e.what()));
        }
    }
    for (size_t j = 0; j < m.block_kinds().size(); ++j) {
        const std::string& kind = m.block_kinds()[j];
        const OpClass cls = kind == "moe" ? OpClass::grouped_gemm : block_class(kind);  // an MoE block: its experts
        if (eff.count(cls) || (cls == OpClass::grouped_gemm && !moe.empty())) continue;
        const Timed timed = time_block(m, j, shapes, cfg.model.d_model, world);
        const std::vector<BlockSeconds>& t = timed.passes;
        const std::vector<double> e =
            fractions(fmt::format("block {} ({})", j, kind), m.block_forward_flops_per_token(j, seq), t);
        fwd[cls] = std::clamp(t.back().forward / t.back().both, 0.05, 0.95);
        beside[cls] = timed.beside_fsdp;
        if (cls == OpClass::grouped_gemm) {
            moe = t;
            moe_block = j;
        } else {
            eff[cls] = e;
        }
        if (half && (cls == OpClass::attention || cls == OpClass::kda)) {
            const double part = time_block(*half, j, {shapes.back()}, cfg.model.d_model, nullptr).passes[0].both;
            const double whole = t.back().both, shared = std::clamp(2.0 * part / whole - 1.0, 0.0, 2.0);
            c.device.tensor_shared[cls] = shared;
            note(
                fmt::format("block {} ({}) over half its heads at {:>5} tokens: {:7.2f} ms, {:.2f}x the whole block: "
                            "{:.0f}% of its time is every tensor rank's",
                            j, kind, c.device.tokens.back(), part * 1e3, part / whole, 100 * shared));
        }
    }
    const auto clamp = [](double e) { return std::clamp(e, 1e-3, 1.0); };
    if (!eff.count(OpClass::gemm)) {  // no dense block: a linear layer of the shared expert's (or the model's) width
        const int64_t d = cfg.model.d_model, f = cfg.model.moe.shared_ffn_dim > 0 ? cfg.model.moe.shared_ffn_dim : d;
        const Timed timed = time_linear(d, f, shapes, world);
        const std::vector<BlockSeconds>& t = timed.passes;
        eff[OpClass::gemm] = fractions(fmt::format("linear {} -> {}", d, f), ops::linear_forward_flops(1, d, f), t);
        fwd[OpClass::gemm] = std::clamp(t.back().forward / t.back().both, 0.05, 0.95);
        beside[OpClass::gemm] = timed.beside_fsdp;
    }
    for (OpClass cls : kOpClasses)  // (as their efficiency: the GEMM class's when untimed)
        if (!beside.count(cls)) beside[cls] = beside[OpClass::gemm];
    if (W > 1) {
        c.device.beside_fsdp = beside;
        for (const auto& [cls, v] : beside)
            note(fmt::format("{} beside FSDP's transfers of its unit: {:+.1f}%", op_class_name(cls), 100 * v));
    }
    for (OpClass cls : {OpClass::attention, OpClass::kda})
        if (!eff.count(cls)) eff[cls] = eff[OpClass::gemm];
    for (auto& [cls, e] : eff)
        for (double& x : e) x = clamp(x);
    std::vector<double> grouped = eff[OpClass::gemm];
    if (!moe.empty()) {
        // the block's time = its routed FLOPs at the grouped rate + the rest at the GEMM rate (plan.cpp's split)
        const auto& mo = cfg.model.moe;
        const double routed =
            double(mo.topk) * 6.0 * double(mo.latent_dim > 0 ? mo.latent_dim : cfg.model.d_model) * double(mo.ffn_dim);
        const double rest = m.block_forward_flops_per_token(moe_block, seq) - routed;
        for (size_t i = 0; i < P; ++i) {
            const double left = moe[i].both * peak / (3.0 * c.device.tokens[i]) - rest / eff[OpClass::gemm][i];
            grouped[i] = left > 0 ? clamp(routed / left) : eff[OpClass::gemm][i];
        }
    }
    eff[OpClass::grouped_gemm] = grouped;
    for (auto& [cls, e] : eff) c.device.efficiency[cls] = e.back();  // the largest shape's, for readers of one number
    c.device.efficiency_by_tokens = eff;
    c.device.forward_share = fwd;
    c.device.memory_bandwidth = memcpy_bandwidth();
    note(fmt::format("memcpy: {:.1f} GB/s", c.device.memory_bandwidth / 1e9));
    const int local = world ? parallel::local_ranks() : 1;
    c.device.memory = train::physical_memory_bytes() / double(std::max(1, local));
    c.device.usable_fraction = 0.8;
    c.host.devices = std::max(1, local);
    c.host.memory = train::physical_memory_bytes();
    {
        const std::string dir =
            cfg.memory.offload_dir.empty() ? std::filesystem::temp_directory_path().string() : cfg.memory.offload_dir;
        c.host.disk = double(std::filesystem::space(dir).available);
        c.host.offload_bandwidth = offload_bandwidth(dir, cfg.memory.offload_window_mib, world);
        note(fmt::format("optimizer offload through {}: {:.1f} GB/s of moments ({:.0f} GB free there)", dir,
                         c.host.offload_bandwidth / 1e9, c.host.disk / 1e9));
        c.host.read_bandwidth = read_bandwidth(dir, world);
        note(fmt::format("a released base read back from storage in {}: {:.2f} GB/s (memory.weights_budget)", dir,
                         c.host.read_bandwidth / 1e9));
    }
    Link link{"shared memory (one host)", W, 5e9, 2e-6};
    if (W > 1) {
        // groups of 2, 4, ... ranks that divide the world, and the world
        std::vector<int64_t> groups;
        for (int64_t g = 2; g < W; g *= 2)
            if (W % g == 0) groups.push_back(g);
        groups.push_back(W);
        measure_links(*world, groups, link);
        link.name = fmt::format("{} collectives", world->backend());
        for (size_t gi = 0; gi < groups.size(); ++gi)
            for (Collective k : kCollectives)
                note(fmt::format("{:<14} over groups of {}: {:.2f} GB/s per rank each way, {:.1f} us per message",
                                 collective_name(k), groups[gi], link.bandwidth_by_ranks[k][gi] / 1e9,
                                 link.latency_by_ranks[k][gi] * 1e6));
    }
    c.links = {link};
    // what a rank holds outside its arena: this process's resident memory now, its timed blocks freed (the code,
    // libraries, oneDNN's and MPI's buffers, after the link sweep)
    c.device.reserved = double(train::resident_bytes());
    note(fmt::format("resident outside the arena: {:.1f} MB", c.device.reserved / 1e6));
    c.source = fmt::format(
        "tessera calibrate on {}: the GEMM rate as the f32 peak; efficiencies from one block of each kind of the model "
        "(d_model {}, seq {}) at micro-batches of {}-{} sequences{}",
        ops::isa_summary(), cfg.model.d_model, cfg.train.seq_len, shapes.front().batch, shapes.back().batch,
        W > 1 ? "; the link from all-gathers, reduce-scatters and all-to-alls by group size" : "");
    return c;
}

std::string cluster_json(const Cluster& c) {
    Json peaks = Json::object();
    for (const auto& [dt, f] : c.device.peak_flops) peaks[dt] = f / 1e12;
    Json links = Json::array();
    for (const Link& l : c.links) {
        Json link = {
            {"name", l.name}, {"span", l.span}, {"bandwidth_gbs", l.bandwidth / 1e9}, {"latency_us", l.latency * 1e6}};
        if (!l.ranks.empty()) {
            Json by = {{"ranks", std::vector<int64_t>(l.ranks.begin(), l.ranks.end())}};
            for (const auto& [k, bw] : l.bandwidth_by_ranks) {
                Json gbs = Json::array(), us = Json::array();
                for (size_t i = 0; i < bw.size(); ++i) {
                    gbs.push_back(bw[i] / 1e9);
                    us.push_back(l.latency_by_ranks.at(k)[i] * 1e6);
                }
                by[collective_name(k)] = {{"bandwidth_gbs", gbs}, {"latency_us", us}};
            }
            link["collectives"] = by;
        }
        links.push_back(link);
    }
    Json by_tokens = Json::object(), shares = Json::object(), efficiency = Json::object();
    if (!c.device.tokens.empty()) by_tokens["tokens"] = c.device.tokens;
    for (const auto& [cls, v] : c.device.efficiency_by_tokens) by_tokens[op_class_name(cls)] = v;
    for (const auto& [cls, v] : c.device.forward_share) shares[op_class_name(cls)] = v;
    Json beside = Json::object(), tensor = Json::object();
    for (const auto& [cls, v] : c.device.beside_fsdp) beside[op_class_name(cls)] = v;
    for (const auto& [cls, v] : c.device.tensor_shared) tensor[op_class_name(cls)] = v;
    for (const auto& [cls, v] : c.device.efficiency) efficiency[op_class_name(cls)] = v;
    Json doc = {{"name", c.name},
                {"source", c.source},
                {"devices", c.devices},
                {"device",
                 {{"name", c.device.name},
                  {"memory_gb", c.device.memory / 1e9},
                  {"usable_fraction", c.device.usable_fraction},
                  {"reserved_gb", c.device.reserved / 1e9},
                  {"peak_tflops", peaks},
                  {"compute_dtype", c.device.compute_dtype},
                  {"efficiency", efficiency},
                  {"memory_bandwidth_gbs", c.device.memory_bandwidth / 1e9},
                  {"threads", c.device.threads}}},
                {"host",
                 {{"devices", c.host.devices},
                  {"memory_gb", c.host.memory / 1e9},
                  {"disk_gb", c.host.disk / 1e9},
                  {"link_bandwidth_gbs", c.host.link_bandwidth / 1e9},
                  {"offload_bandwidth_gbs", c.host.offload_bandwidth / 1e9},
                  {"read_bandwidth_gbs", c.host.read_bandwidth / 1e9}}},
                {"links", links}};
    if (!c.device.tokens.empty()) doc["device"]["efficiency_by_tokens"] = by_tokens;
    if (!shares.empty()) doc["device"]["forward_share"] = shares;
    if (!beside.empty()) doc["device"]["beside_fsdp"] = beside;
    if (!tensor.empty()) doc["device"]["tensor_shared"] = tensor;
    return doc.dump(2) + "\n";
}

}  // namespace tessera::plan
