// AdamW with deterministic, sharded gradient clipping (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/check.h"
#include "ops/adamw.h"

namespace tessera::train {

namespace {
parallel::Comm* shared(parallel::Comm& c) { return c.size() > 1 ? &c : nullptr; }
}  // namespace

AdamW::AdamW(const std::vector<BufferSpec>& params,
             const parallel::Mesh* mesh,
             int64_t first_expert,
             const std::vector<size_t>& units,
             bool fsdp,
             int64_t offload_window)
    : specs_(params), offload_window_(offload_window) {
    const BufferGroup layout("params", params);  // offsets only: nothing is allocated
    const int64_t total = int64_t(layout.nbytes() / sizeof(float));
    std::array<int64_t, kRegions + 1> bound;  // region r is [bound[r], bound[r + 1]): its first parameter's offset
    bound.fill(total);
    auto region_of = [](Sharding s) {
        return s == Sharding::expert ? expert : s == Sharding::data ? data : replicated;
    };
    int last = 0;
    first_spec_.fill(params.size());
    for (size_t t = 0; t < params.size(); ++t) {
        TESSERA_CHECK(params[t].dtype == DType::f32, "AdamW: parameter {} is {}, not f32", params[t].name,
                      dtype_name(params[t].dtype));
        offsets_.push_back(int64_t(layout.offset(t) / sizeof(float)));
        const int r = region_of(params[t].sharding);
        TESSERA_CHECK(r >= last, "AdamW: parameter {} is out of the [replicated | data | expert] order",
                      params[t].name);
        for (int q = 0; q <= r; ++q) bound[size_t(q)] = std::min(bound[size_t(q)], offsets_.back());
        first_spec_[size_t(r)] = std::min(first_spec_[size_t(r)], t);
        last = r;
    }
    parallel::Comm* dp = mesh ? shared(mesh->data()) : nullptr;
    // FSDP shards the dense parameters over the shard group (HSDP: replicated over the replica group)
    parallel::Comm* dense = mesh && fsdp ? shared(mesh->shard()) : dp;
    parallel::Comm* expert_data = mesh ? shared(mesh->expert_data()) : nullptr;
    expert_ = mesh ? shared(mesh->expert()) : nullptr;
    pipeline_ = mesh ? mesh->pipeline() : nullptr;
    std::array<std::vector<int64_t>, kRegions> segments;  // where the units start in each region
    for (size_t t : units) {
        TESSERA_CHECK(t < params.size(), "AdamW: a unit starts at parameter {} of {}", t, params.size());
        const size_t r = size_t(region_of(params[t].sharding));
        segments[r].push_back(offsets_[t] - bound[r]);
    }
    int64_t n = 0;
    for (size_t r = 0; r < kRegions; ++r) {
        parallel::Comm* c = r == expert ? expert_data : r == data ? dense : dp;
        regions_[r] = {bound[r],
                       parallel::FlatShard(bound[r + 1] - bound[r], c ? c->rank() : 0, c ? c->size() : 1, kChunk,
                                           segments[r], fsdp && c && r != replicated),
                       c, r == data && fsdp && mesh ? mesh->replicas() : nullptr};
        state_at_[r] = n;
        n += regions_[r].shard.size();
    }
    auto state = [&](const char* name) {
        std::vector<BufferSpec> spec{
            BufferSpec{.name = name, .dtype = DType::f32, .shape = Shape{n}, .kind = BufferKind::optimizer}};
        const std::string group = std::string("adamw.") + name;
        return offloaded() ? BufferGroup(group, std::move(spec), {BufferGroup::kOutside}, 0)  // (offload_to places it)
                           : BufferGroup(group, std::move(spec));
    };
    m_ = state("m");
    v_ = state("v");
    for (size_t t = 0; t < params.size(); ++t) {  // the pieces of each parameter held here (in state order)
        const int r = region_of(params[t].sharding);
        const parallel::ShardedRegion& reg = regions_[size_t(r)];
        const int64_t b = offsets_[t] - reg.base, len = params[t].shape.numel();
        const bool ex = r == expert;
        const int64_t slice_at = ex ? first_expert * (len / params[t].shape[0]) : 0;  // the slice in the whole tensor
        for (const parallel::FlatShard::Interval& i : reg.shard.mine()) {
            const int64_t e0 = std::max(b, i.lo), e1 = std::min(b + len, i.hi);
            if (e0 >= e1) continue;
            const int64_t at = i.at + (e0 - i.lo);
            pieces_.push_back({t, slice_at + (e0 - b), state_at_[size_t(r)] + at, e1 - e0, at, r});
            TESSERA_CHECK(
                pieces_.size() == 1 || pieces_.back().state_offset >= pieces_[pieces_.size() - 2].state_offset,
                "AdamW: the pieces of {} are out of state order", params[t].name);
        }
    }
}

// The norm's chunks: this rank's, every rank's, and their flat order. At the first norm, not in the constructor: at
// thousands of ranks it is most of a planned rank's cost (plan/memory.h), which never takes a norm.
void AdamW::order_norm_chunks() {
    for (size_t r = 0; r < kRegions; ++r) {
        const parallel::ShardedRegion& g = regions_[r];
        const int W = g.comm ? g.comm->size() : 1;
        struct Run {
            int64_t lo;       // an interval's first element
            int rank;         // whose it is
            ChunkRun chunks;  // its chunks among the rank's
        };
        std::vector<Run> runs;
        std::vector<size_t> count(size_t(W), 0);
        for (int q = 0; q < W; ++q) {
            for (const parallel::FlatShard::Interval& i : g.shard.of(q)) {
                const size_t n = size_t(g.shard.chunks(i));
                runs.push_back({i.lo, q, {std::exchange(count[size_t(q)], count[size_t(q)] + n), n}});
            }
        }
        const size_t most = *std::max_element(count.begin(), count.end());
        mine_[r].resize(most);
        std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.lo < y.lo; });
        for (const Run& run : runs) order_[r].push_back({size_t(run.rank) * most + run.chunks.at, run.chunks.n});
    }
}

