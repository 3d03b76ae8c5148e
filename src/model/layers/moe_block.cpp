// (Latent)MoE block: rmsnorm -> ops::moe_forward (router, capacity, dispatch, grouped experts,
// combine, latent projections, shared expert) -> residual; statistics and bias balancing per step.
#include "model/layers/moe_block.h"

#include <algorithm>
#include <cmath>

#include "core/device.h"
#include "core/rng.h"
#include "ops/rmsnorm.h"

namespace tessera::model {

MoeBlock::MoeBlock(const ModelConfig& c, std::string param_prefix, parallel::Comm* expert_group, int64_t ep_chunks)
    : cfg_(c),
      m_(c.moe),
      prefix_(std::move(param_prefix)),
      rule_(ops::parse_balance_rule(c.moe.balance, "model.moe.balance")),
      C_(c.d_model),
      L_(c.moe.latent_dim > 0 ? c.moe.latent_dim : c.d_model) {
    p_.router = {.topk = m_.topk,
                 .score = m_.score == "softmax" ? ops::RouterScore::softmax : ops::RouterScore::sigmoid,
                 .normalize = m_.normalize,
                 .scaling = m_.scaling,
                 .groups = m_.groups,
                 .topk_groups = m_.topk_groups};
    p_.capacity_factor = m_.capacity_factor;
    p_.overflow = m_.overflow == "drop" ? ops::MoeOverflow::drop : ops::MoeOverflow::reroute;
    p_.activation = m_.activation == "situ" ? ops::ExpertActivation::situ : ops::ExpertActivation::swiglu;
    p_.norm_eps = c.norm_eps;
    p_.seq_aux_coeff = m_.seq_aux_coeff;
    p_.z_loss_coeff = m_.z_loss_coeff;
    demand_.assign(size_t(m_.experts), 0);
    if (rule_ == ops::BalanceRule::quantile) {
        quantile_ = std::make_unique<ops::QuantileBalancer>(m_.experts, m_.topk);
    }
    if (c.lora.enabled()) {
        const int64_t r = c.lora.rank, F = m_.ffn_dim, FS = m_.shared_ffn_dim;
        using L = ops::MoeLora;
        std::vector<Adapter> all{{"experts.gate_proj", &L::w_gate, Shape{r, L_}, Shape{F, r}, true},
                                 {"experts.up_proj", &L::w_up, Shape{r, L_}, Shape{F, r}, true},
                                 {"experts.down_proj", &L::w_down, Shape{r, F}, Shape{L_, r}, true}};
        if (m_.latent_dim > 0) {
            all.push_back({"routed_expert_down_proj", &L::latent_down, Shape{r, C_}, Shape{L_, r}, false});
            all.push_back({"routed_expert_up_proj", &L::latent_up, Shape{r, L_}, Shape{C_, r}, false});
        }
        if (FS > 0) {
            all.push_back({"shared_experts.gate_proj", &L::shared_gate, Shape{r, C_}, Shape{FS, r}, false});
            all.push_back({"shared_experts.up_proj", &L::shared_up, Shape{r, C_}, Shape{FS, r}, false});
            all.push_back({"shared_experts.down_proj", &L::shared_down, Shape{r, FS}, Shape{C_, r}, false});
        }
        for (Adapter& a : all) {
            if (LoraConfig::names(c.lora.target_modules, prefix_ + "mlp." + a.module)) adapters_.push_back(a);
        }
        p_.lora.scale = c.lora.scale();
        p_.lora.dropout = c.lora.dropout;
        p_.lora.stream = hash_name(prefix_);
    }
    bool expert_adapters = false;
    for (const Adapter& a : adapters_) expert_adapters |= a.experts;
    if (expert_group && expert_group->size() > 1) {
        // NOTES: with a capacity factor the expert group shares each expert's room (capacity_shares), which also
        // bounds the rows a rank receives
        ep_ = std::make_unique<parallel::ExpertParallelStage>(
            *expert_group, parallel::EpDims{.experts = m_.experts,
                                            .topk = m_.topk,
                                            .latent = L_,
                                            .ffn = m_.ffn_dim,
                                            .chunks = ep_chunks,
                                            .capacity_factor = m_.capacity_factor,
                                            .lora_rank = expert_adapters ? c.lora.rank : 0});
        p_.stage = ep_.get();
    }
}

std::pair<int64_t, int64_t> MoeBlock::local_experts() const {
    return ep_ ? std::pair{ep_->first_expert(), ep_->local_experts()} : std::pair{int64_t(0), m_.experts};
}

void MoeBlock::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const int64_t E = m_.experts, F = m_.ffn_dim, FS = m_.shared_ffn_dim;
    const auto [first, El] = local_experts();
    const ParamInit w = ParamInit::normal(cfg_.init_std);
    const ParamInit out = ParamInit::normal(cfg_.init_std / std::sqrt(2.0 * double(cfg_.n_layers)));
    const std::string mlp = prefix_ + "mlp.";
    add_param(specs, inits, prefix_ + "post_attention_layernorm.weight", Shape{C_}, ParamInit::constant(1.0), false);
    add_param(specs, inits, mlp + "gate.weight", Shape{E, C_}, w, true);
    add_param(specs, inits, mlp + "gate.e_score_correction_bias", Shape{E}, ParamInit::constant(0.0), false);
    specs.back().sharding = Sharding::replicated;  // moved after the step, outside the block's compute: stays whole
    // the routed experts: this rank's slice of [E, ...] (expert parallelism), initialised as that slice of the whole
    const size_t experts_from = specs.size();
    add_param(specs, inits, mlp + "experts.gate_proj.weight", Shape{El, F, L_}, w, true);
    add_param(specs, inits, mlp + "experts.up_proj.weight", Shape{El, F, L_}, w, true);
    add_param(specs, inits, mlp + "experts.down_proj.weight", Shape{El, L_, F}, m_.latent_dim > 0 ? w : out, true);
    for (size_t i = experts_from; i < specs.size(); ++i) {
        specs[i].sharding = Sharding::expert;
        inits[i].element_offset = first * F * L_;
    }
    if (m_.latent_dim > 0) {
        add_param(specs, inits, mlp + "routed_expert_down_proj.weight", Shape{L_, C_}, w, true);
        add_param(specs, inits, mlp + "routed_expert_up_proj.weight", Shape{C_, L_}, out, true);
        if (m_.latent_norm) {
            add_param(specs, inits, mlp + "routed_expert_norm.weight", Shape{L_}, ParamInit::constant(1.0), false);
        }
    }
    if (FS > 0) {
        add_param(specs, inits, mlp + "shared_experts.gate_proj.weight", Shape{FS, C_}, w, true);
        add_param(specs, inits, mlp + "shared_experts.up_proj.weight", Shape{FS, C_}, w, true);
        add_param(specs, inits, mlp + "shared_experts.down_proj.weight", Shape{C_, FS}, out, true);
        if (m_.shared_expert_gate) add_param(specs, inits, mlp + "shared_expert_gate.weight", Shape{1, C_}, w, true);
    }
    // adapters (lora.h: A as PEFT's kaiming_uniform, B zero); the experts' after the experts, this rank's slice of
    // [E, ...] like them
    for (const Adapter& a : adapters_) {
        const double bound = 1.0 / std::sqrt(double(a.a[1]));
        const std::string m = mlp + a.module;
        auto shape = [&](const Shape& s) { return a.experts ? Shape{El, s[0], s[1]} : s; };
        add_param(specs, inits, m + ".lora_A.weight", shape(a.a), {ParamInit::Kind::uniform, -bound, bound}, true);
        add_param(specs, inits, m + ".lora_B.weight", shape(a.b), ParamInit::constant(0.0), true);
        if (!a.experts) continue;
        for (size_t i = specs.size() - 2; i < specs.size(); ++i) specs[i].sharding = Sharding::expert;
        inits[specs.size() - 2].element_offset = first * a.a.numel();
    }
}

