// Expert parallelism's exchange around the local experts (see ep.h).
#include "parallel/ep.h"

#include <cstring>

#include "core/check.h"

namespace tessera::parallel {

ExpertParallelStage::ExpertParallelStage(Comm& expert_group, EpDims dims) : comm_(expert_group), d_(dims) {
    const int W = comm_.size();
    TESSERA_CHECK(d_.experts % W == 0, "expert parallelism: {} experts do not divide over {} ranks (parallel.ep)",
                  d_.experts, W);
    local_ = d_.experts / W;
    send_bytes_.resize(size_t(W));
    recv_bytes_.resize(size_t(W));
    seg_send_.assign(size_t(W), local_ * int64_t(sizeof(int32_t)));
    seg_recv_ = seg_send_;
    seg_.resize(size_t(d_.experts));
}

void ExpertParallelStage::saved_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const {
    const int64_t R = max_rows(tokens), L = d_.latent, F = d_.ffn;
    out.push_back({prefix + "recv_counts", DType::i32, Shape{int64_t(comm_.size()) * local_}});
    out.push_back({prefix + "offsets", DType::i32, Shape{local_ + 1}});
    out.push_back({prefix + "counts", DType::i32, Shape{local_}});
    out.push_back({prefix + "xe", DType::f32, Shape{R, L}});
    out.push_back({prefix + "h", DType::f32, Shape{R, 2 * F}});
    out.push_back({prefix + "a", DType::f32, Shape{R, F}});
    out.push_back({prefix + "row_gate", DType::f32, Shape{R}});
}

void ExpertParallelStage::scratch_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const {
    const int64_t R = max_rows(tokens), L = d_.latent, F = d_.ffn;
    out.push_back({prefix + "ye", DType::f32, Shape{R, L}});
    out.push_back({prefix + "dh", DType::f32, Shape{R, 2 * F}});
    out.push_back({prefix + "da", DType::f32, Shape{R, F}});
    out.push_back({prefix + "dxe", DType::f32, Shape{R, L}});
    out.push_back({prefix + "row_dot", DType::f32, Shape{R}});
    out.push_back({prefix + "stage", DType::f32, Shape{R, L}});
}

void ExpertParallelStage::bind_saved(const BufferGroup& g, const std::string& sp) {
    recv_counts_ = g.view(sp + "recv_counts");
    offsets_ = g.view(sp + "offsets");
    counts_ = g.view(sp + "counts");
    xe_ = g.view(sp + "xe");
    h_ = g.view(sp + "h");
    a_ = g.view(sp + "a");
    row_gate_ = g.view(sp + "row_gate");
}

void ExpertParallelStage::bind_scratch(const BufferGroup& g, const std::string& tp) {
    ye_ = g.view(tp + "ye");
    dh_ = g.view(tp + "dh");
    da_ = g.view(tp + "da");
    dxe_ = g.view(tp + "dxe");
    row_dot_ = g.view(tp + "row_dot");
    stage_ = g.view(tp + "stage");
}

ops::MoeSaved ExpertParallelStage::local_saved() const {
    ops::MoeSaved s;
    s.offsets = offsets_;
    s.counts = counts_;
    s.xe = xe_;
    s.h = h_;
    s.a = a_;
    s.row_gate = row_gate_;
    return s;
}

ops::MoeScratch ExpertParallelStage::local_scratch() const {
    ops::MoeScratch t;
    t.ye = ye_;
    t.dh = dh_;
    t.da = da_;
    t.dxe = dxe_;
    t.row_dot = row_dot_;
    return t;
}

void ExpertParallelStage::exchange_counts(const ops::MoeSaved& s) const {
    const int32_t* off = s.offsets.ptr<int32_t>();
    for (int64_t e = 0; e < d_.experts; ++e) seg_[size_t(e)] = off[e + 1] - off[e];
    int32_t* rc_out = recv_counts_.ptr<int32_t>();
    comm_.all_to_all_v(std::as_bytes(std::span(seg_)), seg_send_,
                       std::as_writable_bytes(std::span(rc_out, size_t(recv_counts_.numel()))), seg_recv_);
    const int W = comm_.size();
    const int32_t* rc = recv_counts_.ptr<int32_t>();
    int32_t* cnt = counts_.ptr<int32_t>();
    int32_t* lo = offsets_.ptr<int32_t>();
    lo[0] = 0;
    for (int64_t e = 0; e < local_; ++e) {
        int64_t c = 0;
        for (int r = 0; r < W; ++r) c += rc[r * local_ + e];
        cnt[e] = int32_t(c);
        lo[e + 1] = int32_t(lo[e] + c);
    }
    TESSERA_CHECK(lo[local_] <= xe_.size(0), "expert parallelism: {} rows reached rank {}, more than the {} planned",
                  lo[local_], comm_.rank(), xe_.size(0));
}

namespace {
// Copies between the source-major rows as exchanged (source r: its rows for local experts 0, 1, ... in order)
// and the expert-major local layout (expert e: the rows from source 0, 1, ...); to_local chooses the direction.
void regroup(
    const int32_t* rc, int W, int64_t local, int64_t cols, float* source_major, float* expert_major, bool to_local) {
    // start of (r, e) in the source-major buffer and in the expert-major one
    std::vector<int64_t> src(size_t(W) * size_t(local)), dst(src.size());
    int64_t at = 0;
    for (int r = 0; r < W; ++r)
        for (int64_t e = 0; e < local; ++e) {
            src[size_t(r * local + e)] = at;
            at += rc[r * local + e];
        }
    at = 0;
    for (int64_t e = 0; e < local; ++e)
        for (int r = 0; r < W; ++r) {
            dst[size_t(r * local + e)] = at;
            at += rc[r * local + e];
        }
    const int64_t pairs = int64_t(W) * local;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
        const size_t n = size_t(rc[i]) * size_t(cols) * sizeof(float);
        float* a = source_major + src[size_t(i)] * cols;
        float* b = expert_major + dst[size_t(i)] * cols;
        if (to_local)
            std::memcpy(b, a, n);
        else
            std::memcpy(a, b, n);
    }
}
}  // namespace

