// The 1F1B pipeline step (see pipeline.h).
#include "train/pipeline.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/device.h"
#include "core/trace.h"

namespace tessera::train {

std::vector<PipelineOp> one_f_one_b(int64_t stage, int64_t stages, int64_t micros) {
    TESSERA_CHECK(stages >= 2 && stage >= 0 && stage < stages && micros >= 1,
                  "pipeline: no 1F1B schedule for stage {} of {} over {} micro-batches", stage, stages, micros);
    const bool first = stage == 0, last = stage == stages - 1;
    const int64_t w = std::min(stages - stage - 1, micros);
    using K = PipelineOp::Kind;
    std::vector<PipelineOp> ops;
    auto run = [&](K kind, int64_t m) { ops.push_back({.kind = kind, .micro = m}); };
    auto exchange = [&](bool next, int64_t send, int64_t receive) {
        if ((next ? last : first) || (send < 0 && receive < 0)) return;  // no one there, or nothing to move
        ops.push_back({.kind = K::exchange, .next = next, .send = send, .receive = receive});
    };
    auto forward = [&](int64_t m) { run(last ? K::forward_backward : K::forward, m); };
    auto backward = [&](int64_t m) {
        if (!last) run(K::backward, m);  // (the last stage's ran with its forward)
    };
    for (int64_t i = 0; i < w; ++i) {  // warm-up: w forwards
        run(K::load, i);
        exchange(false, -1, i);
        forward(i);
        exchange(true, i, -1);
    }
    // steady: the forward of w + i, the backward of i (the next input arrives as the gradient goes back)
    const int64_t steady = micros - w;
    if (steady > 0) {
        run(K::load, w);
        exchange(false, -1, w);
    }
    for (int64_t i = 0; i < steady; ++i) {
        const int64_t f = w + i;
        forward(f);
        exchange(true, f, i);
        backward(i);
        if (i + 1 < steady) run(K::load, f + 1);
        exchange(false, i, i + 1 < steady ? f + 1 : -1);
    }
    for (int64_t i = steady; i < micros; ++i) {  // cool-down: the w backwards left
        exchange(true, -1, i);
        backward(i);
        exchange(false, i, -1);
    }
    return ops;
}

PipelineStep::PipelineStep(const model::Model& model,
                           const parallel::Mesh& mesh,
                           int64_t micros,
                           model::StepShape max,
                           const model::Recompute& recompute,
                           bool rerun)
    : pipeline_(mesh.pipeline()),
      prev_(mesh.prev()),
      next_(mesh.next()),
      micros_(micros),
      max_(max),
      d_model_(model.config().d_model),
      rerun_(rerun) {
    TESSERA_CHECK(mesh.pp() > 1, "pipeline: a mesh of one stage");
    ops_ = one_f_one_b(mesh.stage(), mesh.pp(), micros);
    slots_ = std::min<int64_t>(mesh.pp() - mesh.stage() - 1, micros) + 1;
    std::vector<BufferSpec> specs;
    auto add = [&](const char* name, DType dtype, Shape shape) {
        specs.push_back({.name = name, .dtype = dtype, .shape = shape, .kind = BufferKind::activation});
    };
    if (!model.last_stage() && !rerun) {
        // what a micro-batch's backward reads of the group: all but the blocks' shared transients ("scratch."), as
        // runs of consecutive buffers
        const BufferGroup acts("activations", model.activation_specs(max, recompute));
        acts_bytes_ = acts.nbytes();
        std::vector<size_t> order(acts.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return acts.offset(a) < acts.offset(b); });
        bool open = false;
        for (size_t i : order) {
            if (acts.specs()[i].name.starts_with("scratch.")) {
                open = false;
                continue;
            }
            const size_t at = acts.offset(i), end = at + acts.specs()[i].nbytes();
            if (open)
                runs_.back().second = end - runs_.back().first;
            else
                runs_.push_back({at, end - at});
            open = true;
        }
        for (const auto& [at, n] : runs_) kept_bytes_ += n;
        add("pipeline.activations", DType::u8, Shape{slots_, int64_t(kept_bytes_)});
        add("pipeline.grad", DType::f32, Shape{max.tokens(), d_model_});
    } else if (!model.first_stage() && !model.last_stage()) {
        add("pipeline.inputs", DType::f32, Shape{slots_ * max.tokens(), d_model_});
    }
    kept_ = BufferGroup("pipeline", std::move(specs));
    data_.resize(size_t(slots_));
    for (Slot& s : data_) {
        s.ids.resize(size_t(max.tokens()));
        s.targets.resize(size_t(max.tokens()));
        s.cu.reserve(size_t(max.tokens()) + 1);
    }
    tokens_.resize(size_t(micros));
}