namespace {
// A read fault on a file mapping also maps the cached pages around it, up to the kernel's fault-around (64 KiB).
constexpr int64_t kFaultAroundBytes = int64_t(64) << 10;

size_t moment_bytes(const BufferGroup& m) {  // one moment's bytes, rounded up to whole pages (v starts on a page)
    const size_t page = page_size();
    return (m.specs()[0].nbytes() + page - 1) / page * page;
}
}  // namespace

void AdamW::offload_to(const std::string& dir) {
    TESSERA_CHECK(offloaded() && !offload_, "AdamW::offload_to: the moments are {}",
                  offloaded() ? "offloaded already" : "in the arena");
    const size_t each = moment_bytes(m_);
    offload_ = std::make_unique<ScratchFile>(dir, 2 * each);
    offload_dir_ = dir;
    m_.place_outside(0, {offload_->data()});
    v_.place_outside(0, {offload_->data() + each});
}

size_t AdamW::offloaded_bytes() const { return offloaded() ? 2 * moment_bytes(m_) : 0; }

size_t AdamW::offload_resident_bytes() const {
    if (!offloaded()) return 0;
    const size_t page = page_size(), window = size_t(offload_window_) * sizeof(float);
    // two windows of each moment, and the kernel's fault-around (64 KiB) and a page at either end
    return 2 * std::min(moment_bytes(m_), 2 * window + 2 * (size_t(kFaultAroundBytes) + page));
}

void AdamW::release() const {
    if (!offload_) return;
    release_pages(offload_->data(), offload_->size());
}

float* AdamW::region_base(const BufferGroup& g, size_t r) const {
    // by name: a parameter group holds the frozen parameters too, a gradient group only the trained ones
    return first_spec_[r] < specs_.size() ? g.view(specs_[first_spec_[r]].name).ptr<float>() : nullptr;
}

ParamRanges AdamW::ranges_of(const BufferGroup& params) const {
    ParamRanges p;
    for (size_t r = 0; r < kRegions; ++r) {
        float* base = region_base(params, r);
        if (!base || regions_[r].shard.spread()) continue;  // (FSDP holds a spread region's range: Fsdp::shard)
        const auto [lo, hi] = regions_[r].shard.stretch();
        p.region[r] = std::span<float>(base + lo, size_t(hi - lo));
    }
    return p;
}

TensorView AdamW::flat(std::span<const float> range) const {
    return TensorView(const_cast<float*>(range.data()), DType::f32, Shape{int64_t(range.size())}, device());
}

double AdamW::region_sum_of_squares(int r, std::span<const float> grad) {
    const parallel::ShardedRegion& g = regions_[size_t(r)];
    TESSERA_CHECK(int64_t(grad.size()) == g.shard.size(), "grad_norm: {} gradient elements for a range of {}",
                  grad.size(), g.shard.size());
    // NOTES: a chunk always covers the same flat elements whatever the thread count, the number of ranks and the cut
    // (ranges are whole chunks of the units), and the chunk sums are added in flat order, so the sum has the same bits.
    std::vector<double>& mine = mine_[size_t(r)];
    std::vector<double>& all = partial_[size_t(r)];
    std::fill(mine.begin(), mine.end(), 0.0);  // (chunks past the range's end, on the ranks whose range is short)
    size_t k = 0;
    for (const parallel::FlatShard::Interval& i : g.shard.mine()) {
        const size_t n = size_t(g.shard.chunks(i));
        ops::sum_squares_by_chunk(flat(grad.subspan(size_t(i.at), size_t(i.hi - i.lo))), kChunk,
                                  std::span(mine).subspan(k, n));
        k += n;
    }
    if (g.comm) {
        // (sized at the first norm, not before: W x a rank's chunks is large, and a planned rank never needs it)
        all.resize(mine.size() * size_t(g.comm->size()));
        g.comm->all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)));
    } else {
        all = mine;
    }
    double total = 0;
    for (const ChunkRun& run : order_[size_t(r)])
        for (size_t c = run.at; c < run.at + run.n; ++c) total += all[c];
    return total;
}

