// Expert parallelism's exchange around the local experts (see ep.h).
#include "parallel/ep.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/check.h"
#include "core/device.h"
#include "core/trace.h"
#include "ops/rows.h"

namespace tessera::parallel {

ExpertParallelStage::ExpertParallelStage(Comm& expert_group, EpDims dims) : comm_(expert_group), d_(dims) {
    const int W = comm_.size();
    TESSERA_CHECK(d_.experts % W == 0, "expert parallelism: {} experts do not divide over {} ranks (parallel.ep)",
                  d_.experts, W);
    local_ = d_.experts / W;
    const int64_t nc = std::clamp<int64_t>(d_.chunks, 1, local_);
    for (int64_t c = 0; c <= nc; ++c) chunk_.push_back(c * local_ / nc);
    seg_send_.assign(size_t(W), local_ * int64_t(sizeof(int32_t)));
    seg_recv_ = seg_send_;
    seg_.resize(size_t(d_.experts));
    chunk_offsets_host_.resize(size_t(local_ + 1));
    demand_all_.resize(size_t(W) * size_t(d_.experts + 1));
    share_.resize(size_t(d_.experts + 1));
    fair_.resize(size_t(W));
    order_.resize(size_t(W));
}

int64_t ExpertParallelStage::max_rows(int64_t tokens) const {
    // a token's k experts are distinct, so at most min(k, E/EP) of its rows come here
    const int64_t routed = int64_t(comm_.size()) * tokens * d_.topk,
                  dropless = int64_t(comm_.size()) * tokens * std::min(d_.topk, local_);
    if (d_.capacity_factor <= 0) return dropless;
    const double room = std::ceil(d_.capacity_factor * double(routed) / double(d_.experts));
    return std::min(dropless, local_ * int64_t(room));
}

const int64_t* ExpertParallelStage::capacity_shares(double factor, int64_t tokens, TensorView demand) const {
    const int W = comm_.size(), me = comm_.rank();
    const int64_t E = d_.experts, stride = E + 1;
    TESSERA_CHECK(demand.numel() == E && demand.dtype == DType::i32, "expert parallelism: demand must be [{}] i32", E);
    // this rank's choices per expert and its token count, then everyone's
    const std::span<const int32_t> wants = read_to_host(demand, host_demand_);
    for (int64_t e = 0; e < E; ++e) share_[size_t(e)] = wants[size_t(e)];
    share_[size_t(E)] = tokens;
    comm_.all_gather(std::as_bytes(std::span(share_)), std::as_writable_bytes(std::span(demand_all_)));
    int64_t all_tokens = 0;
    for (int r = 0; r < W; ++r) all_tokens += demand_all_[size_t(r * stride + E)];
    const int64_t room = int64_t(std::ceil(factor * double(all_tokens) * double(d_.topk) / double(E)));
    for (int64_t e = 0; e < E; ++e) {
        auto want = [&](int r) { return demand_all_[size_t(r * stride + e)]; };
        int64_t total = 0;
        for (int r = 0; r < W; ++r) total += want(r);
        if (total <= room) {  // everyone gets what it wants; the room left over is split for re-routed rows
            const int64_t spare = room - total;
            for (int r = 0; r < W; ++r) fair_[size_t(r)] = want(r) + spare / W + (r < spare % W ? 1 : 0);
        } else {  // max-min fair: the smallest demands first, while they fit under an equal share of what is left
            std::iota(order_.begin(), order_.end(), 0);
            std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return want(a) < want(b); });
            int64_t left = room;
            int k = 0;
            for (; k < W && want(order_[size_t(k)]) <= left / (W - k); ++k) {
                fair_[size_t(order_[size_t(k)])] = want(order_[size_t(k)]);
                left -= want(order_[size_t(k)]);
            }
            // the rest want more than an equal share: they split what is left, the lower ranks the remainder
            std::sort(order_.begin() + k, order_.end());
            const int64_t n = W - k;
            for (int j = k; j < W; ++j) fair_[size_t(order_[size_t(j)])] = left / n + (j - k < left % n ? 1 : 0);
        }
        share_[size_t(e)] = fair_[size_t(me)];
    }
    return share_.data();
}

// Every buffer of the stage once: its name, where it binds, its spec for `tokens` routed per rank.
struct ExpertParallelStage::Buffer {
    const char* name;
    TensorView ExpertParallelStage::*view;
    DType dtype;
    Shape shape;
};

