// The 1F1B pipeline step (see pipeline.h).
#include "train/pipeline.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/device.h"
#include "core/trace.h"

namespace tessera::train {

PipelineStep::PipelineStep(const model::Model& model, const parallel::Mesh& mesh, int64_t micros, model::StepShape max)
    : pipeline_(mesh.pipeline()),
      prev_(mesh.prev()),
      next_(mesh.next()),
      micros_(micros),
      max_(max),
      d_model_(model.config().d_model) {
    TESSERA_CHECK(mesh.pp() > 1, "pipeline: a mesh of one stage");
    warmup_ = std::min<int64_t>(mesh.pp() - mesh.stage() - 1, micros);
    slots_ = warmup_ + 1;
    const bool keeps_inputs = !model.first_stage() && !model.last_stage();
    std::vector<BufferSpec> specs;
    if (keeps_inputs)
        specs.push_back({.name = "pipeline.inputs",
                         .dtype = DType::f32,
                         .shape = Shape{slots_ * max.tokens(), d_model_},
                         .kind = BufferKind::activation});
    inputs_ = BufferGroup("pipeline", std::move(specs));
    data_.resize(size_t(slots_));
    for (Slot& s : data_) {
        s.ids.resize(size_t(max.tokens()));
        s.targets.resize(size_t(max.tokens()));
        s.cu.reserve(size_t(max.tokens()) + 1);
    }
}

void PipelineStep::receive(parallel::Comm* pair, std::span<std::byte> into, StepPhases& phases) {
    send_receive(pair, {}, into, phases);
}

void PipelineStep::send(parallel::Comm* pair, std::span<const std::byte> from, StepPhases& phases) {
    send_receive(pair, from, {}, phases);
}

void PipelineStep::send_receive(parallel::Comm* pair,
                                std::span<const std::byte> from,
                                std::span<std::byte> into,
                                StepPhases& phases) {
    if (!pair) return;  // (the first stage has no one before it, the last no one after)
    trace::Span span("pipeline exchange", "wait");
    const double t0 = parallel::now_seconds();
    parallel::exchange(*pair, from, into);
    phases.communication += parallel::now_seconds() - t0;
}

double PipelineStep::run(const Load& load,
                         const Prepare& prepare,
                         const Around& before,
                         const Around& after,
                         bool weighted,
                         StepPhases& phases) {
    TESSERA_CHECK(model_, "pipeline: no model bound");
    model::Model& m = *model_;
    const bool first = m.first_stage(), last = m.last_stage();
    const TensorView kept = inputs_.size() ? inputs_.view(0) : TensorView{};
    auto kept_input = [&](int64_t micro, int64_t N) {
        const int64_t at = (micro % slots_) * max_.tokens();
        return kept.slice0(at, at + N);
    };
    auto copy = [](TensorView to, TensorView from) {
        copy_bytes(to.data, to.device, from.data, from.device, from.nbytes());
    };
    double loss = 0;
    // micro-batch m's data, read once at its forward and kept for its backward
    auto fetch = [&](int64_t micro) -> Slot& {
        Slot& s = data_[size_t(micro % slots_)];
        const double t0 = parallel::now_seconds();
        s.shape = load(micro, s.ids, s.targets);
        phases.data += parallel::now_seconds() - t0;
        s.cu.assign(s.shape.cu_seqlens.begin(), s.shape.cu_seqlens.end());
        s.shape.cu_seqlens = s.cu;
        return s;
    };
    // the forward of micro-batch m (its input received already, in the model's stage input); on a stage before the
    // last, its input is kept (between the first and the last) and its output goes to the next stage with `then`
    // received in the same exchange
    auto forward = [&](int64_t micro, std::span<std::byte> then) {
        Slot& s = data_[size_t(micro % slots_)];
        const int64_t N = s.shape.tokens();
        const double scale = prepare(micro, s.targets);
        if (last) {  // forward and backward at once
            before(micro);
            loss += m.forward_backward(s.shape, s.ids, s.targets, scale).loss * (weighted ? scale : 1.0);
            after(micro);
            return;
        }
        if (!first) copy(kept_input(micro, N), m.stage_input(N));
        m.stage_forward(s.shape, s.ids, true);
        send_receive(next_, bytes(m.stage_output(N)), then, phases);
    };
    // the backward of micro-batch m (on a stage before the last: the gradient of its output received already)
    auto backward = [&](int64_t micro) {
        if (last) return;  // (ran with its forward)
        Slot& s = data_[size_t(micro % slots_)];
        const int64_t N = s.shape.tokens();
        const double scale = prepare(micro, s.targets);
        if (!first) copy(m.stage_input(N), kept_input(micro, N));
        before(micro);
        m.stage_backward(s.shape, s.ids, scale);
        after(micro);
    };
    auto in_of = [&](int64_t micro) { return bytes(m.stage_input(data_[size_t(micro % slots_)].shape.tokens())); };
    auto grad_of = [&](int64_t micro) { return bytes(m.stage_grad(data_[size_t(micro % slots_)].shape.tokens())); };
    // warm-up: w forwards
    for (int64_t i = 0; i < warmup_; ++i) {
        fetch(i);
        receive(prev_, in_of(i), phases);
        forward(i, {});
    }
    // steady: forward of w + i, backward of i (the next input arrives with the gradient sent back)
    const int64_t steady = micros_ - warmup_;
    if (steady > 0) {
        fetch(warmup_);
        receive(prev_, in_of(warmup_), phases);
    }
    for (int64_t i = 0; i < steady; ++i) {
        const int64_t f = warmup_ + i;
        forward(f, last ? std::span<std::byte>{} : grad_of(i));
        backward(i);
        if (i + 1 < steady) {
            fetch(f + 1);
            send_receive(prev_, grad_of(i), in_of(f + 1), phases);
        } else {
            send(prev_, grad_of(i), phases);
        }
    }
    // cool-down: the w backwards left
    for (int64_t i = steady; i < micros_; ++i) {
        receive(next_, grad_of(i), phases);
        backward(i);
        send(prev_, grad_of(i), phases);
    }
    return loss;
}

double PipelineStep::from_last(double v) {
    pipeline_->broadcast(std::as_writable_bytes(std::span(&v, 1)), pipeline_->size() - 1);
    return v;
}

std::shared_ptr<const model::StepStats> PipelineStep::all_stages(const model::StepStats& mine) {
    // packed as doubles: per MoE layer its index, expert count, loads and scalars; per DSA layer its index, KL, passes
    packed_.clear();
    packed_.push_back(double(mine.moe.size()));
    for (const auto& [layer, st] : mine.moe) {
        packed_.insert(packed_.end(), {double(layer), double(st.load.load.size())});
        for (int64_t c : st.load.load) packed_.push_back(double(c));
        packed_.insert(packed_.end(), {st.load.overload, double(st.load.dead), st.load.load_entropy,
                                       st.load.routing_entropy, double(st.tokens), double(st.rerouted),
                                       double(st.dropped), double(st.a2a_bytes), st.a2a_seconds, st.a2a_exposed_seconds,
                                       st.seq_aux_loss, st.z_loss, double(st.bias_min), double(st.bias_max)});
    }
    packed_.push_back(double(mine.dsa.size()));
    for (const auto& [layer, st] : mine.dsa) packed_.insert(packed_.end(), {double(layer), st.kl, double(st.passes)});
    const size_t P = size_t(pipeline_->size());
    std::vector<int64_t> bytes(P);
    const int64_t n = int64_t(packed_.size() * sizeof(double));
    pipeline_->all_gather(std::as_bytes(std::span(&n, 1)), std::as_writable_bytes(std::span(bytes)));
    int64_t total = 0;
    for (int64_t b : bytes) total += b;
    gathered_.resize(size_t(total) / sizeof(double));
    pipeline_->all_gather_v(std::as_bytes(std::span(packed_)), std::as_writable_bytes(std::span(gathered_)), bytes);
    auto all = std::make_shared<model::StepStats>();
    size_t at = 0;
    auto next = [&] { return gathered_.at(at++); };
    for (size_t stage = 0; stage < P; ++stage) {
        for (int64_t i = 0, layers = int64_t(next()); i < layers; ++i) {
            auto& [layer, st] = all->moe.emplace_back(int64_t(next()), model::MoeLayerStats{});
            st.load.load.resize(size_t(next()));
            for (int64_t& c : st.load.load) c = int64_t(next());
            st.load.overload = next();
            st.load.dead = int64_t(next());
            st.load.load_entropy = next();
            st.load.routing_entropy = next();
            st.tokens = int64_t(next());
            st.rerouted = int64_t(next());
            st.dropped = int64_t(next());
            st.a2a_bytes = int64_t(next());
            st.a2a_seconds = next();
            st.a2a_exposed_seconds = next();
            st.seq_aux_loss = next();
            st.z_loss = next();
            st.bias_min = float(next());
            st.bias_max = float(next());
        }
        for (int64_t i = 0, layers = int64_t(next()); i < layers; ++i) {
            auto& [layer, st] = all->dsa.emplace_back(int64_t(next()), model::DsaLayerStats{});
            st.kl = next();
            st.passes = int64_t(next());
        }
    }
    return all;
}

model::LossResult PipelineStep::forward_loss(model::StepShape s,
                                             std::span<const int32_t> ids,
                                             std::span<const int32_t> targets) {
    TESSERA_CHECK(model_, "pipeline: no model bound");
    model::Model& m = *model_;
    const int64_t N = s.tokens();
    StepPhases ignored;
    receive(prev_, bytes(m.stage_input(N)), ignored);
    if (m.last_stage()) return m.forward_loss(s, ids, targets);
    m.stage_forward(s, ids, false);
    send(next_, bytes(m.stage_output(N)), ignored);
    return {};
}

}  // namespace tessera::train