void ExpertParallelStage::to_experts(const ops::MoeSaved& s, const float* rows, int64_t cols, float* local) const {
    const int W = comm_.size();
    const int32_t* off = s.offsets.ptr<int32_t>();
    const int32_t* rc = recv_counts_.ptr<int32_t>();
    const int64_t row_bytes = cols * int64_t(sizeof(float));
    int64_t total_send = 0, total_recv = 0;
    for (int q = 0; q < W; ++q) {
        send_bytes_[size_t(q)] = int64_t(off[(q + 1) * local_] - off[q * local_]) * row_bytes;
        int64_t n = 0;
        for (int64_t e = 0; e < local_; ++e) n += rc[q * local_ + e];
        recv_bytes_[size_t(q)] = n * row_bytes;
        total_send += send_bytes_[size_t(q)];
        total_recv += recv_bytes_[size_t(q)];
    }
    float* stage = stage_.ptr<float>();
    comm_.all_to_all_v({reinterpret_cast<const std::byte*>(rows), size_t(total_send)}, send_bytes_,
                       {reinterpret_cast<std::byte*>(stage), size_t(total_recv)}, recv_bytes_);
    regroup(rc, W, local_, cols, stage, local, true);
    last_bytes_ += total_send - send_bytes_[size_t(comm_.rank())];
}

void ExpertParallelStage::from_experts(const ops::MoeSaved& s, const float* local, int64_t cols, float* rows) const {
    const int W = comm_.size();
    const int32_t* off = s.offsets.ptr<int32_t>();
    const int32_t* rc = recv_counts_.ptr<int32_t>();
    const int64_t row_bytes = cols * int64_t(sizeof(float));
    int64_t total_send = 0, total_recv = 0;
    for (int q = 0; q < W; ++q) {
        int64_t n = 0;
        for (int64_t e = 0; e < local_; ++e) n += rc[q * local_ + e];
        send_bytes_[size_t(q)] = n * row_bytes;  // back to where they came from
        recv_bytes_[size_t(q)] = int64_t(off[(q + 1) * local_] - off[q * local_]) * row_bytes;
        total_send += send_bytes_[size_t(q)];
        total_recv += recv_bytes_[size_t(q)];
    }
    float* stage = stage_.ptr<float>();
    regroup(rc, W, local_, cols, stage, const_cast<float*>(local), false);
    comm_.all_to_all_v({reinterpret_cast<const std::byte*>(stage), size_t(total_send)}, send_bytes_,
                       {reinterpret_cast<std::byte*>(rows), size_t(total_recv)}, recv_bytes_);
    last_bytes_ += total_send - send_bytes_[size_t(comm_.rank())];
}

void ExpertParallelStage::forward(const ops::MoeParams& p,
                                  const ops::MoeWeights& w,
                                  const ops::MoeSaved& s,
                                  const ops::MoeScratch& t) const {
    last_bytes_ = 0;
    exchange_counts(s);
    to_experts(s, s.xe.ptr<float>(), d_.latent, xe_.ptr<float>());
    to_experts(s, s.row_gate.ptr<float>(), 1, row_gate_.ptr<float>());
    ops::moe_experts_forward(p, w, local_saved(), local_scratch());
    from_experts(s, ye_.ptr<float>(), d_.latent, t.ye.ptr<float>());
}

void ExpertParallelStage::backward(const ops::MoeParams& p,
                                   const ops::MoeWeights& w,
                                   const ops::MoeWeights& g,
                                   const ops::MoeSaved& s,
                                   const ops::MoeScratch& t) const {
    to_experts(s, t.ye.ptr<float>(), d_.latent, ye_.ptr<float>());  // dye
    ops::moe_experts_backward(p, w, g, local_saved(), local_scratch());
    from_experts(s, dxe_.ptr<float>(), d_.latent, t.dxe.ptr<float>());
    from_experts(s, row_dot_.ptr<float>(), 1, t.row_dot.ptr<float>());
}

}  // namespace tessera::parallel