std::vector<ExpertParallelStage::Buffer> ExpertParallelStage::buffers(bool saved, int64_t tokens) const {
    const int64_t R = max_rows(tokens), L = d_.latent, F = d_.ffn;
    using S = ExpertParallelStage;
    if (saved)  // per layer, kept for backward: the layout handle and the local rows
        return {{"recv_counts", &S::recv_counts_, DType::i32, Shape{int64_t(comm_.size()) * local_}},
                {"offsets", &S::offsets_, DType::i32, Shape{local_ + 1}},
                {"counts", &S::counts_, DType::i32, Shape{local_}},
                {"xe", &S::xe_, DType::f32, Shape{R, L}},
                {"h", &S::h_, DType::f32, Shape{R, 2 * F}},
                {"a", &S::a_, DType::f32, Shape{R, F}},
                {"row_gate", &S::row_gate_, DType::f32, Shape{R}}};
    // transients; stage and pack: rows in flight, source-major, L-wide then one float per row (gates)
    std::vector<Buffer> t{{"ye", &S::ye_, DType::f32, Shape{R, L}},
                          {"dh", &S::dh_, DType::f32, Shape{R, 2 * F}},
                          {"da", &S::da_, DType::f32, Shape{R, F}},
                          {"dxe", &S::dxe_, DType::f32, Shape{R, L}},
                          {"row_dot", &S::row_dot_, DType::f32, Shape{R}},
                          {"stage", &S::stage_, DType::f32, Shape{R, L + 1}},
                          {"pack", &S::pack_, DType::f32, Shape{tokens * d_.topk, L + 1}},
                          {"chunk_offsets", &S::chunk_offsets_, DType::i32, Shape{local_ + 1}}};
    if (d_.lora_rank > 0) {
        t.push_back({"lora_u", &S::lora_u_, DType::f32, Shape{R, d_.lora_rank}});
        t.push_back({"lora_du", &S::lora_du_, DType::f32, Shape{R, d_.lora_rank}});
    }
    return t;
}

void ExpertParallelStage::saved_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const {
    for (const Buffer& b : buffers(true, tokens)) out.push_back({prefix + b.name, b.dtype, b.shape});
}

void ExpertParallelStage::scratch_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const {
    for (const Buffer& b : buffers(false, tokens)) out.push_back({prefix + b.name, b.dtype, b.shape});
}

void ExpertParallelStage::bind_saved(const BufferGroup& g, const std::string& prefix) {
    for (const Buffer& b : buffers(true, 1)) this->*b.view = g.view(prefix + b.name);
}

void ExpertParallelStage::bind_scratch(const BufferGroup& g, const std::string& prefix) {
    for (const Buffer& b : buffers(false, 1)) this->*b.view = g.view(prefix + b.name);
}

namespace {
void fetch(std::vector<int32_t>& to, const TensorView& v) {  // a small i32 view's values, on the host
    to.resize(size_t(v.numel()));
    copy_bytes(to.data(), Device::cpu, v.data, v.device, to.size() * sizeof(int32_t));
}
}  // namespace

void ExpertParallelStage::exchange_counts(const ops::MoeSaved& s) const {
    fetch(host_.off, s.offsets.slice0(0, d_.experts + 1));
    const std::vector<int32_t>& off = host_.off;
    for (int64_t e = 0; e < d_.experts; ++e) seg_[size_t(e)] = off[size_t(e) + 1] - off[size_t(e)];
    const int W = comm_.size();
    host_.rc.resize(size_t(recv_counts_.numel()));
    comm_.all_to_all_v(std::as_bytes(std::span(seg_)), seg_send_, std::as_writable_bytes(std::span(host_.rc)),
                       seg_recv_);
    host_.cnt.resize(size_t(local_));
    host_.lo.resize(size_t(local_ + 1));
    host_.lo[0] = 0;
    for (int64_t e = 0; e < local_; ++e) {
        int64_t c = 0;
        for (int r = 0; r < W; ++r) c += host_.rc[size_t(r * local_ + e)];
        host_.cnt[size_t(e)] = int32_t(c);
        host_.lo[size_t(e) + 1] = int32_t(host_.lo[size_t(e)] + c);
    }
    TESSERA_CHECK(host_.lo[size_t(local_)] <= xe_.size(0),
                  "expert parallelism: {} rows reached rank {}, more than the {} planned", host_.lo[size_t(local_)],
                  comm_.rank(), xe_.size(0));
    // the layer's layout handle, kept for backward where the layer's buffers are
    const Device d = recv_counts_.device;
    copy_bytes(recv_counts_.data, d, host_.rc.data(), Device::cpu, host_.rc.size() * sizeof(int32_t));
    copy_bytes(counts_.data, d, host_.cnt.data(), Device::cpu, host_.cnt.size() * sizeof(int32_t));
    copy_bytes(offsets_.data, d, host_.lo.data(), Device::cpu, host_.lo.size() * sizeof(int32_t));
}

