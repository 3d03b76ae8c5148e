// LoRA adapters of a projection (see lora.h).
#include "model/lora.h"

#include <cmath>

#include "core/check.h"
#include "core/rng.h"
#include "ops/lora.h"

namespace tessera::model {

LoraAdapters::LoraAdapters(const LoraConfig& c, int64_t in, const std::vector<Part>& parts)
    : rank_(c.enabled() ? c.rank : 0),
      in_(in),
      scale_(c.enabled() ? c.scale() : 1.0),
      dropout_(c.enabled() ? c.dropout : 0.0) {
    if (!c.enabled()) return;
    int64_t row = 0;
    for (const Part& p : parts) {
        if (p.rows > 0 && LoraConfig::names(c.target_modules, p.module))
            adapters_.push_back({p.module, row, p.rows, hash_name(p.module)});
        row += p.rows;
    }
}

ops::LoraParams LoraAdapters::params(const Adapter& a) const {
    return {.scale = scale_, .dropout = dropout_, .seed = seed_, .stream = a.stream};
}

void LoraAdapters::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const double bound = 1.0 / std::sqrt(double(in_));
    for (const Adapter& a : adapters_) {
        add_param(specs, inits, a.module + ".lora_A.weight", Shape{rank_, in_},
                  {ParamInit::Kind::uniform, -bound, bound}, true);
        add_param(specs, inits, a.module + ".lora_B.weight", Shape{a.rows, rank_}, ParamInit::constant(0.0), true);
    }
}

void LoraAdapters::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    // every block of a kind shares the first one's scratch, adapted or not: declared whenever LoRA is on
    if (rank_ == 0) return;
    auto declare = [&](const std::string& n, int64_t cols) {
        for (BufferSpec& s : specs) {  // a block with several adapted projections: declared once, wide enough for all
            if (s.name != n) continue;
            if (s.shape[1] < cols) s.shape = Shape{max.tokens(), cols};
            return;
        }
        specs.push_back({n, DType::f32, Shape{max.tokens(), cols}});
    };
    declare(prefix + "lora.u", rank_);
    declare(prefix + "lora.du", rank_);
    if (dropout_ > 0) declare(prefix + "lora.xd", in_);  // the dropped input x̃
}

void LoraAdapters::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    for (Adapter& a : adapters_) {
        a.a = params.view(a.module + ".lora_A.weight");
        a.b = params.view(a.module + ".lora_B.weight");
        if (grads) {
            a.da = grads->find(a.module + ".lora_A.weight");
            a.db = grads->find(a.module + ".lora_B.weight");
        }
    }
}

void LoraAdapters::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    if (empty()) return;
    u_ = acts.view(prefix + "lora.u");
    du_ = acts.view(prefix + "lora.du");
    if (dropout_ > 0) xd_ = acts.view(prefix + "lora.xd");
}

void LoraAdapters::forward(TensorView x, TensorView y) const {
    const int64_t N = x.size(0);
    for (const Adapter& a : adapters_)
        ops::lora_forward(params(a), x, a.a, a.b, u_.slice0(0, N), y.columns(a.row, a.rows), xd_);
}

void LoraAdapters::backward(TensorView x, TensorView dy, TensorView dx) const {
    const int64_t N = x.size(0);
    for (const Adapter& a : adapters_) {
        ops::lora_backward(params(a), x, dy.columns(a.row, a.rows), a.a, a.b, u_.slice0(0, N), du_.slice0(0, N), dx,
                           a.da, a.db, xd_);
    }
}

TensorView LoraAdapters::merged(TensorView w, TensorView scratch) const {
    if (empty()) return w;
    TESSERA_CHECK(adapters_.size() == 1 && adapters_[0].rows == w.size(0), "{}: a merged adapter must cover the weight",
                  adapters_[0].module);
    TensorView out = scratch.prefix(w.shape);
    ops::lora_merge({.scale = scale_}, w, adapters_[0].a, adapters_[0].b, out);
    return out;
}

void LoraAdapters::backward_from_weight(TensorView dw) const {
    for (const Adapter& a : adapters_) ops::lora_weight_backward({.scale = scale_}, dw, a.a, a.b, a.da, a.db);
}

void merge_lora(const LoraConfig& c, const BufferGroup& params, const BufferGroup& merged) {
    for (size_t i = 0; i < merged.size(); ++i) {
        const std::string& name = merged.specs()[i].name;
        const TensorView w = merged.view(i), src = params.view(name);
        TESSERA_CHECK(w.shape == src.shape, "merge: {} is {} in the merged model, {} with adapters", name,
                      w.shape.str(), src.shape.str());
        convert(src, w);  // a base kept in bf16 widened to the merged model's f32
        if (!name.ends_with(".weight")) continue;
        const std::string module = name.substr(0, name.size() - 7);
        const TensorView a = params.find(module + ".lora_A.weight"), b = params.find(module + ".lora_B.weight");
        if (!a.defined()) continue;
        const int64_t experts = w.ndim() == 3 ? w.size(0) : 1;
        auto part = [&](TensorView v, int64_t e) {
            return experts > 1 || v.ndim() == 3 ? v.slice0(e, e + 1).reshape(Shape{v.size(-2), v.size(-1)}) : v;
        };
        for (int64_t e = 0; e < experts; ++e)
            ops::lora_merge({.scale = c.scale()}, part(w, e), part(a, e), part(b, e), part(w, e));
    }
}

double LoraAdapters::forward_flops_per_token() const {
    double f = 0;
    for (const Adapter& a : adapters_) f += ops::lora_forward_flops(1, in_, a.rows, rank_);
    return f;
}

}  // namespace tessera::model
