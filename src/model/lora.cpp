// LoRA adapters of a projection (see lora.h).
#include "model/lora.h"

#include <cmath>

#include "core/check.h"
#include "ops/gemm.h"

namespace tessera::model {

using ops::Trans;

LoraAdapters::LoraAdapters(const LoraConfig& c, int64_t in, const std::vector<Part>& parts)
    : rank_(c.enabled() ? c.rank : 0), in_(in), scale_(c.enabled() ? c.scale() : 1.0) {
    if (!c.enabled()) return;
    int64_t row = 0;
    for (const Part& p : parts) {
        if (p.rows > 0 && LoraConfig::names(c.target_modules, p.module)) adapters_.push_back({p.module, row, p.rows});
        row += p.rows;
    }
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
    for (const char* name : {"lora.u", "lora.du"}) {
        const std::string n = prefix + name;
        bool declared = false;  // a block with several adapted projections declares them once
        for (const BufferSpec& s : specs) declared |= s.name == n;
        if (!declared) specs.push_back({n, DType::f32, Shape{max.tokens(), rank_}});
    }
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
}

namespace {
struct RowsOf {  // a row-strided f32 [N, *] view as pointer + leading dimension
    float* p;
    int64_t ld;
    explicit RowsOf(TensorView v) : p(v.ptr<float>()), ld(v.ndim() == 2 ? v.strides[0] : v.size(-1)) {}
};
}  // namespace

void LoraAdapters::forward(TensorView x, TensorView y) const {
    const int64_t N = x.size(0), r = rank_;
    const RowsOf X(x), Y(y);
    float* u = u_.ptr<float>();
    for (const Adapter& a : adapters_) {
        ops::gemm(Trans::N, Trans::T, N, r, in_, 1.f, X.p, X.ld, a.a.ptr<float>(), in_, 0.f, u, r);
        ops::gemm(Trans::N, Trans::T, N, a.rows, r, float(scale_), u, r, a.b.ptr<float>(), r, 1.f, Y.p + a.row, Y.ld);
    }
}

void LoraAdapters::backward(TensorView x, TensorView dy, TensorView dx) const {
    const int64_t N = x.size(0), r = rank_;
    const RowsOf X(x), DY(dy);
    float *u = u_.ptr<float>(), *du = du_.ptr<float>();
    const float s = float(scale_);
    for (const Adapter& a : adapters_) {
        const float* dya = DY.p + a.row;
        ops::gemm(Trans::N, Trans::T, N, r, in_, 1.f, X.p, X.ld, a.a.ptr<float>(), in_, 0.f, u, r);
        if (a.db.defined()) ops::gemm(Trans::T, Trans::N, a.rows, r, N, s, dya, DY.ld, u, r, 1.f, a.db.ptr<float>(), r);
        ops::gemm(Trans::N, Trans::N, N, r, a.rows, s, dya, DY.ld, a.b.ptr<float>(), r, 0.f, du, r);
        if (a.da.defined())
            ops::gemm(Trans::T, Trans::N, r, in_, N, 1.f, du, r, X.p, X.ld, 1.f, a.da.ptr<float>(), in_);
        if (dx.defined()) {
            const RowsOf DX(dx);
            ops::gemm(Trans::N, Trans::N, N, in_, r, 1.f, du, r, a.a.ptr<float>(), in_, 1.f, DX.p, DX.ld);
        }
    }
}

double LoraAdapters::forward_flops_per_token() const {
    double f = 0;
    for (const Adapter& a : adapters_) f += 2.0 * double(rank_) * double(in_ + a.rows);
    return f;
}

}  // namespace tessera::model
