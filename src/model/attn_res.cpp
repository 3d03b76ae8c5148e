// Attention Residuals dataflow (see attn_res.h).
#include "model/attn_res.h"

#include <algorithm>
#include <cstring>

#include "ops/attn_res.h"
#include "ops/rows.h"

namespace tessera::model {

AttnRes::AttnRes(int64_t n_layers, int64_t block_size, int64_t d_model, double eps, double init_std)
    : C_(d_model), eps_(eps), init_std_(init_std) {
    TESSERA_CHECK(block_size > 0, "attn_res: block size must be positive");
    // spec §2.2: x_a = Mix(R ∪ {P}); if l mod B = 0: R += P, P = ∅; P += attn; x_m = Mix(R ∪ {P}); P += ffn
    std::vector<int> R;
    int p = 0;  // P starts as the embedding
    for (int64_t l = 0; l < n_layers; ++l) {
        const int j = int(2 * l);
        Wiring attn{R, p, fmt::format("model.layers.{}.self_attention", l)};
        attn.sources.push_back(p);
        if (l % block_size == 0) {
            R.push_back(p);
            r_entries_.push_back(p);
            attn.base = -1;
        }
        wiring_.push_back(attn);
        Wiring mlp{R, j + 1, fmt::format("model.layers.{}.mlp", l)};
        mlp.sources.push_back(j + 1);
        wiring_.push_back(mlp);
        p = j + 2;
    }
    Wiring out{R, p, "model.output_attn"};
    out.sources.push_back(p);
    wiring_.push_back(out);
    for (auto& w : wiring_) max_sources_ = std::max(max_sources_, w.sources.size());
    src_.reserve(max_sources_);
    dsrc_.reserve(max_sources_);
}

void AttnRes::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    for (const Wiring& w : wiring_) {
        add_param(specs, inits, w.param + "_res_norm.weight", Shape{C_}, ParamInit::constant(1.0), false);
        add_param(specs, inits, w.param + "_res_proj.weight", Shape{1, C_}, ParamInit::normal(init_std_), true);
    }
    // read between the blocks, outside any one block's compute: whole on every rank (no FSDP gathers)
    for (size_t i = specs.size() - 2 * wiring_.size(); i < specs.size(); ++i) specs[i].sharding = Sharding::replicated;
}

void AttnRes::declare_acts(std::vector<BufferSpec>& specs, StepShape max) const {
    const int64_t N = max.tokens();
    specs.push_back({"attn_res.mix", DType::f32, Shape{N, C_}});
    specs.push_back({"attn_res.dmix", DType::f32, Shape{N, C_}});
    specs.push_back({"attn_res.probs", DType::f32, Shape{N * int64_t(max_sources_)}});
    specs.push_back({"attn_res.scratch", DType::f32, Shape{ops::attn_res_mix_scratch(N, int64_t(max_sources_), C_)}});
    for (int k : r_entries_) specs.push_back({fmt::format("attn_res.dR.{}", k), DType::f32, Shape{N, C_}});
}

void AttnRes::bind(const BufferGroup& params,
                   const BufferGroup* grads,
                   const BufferGroup& acts,
                   std::vector<TensorView> x) {
    x_ = std::move(x);
    mixes_.clear();
    for (const Wiring& w : wiring_) {
        Mix m;
        m.gamma = params.view(w.param + "_res_norm.weight");
        m.w = params.view(w.param + "_res_proj.weight").reshape(Shape{C_});
        if (grads) {
            m.dgamma = grads->find(w.param + "_res_norm.weight");  // undefined: frozen
            m.dw = grads->find(w.param + "_res_proj.weight");
            if (m.dw.defined()) m.dw = m.dw.reshape(Shape{C_});
        }
        mixes_.push_back(m);
    }
    mix_ = acts.view("attn_res.mix");
    dmix_ = acts.view("attn_res.dmix");
    probs_ = acts.view("attn_res.probs");
    scratch_ = acts.view("attn_res.scratch");
    dr_.assign(x_.size(), TensorView());
    for (int k : r_entries_) dr_[size_t(k)] = acts.view(fmt::format("attn_res.dR.{}", k));
}

std::span<const TensorView> AttnRes::views(const std::vector<int>& idx, int64_t N, std::vector<TensorView>& out) const {
    out.clear();
    for (int k : idx) out.push_back(x_[size_t(k)].slice0(0, N));
    return out;
}

TensorView AttnRes::mix_forward(const Wiring& wr, const Mix& m, int64_t N) {
    if (wr.sources.size() == 1) return x_[size_t(wr.sources[0])];  // one source: the mix is the identity
    const TensorView probs = probs_.prefix(Shape{N, int64_t(wr.sources.size())});
    ops::attn_res_mix_forward({.eps = eps_}, views(wr.sources, N, src_), m.gamma, m.w, mix_.slice0(0, N), probs,
                              scratch_);
    return mix_;
}

void AttnRes::mix_backward(const Wiring& wr, const Mix& m, TensorView dres, int64_t N) {
    TensorView dout = dmix_.slice0(0, N);
    if (wr.sources.size() == 1) {  // the identity: dP += dout
        ops::add_rows(dout, dres.slice0(0, N));
        return;
    }
    dsrc_.clear();
    for (size_t i = 0; i + 1 < wr.sources.size(); ++i) dsrc_.push_back(dr_[size_t(wr.sources[i])].slice0(0, N));
    dsrc_.push_back(dres.slice0(0, N));  // the current P
    const TensorView probs = probs_.prefix(Shape{N, int64_t(wr.sources.size())});
    ops::attn_res_mix_backward({.eps = eps_}, dout, views(wr.sources, N, src_), m.gamma, m.w, probs, dsrc_, m.dgamma,
                               m.dw, scratch_);
}

TensorView AttnRes::input(size_t j, int64_t N) { return mix_forward(wiring_[j], mixes_[j], N); }

void AttnRes::combine(size_t j, int64_t N) {
    const Wiring& wr = wiring_[j];
    if (wr.base < 0) return;
    ops::add_rows(x_[size_t(wr.base)].slice0(0, N), x_[j + 1].slice0(0, N));
}

TensorView AttnRes::output(int64_t N) { return mix_forward(wiring_.back(), mixes_.back(), N).slice0(0, N); }

void AttnRes::output_backward(TensorView dres, int64_t N) {
    for (int k : r_entries_) ops::zero_rows(dr_[size_t(k)], N);
    ops::zero_rows(dres, N);
    mix_backward(wiring_.back(), mixes_.back(), dres, N);
}

void AttnRes::begin_backward(TensorView dres, int64_t N) { ops::copy_rows(dres.slice0(0, N), dmix_.slice0(0, N)); }

void AttnRes::end_backward(size_t j, TensorView dres, int64_t N) {
    const Wiring& wr = wiring_[j];
    // the P before sublayer j: its gradient continues dres (P ← P + f) or, when P restarted, is what the later
    // mixes gave it as an R entry
    if (wr.base < 0) ops::copy_rows(dr_[size_t(wr.sources.back())].slice0(0, N), dres.slice0(0, N));
    mix_backward(wr, mixes_[j], dres, N);
}

}  // namespace tessera::model