double AdamW::grad_norm(const GradRanges& g) {
    if (order_[replicated].empty() && order_[data].empty() && order_[expert].empty()) order_norm_chunks();
    const double dense =
        region_sum_of_squares(replicated, g.region[replicated]) + region_sum_of_squares(data, g.region[data]);
    double experts = region_sum_of_squares(expert, g.region[expert]);
    if (expert_) {  // each EP rank's experts: their sums added in EP rank order
        std::vector<double> each(size_t(expert_->size()));
        expert_->all_gather(std::as_bytes(std::span(&experts, 1)), std::as_writable_bytes(std::span(each)));
        experts = 0;
        for (double e : each) experts += e;
    }
    double sum = dense + experts;
    if (pipeline_) {  // each stage's parameters: their sums added in stage order
        std::vector<double> each(size_t(pipeline_->size()));
        pipeline_->all_gather(std::as_bytes(std::span(&sum, 1)), std::as_writable_bytes(std::span(each)));
        sum = 0;
        for (double e : each) sum += e;
    }
    return std::sqrt(sum);
}

void AdamW::clip(const GradRanges& g, double norm, double max_norm) const {
    if (max_norm <= 0) return;
    const double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return;
    for (std::span<float> r : g.region) ops::scale_vector(flat(r), float(coef));
}

void AdamW::update(const TrainConfig& c,
                   const ParamRanges& params,
                   const GradRanges& g,
                   double lr,
                   const std::vector<bool>& trainable) {
    ++step_;
    float* m = m_.view(0).ptr<float>();
    float* v = v_.view(0).ptr<float>();
    for (size_t r = 0; r < kRegions; ++r)
        TESSERA_CHECK(int64_t(params.region[r].size()) == regions_[r].shard.size(),
                      "AdamW::update: {} parameter elements for a range of {}", params.region[r].size(),
                      regions_[r].shard.size());
    // offloaded: window by window in state order, the next one asked for ahead, each finished one released
    const int64_t window = offload_ ? offload_window_ : std::numeric_limits<int64_t>::max();
    const int64_t total = m_.specs()[0].shape.numel();
    int64_t current = -1;  // the window being updated
    // (a read fault maps the cached pages around it too, the kernel's fault-around of up to 64 KiB: a finished window
    // is released with that much before it, and the whole file after the step)
    const int64_t around = kFaultAroundBytes / int64_t(sizeof(float));
    auto enter = [&](int64_t w) {
        if (w == current || !offload_) return;
        if (current >= 0) {
            const int64_t lo = std::max<int64_t>(0, current * window - around),
                          len = std::min((current + 1) * window, total) - lo;
            release_pages(m + lo, size_t(len) * sizeof(float));
            release_pages(v + lo, size_t(len) * sizeof(float));
        }
        current = w;
        const int64_t next = (w + 1) * window;
        if (next < total) {
            const size_t len = size_t(std::min(window, total - next)) * sizeof(float);
            prefetch_pages(m + next, len);
            prefetch_pages(v + next, len);
        }
    };
    for (const StatePiece& piece : pieces_) {
        if (!trainable.empty() && !trainable[piece.param]) continue;
        for (int64_t lo = 0; lo < piece.length;) {  // the piece's part in each window
            const int64_t at = piece.state_offset + lo;
            const int64_t hi = std::min(piece.length, (at / window + 1) * window - piece.state_offset);
            enter(at / window);
            update_piece(c, piece, lo, hi, params, g, lr);
            lo = hi;
        }
    }
    release();
}

void AdamW::update_piece(const TrainConfig& c,
                         const StatePiece& piece,
                         int64_t lo,
                         int64_t hi,
                         const ParamRanges& params,
                         const GradRanges& g,
                         double lr) {
    float* m = m_.view(0).ptr<float>();
    float* v = v_.view(0).ptr<float>();
    const ops::AdamWParams p{.lr = lr,
                             .beta1 = c.beta1,
                             .beta2 = c.beta2,
                             .eps = c.eps,
                             .weight_decay = specs_[piece.param].weight_decay ? c.weight_decay : 0.0,
                             .step = step_};
    const Shape s{hi - lo};
    const size_t r = size_t(piece.region);
    const int64_t k = piece.range_offset + lo, at = piece.state_offset + lo;
    const Device d = device();
    ops::adamw_update(p, TensorView(params.region[r].data() + k, DType::f32, s, d),
                      TensorView(g.region[r].data() + k, DType::f32, s, d), TensorView(m + at, DType::f32, s, d),
                      TensorView(v + at, DType::f32, s, d));
}

void AdamW::share_params(const BufferGroup& params, bool fsdp) const {
    std::vector<parallel::Handle> pending;
    for (size_t r = 0; r < kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        float* base = region_base(params, r);
        if (!reg.comm || !base || (fsdp && r != replicated)) continue;
        for (int q = 0; q < reg.comm->size(); ++q) {
            const auto [lo, hi] = reg.shard.stretch_of(q);
            pending.push_back(
                reg.comm->broadcast_async(std::as_writable_bytes(std::span(base + lo, size_t(hi - lo))), q));
        }
    }
    for (auto& h : pending) h.wait();
}

}  // namespace tessera::train