ops::MoeDims MoeBlock::dims(int64_t tokens) const {
    ops::MoeDims d;
    d.tokens = tokens;
    d.d_model = C_;
    d.experts = m_.experts;
    d.topk = m_.topk;
    d.ffn = m_.ffn_dim;
    d.latent = L_;
    d.shared_ffn = m_.shared_ffn_dim;
    d.has_latent = m_.latent_dim > 0;
    d.has_norm = m_.latent_norm;
    d.has_shared = m_.shared_ffn_dim > 0;
    d.has_shared_scale = m_.shared_expert_gate;
    d.local_experts = local_experts().second;
    d.expert_rows_here = ep_ == nullptr;
    d.lora_rank = lora_rank();
    for (const Adapter& a : adapters_) d.lora_dropout |= !a.experts && cfg_.lora.dropout > 0;
    return d;
}

void MoeBlock::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    specs.push_back({.name = prefix + "ln", .shape = Shape{N, C_}, .narrowable = true});
    specs.push_back({.name = prefix + "rstd", .shape = Shape{N}});
    ops::moe_saved_specs(dims(N), DType::f32, prefix + "layer.", specs);
    if (ep_) ep_->saved_specs(prefix + "ep.", N, specs);
}

void MoeBlock::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    specs.push_back({prefix + "dln", DType::f32, Shape{max.tokens(), C_}});
    ops::moe_scratch_specs(dims(max.tokens()), DType::f32, prefix + "layer.", specs);
    if (ep_) ep_->scratch_specs(prefix + "ep.", max.tokens(), specs);
}