void ExpertParallelStage::load_layout(const ops::MoeSaved& s) const {
    fetch(host_.off, s.offsets.slice0(0, d_.experts + 1));
    fetch(host_.rc, recv_counts_);
    fetch(host_.lo, offsets_);
}

ops::MoeSaved ExpertParallelStage::chunk_saved(int64_t c) const {
    const int64_t e0 = chunk_[size_t(c)], e1 = chunk_[size_t(c) + 1];
    const int32_t* lo = host_.lo.data();
    for (int64_t e = e0; e <= e1; ++e) chunk_offsets_host_[size_t(e - e0)] = lo[e] - lo[e0];
    ops::MoeSaved s;
    s.offsets = chunk_offsets_.slice0(0, e1 - e0 + 1);
    copy_bytes(s.offsets.data, s.offsets.device, chunk_offsets_host_.data(), Device::cpu,
               size_t(e1 - e0 + 1) * sizeof(int32_t));
    s.offsets_host = chunk_offsets_host_.data();  // (read by the expert pass this chunk is made for, before the next)
    const int64_t r0 = lo[e0], r1 = lo[e1];
    s.counts = counts_.slice0(e0, e1);
    s.xe = xe_.slice0(r0, r1);
    s.h = h_.slice0(r0, r1);
    s.a = a_.slice0(r0, r1);
    s.row_gate = row_gate_.slice0(r0, r1);
    return s;
}

ops::MoeScratch ExpertParallelStage::chunk_scratch(int64_t c) const {
    const int32_t* lo = host_.lo.data();
    const int64_t r0 = lo[chunk_[size_t(c)]], r1 = lo[chunk_[size_t(c) + 1]];
    ops::MoeScratch t;
    t.ye = ye_.slice0(r0, r1);
    t.dh = dh_.slice0(r0, r1);
    t.da = da_.slice0(r0, r1);
    t.dxe = dxe_.slice0(r0, r1);
    t.row_dot = row_dot_.slice0(r0, r1);
    t.lora_u = lora_u_;  // the chunks compute one after another
    t.lora_du = lora_du_;
    return t;
}

ops::MoeWeights ExpertParallelStage::chunk_weights(const ops::MoeWeights& w, int64_t c) const {
    const int64_t e0 = chunk_[size_t(c)], e1 = chunk_[size_t(c) + 1];
    ops::MoeWeights out;
    auto part = [&](TensorView v) { return v.defined() ? v.slice0(e0, e1) : TensorView{}; };  // undefined: frozen
    out.w_gate = part(w.w_gate);
    out.w_up = part(w.w_up);
    out.w_down = part(w.w_down);
    for (auto m : {&ops::MoeLora::w_gate, &ops::MoeLora::w_up, &ops::MoeLora::w_down})
        out.lora.*m = {part((w.lora.*m).a), part((w.lora.*m).b)};
    return out;
}