void PipelineStep::bind(model::Model& model, const BufferGroup& acts) {
    TESSERA_CHECK(acts_bytes_ == 0 || acts.nbytes() == acts_bytes_,
                  "pipeline: an activation group of {} bytes, sized for {}", acts.nbytes(), acts_bytes_);
    model_ = &model;
    acts_ = &acts;
    inputs_ = kept_.find("pipeline.inputs");  // (the group is allocated by now)
    sets_ = kept_.find("pipeline.activations");
    grad_ = kept_.find("pipeline.grad");
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
    const bool first = m.first_stage();
    const bool keep = !rerun_ && !m.last_stage();  // copies of the activation group
    auto kept_input = [&](int64_t micro, int64_t N) {
        const int64_t at = (micro % slots_) * max_.tokens();
        return inputs_.slice0(at, at + N);
    };
    auto copy = [](TensorView to, TensorView from) {
        copy_bytes(to.data, to.device, from.data, from.device, from.nbytes());
    };
    // micro-batch m's copy of the activation group: saved after its forward, restored before its backward
    auto stash = [&](int64_t micro, bool save) {
        std::byte* set = static_cast<std::byte*>(sets_.data) + size_t(micro % slots_) * kept_bytes_;
        for (const auto& [at, n] : runs_) {
            std::byte* live = acts_->base() + at;
            if (save)
                copy_bytes(set, sets_.device, live, acts_->device(), n);
            else
                copy_bytes(live, acts_->device(), set, sets_.device, n);
            set += n;
        }
    };
    auto slot = [&](int64_t micro) -> Slot& { return data_[size_t(micro % slots_)]; };
    auto tokens = [&](int64_t micro) { return tokens_[size_t(micro)]; };
    double loss = 0;
    using K = PipelineOp::Kind;
    for (const PipelineOp& op : ops_) {
        switch (op.kind) {
            case K::load: {  // read once before its forward, kept for its backward
                Slot& s = slot(op.micro);
                const double t0 = parallel::now_seconds();
                s.shape = load(op.micro, s.ids, s.targets);
                phases.data += parallel::now_seconds() - t0;
                s.cu.assign(s.shape.cu_seqlens.begin(), s.shape.cu_seqlens.end());
                s.shape.cu_seqlens = s.cu;
                tokens_[size_t(op.micro)] = s.shape.tokens();
                break;
            }
            case K::forward_backward: {
                Slot& s = slot(op.micro);
                const double scale = prepare(op.micro, s.targets);
                before(op.micro);
                loss += m.forward_backward(s.shape, s.ids, s.targets, scale).loss * (weighted ? scale : 1.0);
                after(op.micro);
                break;
            }
            case K::forward: {  // its input received already, in the model's stage input (kept, unless first)
                Slot& s = slot(op.micro);
                prepare(op.micro, s.targets);
                if (!first && !keep) copy(kept_input(op.micro, tokens(op.micro)), m.stage_input(tokens(op.micro)));
                m.stage_forward(s.shape, s.ids, true, keep);
                if (keep) stash(op.micro, true);
                break;
            }
            case K::backward: {  // the gradient of its output received already
                Slot& s = slot(op.micro);
                const double scale = prepare(op.micro, s.targets);
                const int64_t N = tokens(op.micro);
                if (keep) {
                    stash(op.micro, false);
                    copy(m.stage_grad(N), grad_.slice0(0, N));
                } else if (!first) {
                    copy(m.stage_input(N), kept_input(op.micro, N));
                }
                before(op.micro);
                m.stage_backward(s.shape, s.ids, scale, !keep);
                after(op.micro);
                break;
            }
            case K::exchange: {
                std::span<const std::byte> out;
                std::span<std::byte> in;
                if (op.send >= 0)
                    out = bytes(op.next ? m.stage_output(tokens(op.send)) : m.stage_grad(tokens(op.send)));
                if (op.receive >= 0) {  // (kept activation sets: the gradient waits apart, a restore would clobber it)
                    const int64_t N = tokens(op.receive);
                    in = bytes(!op.next ? m.stage_input(N) : keep ? grad_.slice0(0, N) : m.stage_grad(N));
                }
                send_receive(op.next ? next_ : prev_, out, in, phases);
                break;
            }
        }
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
    sizes_.resize(P);
    const int64_t n = int64_t(packed_.size() * sizeof(double));
    pipeline_->all_gather(std::as_bytes(std::span(&n, 1)), std::as_writable_bytes(std::span(sizes_)));
    int64_t total = 0;
    for (int64_t b : sizes_) total += b;
    gathered_.resize(size_t(total) / sizeof(double));
    pipeline_->all_gather_v(std::as_bytes(std::span(packed_)), std::as_writable_bytes(std::span(gathered_)), sizes_);
    // refilled in place when the caller no longer holds the last one (the same layers every step: nothing allocated
    // after the first), as Model::take_step_stats does
    const bool fresh = !all_ || all_.use_count() > 1;
    if (fresh) all_ = std::make_shared<model::StepStats>();
    size_t at = 0, moe = 0, dsa = 0;
    auto next = [&] { return gathered_.at(at++); };
    for (size_t stage = 0; stage < P; ++stage) {
        for (int64_t i = 0, layers = int64_t(next()); i < layers; ++i, ++moe) {
            if (fresh) all_->moe.emplace_back();
            auto& [layer, st] = all_->moe.at(moe);
            layer = int64_t(next());
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
        for (int64_t i = 0, layers = int64_t(next()); i < layers; ++i, ++dsa) {
            if (fresh) all_->dsa.emplace_back();
            auto& [layer, st] = all_->dsa.at(dsa);
            layer = int64_t(next());
            st.kl = next();
            st.passes = int64_t(next());
        }
    }
    TESSERA_CHECK(moe == all_->moe.size() && dsa == all_->dsa.size(), "pipeline: the stages' layers changed");
    return all_;
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
    m.stage_forward(s, ids, false, false);
    send(next_, bytes(m.stage_output(N)), ignored);
    return {};
}

}  // namespace tessera::train