void MoeBlock::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    const std::string mlp = prefix_ + "mlp.";
    auto bind = [&](const BufferGroup& g, ops::MoeWeights& w, TensorView& norm, bool grad) {
        auto v = [&](const std::string& name) { return param_view(g, name, grad); };
        norm = v(prefix_ + "post_attention_layernorm.weight");
        w.router_w = v(mlp + "gate.weight");
        w.router_bias = v(mlp + "gate.e_score_correction_bias");
        w.w_gate = v(mlp + "experts.gate_proj.weight");
        w.w_up = v(mlp + "experts.up_proj.weight");
        w.w_down = v(mlp + "experts.down_proj.weight");
        if (m_.latent_dim > 0) {
            w.latent_down = v(mlp + "routed_expert_down_proj.weight");
            w.latent_up = v(mlp + "routed_expert_up_proj.weight");
            if (m_.latent_norm) w.latent_norm = v(mlp + "routed_expert_norm.weight");
        }
        if (m_.shared_ffn_dim > 0) {
            w.shared_gate = v(mlp + "shared_experts.gate_proj.weight");
            w.shared_up = v(mlp + "shared_experts.up_proj.weight");
            w.shared_down = v(mlp + "shared_experts.down_proj.weight");
            if (m_.shared_expert_gate) w.shared_scale = v(mlp + "shared_expert_gate.weight");
        }
    };
    bind(params, w_, norm_, false);
    for (const Adapter& a : adapters_) {
        const std::string m = mlp + a.module;
        w_.lora.*a.pair = {params.view(m + ".lora_A.weight"), params.view(m + ".lora_B.weight")};
    }
    has_grads_ = grads != nullptr;
    if (grads) {
        bias_frozen_ = grads->index_of(mlp + "gate.e_score_correction_bias") < 0;
        bind(*grads, g_, d_norm_, true);
        g_.router_bias = {};  // selection only: no gradient
        for (const Adapter& a : adapters_) {
            const std::string m = mlp + a.module;
            g_.lora.*a.pair = {grads->find(m + ".lora_A.weight"), grads->find(m + ".lora_B.weight")};
        }
    }
}

void MoeBlock::bind_saved(const BufferGroup& acts, const std::string& prefix) {
    ln_ = acts.view(prefix + "ln");
    rstd_ = acts.view(prefix + "rstd");
    saved_ = ops::moe_bind_saved(dims(1), acts, prefix + "layer.");
    offsets_host_.resize(saved_.offsets.device == Device::cuda ? size_t(saved_.offsets.numel()) : 0);
    if (ep_) ep_->bind_saved(acts, prefix + "ep.");
}

void MoeBlock::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    dln_ = acts.view(prefix + "dln");
    scratch_ = ops::moe_bind_scratch(dims(1), acts, prefix + "layer.");
    if (ep_) ep_->bind_scratch(acts, prefix + "ep.");
}

std::span<const int64_t> MoeBlock::sequences(StepShape s) {
    if (!s.cu_seqlens.empty()) return s.cu_seqlens;  // documents
    starts_.resize(size_t(s.batch) + 1);
    for (int64_t b = 0; b <= s.batch; ++b) starts_[size_t(b)] = b * s.seq;
    return starts_;
}

void MoeBlock::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte>) {
    const int64_t N = s.tokens();
    TensorView x = x_in.slice0(0, N), ln = ln_.slice0(0, N);
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, norm_, ln, rstd_.slice0(0, N));
    start_output(x, x_out, N);
    saved_.offsets_host = offsets_host_.empty() ? nullptr : offsets_host_.data();
    const ops::MoeStats st = ops::moe_forward(p_, w_, ln, x_out.slice0(0, N), true, saved_, scratch_, sequences(s));
    if (m_.global_aux_coeff > 0) {  // this forward's share of the global balance loss, for the model to pool
        bal_choices_.assign(size_t(m_.experts), 0.0);
        bal_probs_.assign(size_t(m_.experts), 0.0);
        ops::router_balance_stats(saved_.scores.slice0(0, N), saved_.choice.slice0(0, N), bal_choices_, bal_probs_);
        bal_rows_ = N;
    }
    if (!pass_.record) return;
    const std::span<const int32_t> demand = read_to_host(saved_.demand, demand_host_);
    for (int64_t e = 0; e < m_.experts; ++e) demand_[size_t(e)] += demand[size_t(e)];
    tokens_ += N;
    rerouted_ += st.rerouted;
    if (ep_) a2a_bytes_ += ep_->last_forward_bytes();
    dropped_ += st.dropped;
    seq_aux_ += st.seq_aux_loss;
    z_loss_ += st.z_loss;
    ++forwards_;
    entropy_sum_ += ops::routing_entropy_sum(saved_.scores.slice0(0, N));
    if (quantile_) {  // (on the host: the scores of a device copied there)
        const TensorView scores = saved_.scores.slice0(0, N);
        const std::span<const float> s = read_to_host(scores, scores_host_);
        quantile_->add(TensorView(const_cast<float*>(s.data()), DType::f32, scores.shape),
                       read_to_host(w_.router_bias, bias_host_));
    }
}