template <class Work>
void ExpertParallelStage::pipeline(const ops::MoeSaved& s,
                                   const std::vector<std::pair<TensorView, TensorView>>& out,
                                   const std::vector<int64_t>& out_cols,
                                   ops::OverlapWork overlap,
                                   Work&& work,
                                   const std::vector<std::pair<TensorView, TensorView>>& back,
                                   const std::vector<int64_t>& back_cols) const {
    const int W = comm_.size(), me = comm_.rank();
    const int64_t nc = chunks(), L = d_.latent;
    // the layout on the host: home offsets by expert, rows per (source, local expert), the local (expert-major) offsets
    const int32_t *off = host_.off.data(), *rc = host_.rc.data(), *lo = host_.lo.data();
    // rows of chunk c to / from each rank, and where the chunk starts in pack (home side) and stage (expert side)
    std::vector<int64_t> send(size_t(nc * W)), recv(size_t(nc * W)), pack_at(size_t(nc + 1)), stage_at(size_t(nc + 1));
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t e0 = chunk_[size_t(c)], e1 = chunk_[size_t(c) + 1];
        int64_t ps = 0, rs = 0;
        for (int q = 0; q < W; ++q) {
            send[size_t(c * W + q)] = off[q * local_ + e1] - off[q * local_ + e0];
            int64_t n = 0;
            for (int64_t e = e0; e < e1; ++e) n += rc[q * local_ + e];
            recv[size_t(c * W + q)] = n;
            ps += send[size_t(c * W + q)];
            rs += n;
        }
        pack_at[size_t(c + 1)] = pack_at[size_t(c)] + ps;
        stage_at[size_t(c + 1)] = stage_at[size_t(c)] + rs;
    }
    // area i of a staging buffer: L-wide rows (i = 0) or one float per row (i = 1)
    auto area = [&](const TensorView& buf, size_t i) { return buf.ptr<float>() + (i == 0 ? 0 : buf.size(0) * L); };
    auto bytes = [&](int64_t c, const std::vector<int64_t>& rows, int64_t cols) {
        std::vector<int64_t> b(static_cast<size_t>(W));
        for (int q = 0; q < W; ++q) b[size_t(q)] = rows[size_t(c * W + q)] * cols * int64_t(sizeof(float));
        return b;
    };
    // the blocks of one copy (ops::copy_blocks: one launch on a GPU), between flat views of two buffers
    std::vector<ops::CopyBlock> blocks;
    auto flat = [](const TensorView& v) { return TensorView(v.data, DType::f32, Shape{v.numel()}, v.device); };
    auto copy = [&](const TensorView& a, const TensorView& b, bool a_to_b) {
        if (!a_to_b)
            for (ops::CopyBlock& k : blocks) std::swap(k.from, k.to);
        ops::copy_blocks(flat(a_to_b ? a : b), flat(a_to_b ? b : a), blocks);
        blocks.clear();
    };
    // where area i of a staging buffer starts: L-wide rows (i = 0), then one float per row (i = 1)
    auto area_at = [&](const TensorView& buf, size_t i) { return i == 0 ? int64_t(0) : buf.size(0) * L; };
    // home rows of chunk c <-> pack (destination-major)
    auto home_copy = [&](int64_t c, size_t i, int64_t cols, const TensorView& home, bool to_pack) {
        const int64_t e0 = chunk_[size_t(c)], e1 = chunk_[size_t(c) + 1];
        int64_t at = pack_at[size_t(c)];
        for (int q = 0; q < W; ++q) {
            const int64_t r0 = off[q * local_ + e0], n = off[q * local_ + e1] - r0;
            blocks.push_back({r0 * cols, area_at(pack_, i) + at * cols, n * cols});
            at += n;
        }
        copy(home, pack_, to_pack);
    };
    // stage rows of chunk c (source-major: source r's rows for experts e0..e1 in order) <-> local (expert-major)
    // where the rows of (source r, local expert e) start: in stage (source-major within their chunk) and in the
    // local layout (expert-major); computed once per call
    std::vector<int64_t> staged_at(size_t(W * local_)), local_at(size_t(W * local_));
    for (int64_t c = 0; c < nc; ++c) {
        int64_t at = stage_at[size_t(c)];
        for (int q = 0; q < W; ++q)
            for (int64_t e = chunk_[size_t(c)]; e < chunk_[size_t(c) + 1]; ++e) {
                staged_at[size_t(q * local_ + e)] = at;
                at += rc[q * local_ + e];
            }
    }
    for (int64_t e = 0; e < local_; ++e) {
        int64_t at = lo[e];
        for (int q = 0; q < W; ++q) {
            local_at[size_t(q * local_ + e)] = at;
            at += rc[q * local_ + e];
        }
    }
    auto local_copy = [&](int64_t c, size_t i, int64_t cols, const TensorView& local, bool to_local) {
        const int64_t e0 = chunk_[size_t(c)], e1 = chunk_[size_t(c) + 1];
        for (int q = 0; q < W; ++q)
            for (int64_t e = e0; e < e1; ++e) {
                const size_t k = size_t(q * local_ + e);  // (source, expert)
                blocks.push_back({area_at(stage_, i) + staged_at[k] * cols, local_at[k] * cols, rc[k] * cols});
            }
        copy(stage_, local, to_local);
    };
    const CommStats before = comm_.stats();
    double waited = 0;
    auto wait = [&](Handle& h) {
        trace::Span span("all_to_all wait", "wait");
        const double t0 = now_seconds();
        h.wait();
        waited += now_seconds() - t0;
    };
    int64_t sent = 0;
    // chunk c of area i, `cols` floats per row, from one side's buffer to the other's (out: pack -> stage)
    auto exchange = [&](int64_t c, size_t i, int64_t cols, bool out) {
        const TensorView& from = out ? pack_ : stage_;
        const TensorView& to = out ? stage_ : pack_;
        const std::vector<int64_t>& from_at = out ? pack_at : stage_at;
        const std::vector<int64_t>& to_at = out ? stage_at : pack_at;
        const auto sb = bytes(c, out ? send : recv, cols), rb = bytes(c, out ? recv : send, cols);
        for (int q = 0; q < W; ++q) sent += q == me ? 0 : sb[size_t(q)];
        auto rows = [&](const TensorView& buf, const std::vector<int64_t>& at) {
            return std::span(area(buf, i) + at[size_t(c)] * cols, size_t((at[size_t(c) + 1] - at[size_t(c)]) * cols));
        };
        return comm_.all_to_all_v_async(std::as_bytes(rows(from, from_at)), sb, std::as_writable_bytes(rows(to, to_at)),
                                        rb);
    };
    std::vector<Handle> outgoing, returning;
    // every chunk's rows on their way out (the communication thread takes them in order)
    for (int64_t c = 0; c < nc; ++c) {
        for (size_t i = 0; i < out.size(); ++i) {
            home_copy(c, i, out_cols[i], out[i].first, true);
            outgoing.push_back(exchange(c, i, out_cols[i], true));
        }
    }
    {
        trace::Span span("overlapped compute", "experts");
        overlap();  // while the rows travel
    }
    for (int64_t c = 0; c < nc; ++c) {
        for (size_t i = 0; i < out.size(); ++i) {
            wait(outgoing[size_t(c) * out.size() + i]);
            local_copy(c, i, out_cols[i], out[i].second, true);
        }
        {
            trace::Span span("experts", "experts", c, "chunk");
            work(c);
        }
        for (size_t j = 0; j < back.size(); ++j) {  // chunk c's results home, while chunk c + 1 computes
            local_copy(c, j, back_cols[j], back[j].first, false);
            returning.push_back(exchange(c, j, back_cols[j], false));
        }
    }
    for (int64_t c = 0; c < nc; ++c) {
        for (size_t j = 0; j < back.size(); ++j) {
            wait(returning[size_t(c) * back.size() + j]);
            home_copy(c, j, back_cols[j], back[j].second, false);
        }
    }
    last_bytes_ += sent;
    times_.exposed += waited;
    times_.communication += comm_.stats().seconds - before.seconds;
}

void ExpertParallelStage::forward(const ops::MoeParams& p,
                                  const ops::MoeWeights& w,
                                  const ops::MoeSaved& s,
                                  const ops::MoeScratch& t,
                                  ops::OverlapWork overlap) const {
    last_bytes_ = 0;
    const double t0 = now_seconds();
    exchange_counts(s);
    times_.exposed += now_seconds() - t0;  // small, and never hidden
    pipeline(s, {{s.xe, xe_}, {s.row_gate, row_gate_}}, {d_.latent, 1}, overlap,
             [&](int64_t c) { ops::moe_experts_forward(p, chunk_weights(w, c), chunk_saved(c), chunk_scratch(c)); },
             {{ye_, t.ye}}, {d_.latent});
}

void ExpertParallelStage::backward(const ops::MoeParams& p,
                                   const ops::MoeWeights& w,
                                   const ops::MoeWeights& g,
                                   const ops::MoeSaved& s,
                                   const ops::MoeScratch& t,
                                   ops::OverlapWork overlap) const {
    const int64_t sent = last_bytes_;
    load_layout(s);
    pipeline(s, {{t.ye, ye_}}, {d_.latent}, overlap,  // dye out
             [&](int64_t c) {
                 ops::moe_experts_backward(p, chunk_weights(w, c), chunk_weights(g, c), chunk_saved(c),
                                           chunk_scratch(c));
             },
             {{dxe_, t.dxe}, {row_dot_, t.row_dot}}, {d_.latent, 1});
    last_bytes_ = sent;  // the metric counts the forward's bytes
}

}  // namespace tessera::parallel