void MoeBlock::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte>) {
    TESSERA_CHECK(has_grads_, "{}: backward without gradient buffers", prefix_);
    const int64_t N = s.tokens();
    ops::MoeParams p = p_;  // the router losses count like the LM loss of this micro-batch
    p.seq_aux_coeff *= pass_.loss_scale;
    p.z_loss_coeff *= pass_.loss_scale;
    bal_scaled_.resize(bal_grad_.size());  // NOTES: sized once; no allocation per step
    for (size_t e = 0; e < bal_grad_.size(); ++e) bal_scaled_[e] = bal_grad_[e] * pass_.loss_scale;
    p.balance_grad = bal_scaled_;
    TensorView d = dres.slice0(0, N), dln = dln_.slice0(0, N);
    ops::zero_rows(dln_, N);
    ops::moe_backward(p, w_, ln_.slice0(0, N), d, dln, g_, saved_, scratch_, sequences(s));
    start_input_grad(dres, N);
    ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln, x_in.slice0(0, N), norm_, rstd_.slice0(0, N), d, d_norm_);
}

double MoeBlock::forward_flops_per_token(int64_t) const {
    double f = ops::moe_forward_flops_per_token(dims(1));
    for (const Adapter& a : adapters_)  // the experts' per routed row: k of them per token
        f += double(a.experts ? m_.topk : 1) * ops::lora_forward_flops(1, a.a[1], a.b[0], a.a[0]);
    return f;
}

void MoeBlock::update_bias(const std::function<void(std::span<int64_t>)>& sum_over_ranks) {
    if (sum_over_ranks) {
        sum_over_ranks(demand_);
        if (rule_ == ops::BalanceRule::quantile) sum_over_ranks(quantile_->counts());
    }
    if (bias_frozen_) {  // a frozen base (model.lora): its selection bias stays as loaded
        if (rule_ == ops::BalanceRule::quantile) quantile_->clear();
        return;
    }
    const TensorView b = w_.router_bias;  // moved on the host (a device's copied there and back)
    std::span<float> bias(b.ptr<float>(), size_t(m_.experts));
    if (b.device != Device::cpu) {
        read_to_host(b, bias_host_);
        bias = bias_host_;
    }
    if (rule_ == ops::BalanceRule::sign && forwards_ > 0) ops::balance_sign_update(demand_, m_.bias_update_rate, bias);
    if (rule_ == ops::BalanceRule::quantile) quantile_->update(bias);
    if (b.device != Device::cpu) copy_bytes(b.data, b.device, bias.data(), Device::cpu, bias.size_bytes());
}

void MoeBlock::take_stats(MoeLayerStats& st) {
    ops::moe_load(demand_, tokens_ ? entropy_sum_ / double(tokens_) : 0.0, st.load);
    st.tokens = tokens_;
    st.rerouted = rerouted_;
    st.dropped = dropped_;
    st.a2a_bytes = a2a_bytes_;
    if (ep_) {
        const parallel::EpTimes t = ep_->take_times();
        st.a2a_seconds = t.communication;
        st.a2a_exposed_seconds = t.exposed;
    }
    st.seq_aux_loss = forwards_ ? seq_aux_ / double(forwards_) : 0.0;
    st.z_loss = forwards_ ? z_loss_ / double(forwards_) : 0.0;
    const std::span<const float> b = read_to_host(w_.router_bias, bias_host_);
    st.bias_min = *std::min_element(b.begin(), b.end());
    st.bias_max = *std::max_element(b.begin(), b.end());
    std::fill(demand_.begin(), demand_.end(), 0);
    tokens_ = rerouted_ = dropped_ = forwards_ = a2a_bytes_ = 0;
    entropy_sum_ = seq_aux_ = z_loss_ = 0.0;
}

}  // namespace tessera::model
