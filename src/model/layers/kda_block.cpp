// KDA / GDN block forward and backward (data flow: kda_block.h; gradients: spec/kda.md §3.3).
#include "model/layers/kda_block.h"

#include <omp.h>

#include <cmath>
#include <cstring>

#include "ops/causal_conv1d.h"
#include "ops/kda.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace tessera::model {

namespace {
std::vector<LoraAdapters::Part> part(const std::string& module, int64_t rows) { return {{module, rows}}; }
}  // namespace

KdaBlock::KdaBlock(const KdaConfig& c, std::string param_prefix, const LoraConfig& lora)
    : cfg_(c),
      prefix_(std::move(param_prefix)),
      C_(c.d_model),
      H_(c.num_heads),
      HV_(c.hv()),
      K_(c.head_dim),
      V_(c.v_dim()),
      R_(c.scalar_gate ? c.hv() : c.rank()),
      W_(c.conv_size) {
    cfg_.validate(prefix_ + "self_attn");
    Wqkv_ = 2 * H_ * K_ + HV_ * V_;
    Go_ = c.full_rank_output_gate ? HV_ * V_ : V_;
    Ws_ = R_ + HV_ + Go_;
    const std::string a = prefix_ + "self_attn.";
    qkv_lora_ = LoraAdapters(lora, C_, {{a + "q_proj", H_ * K_}, {a + "k_proj", H_ * K_}, {a + "v_proj", HV_ * V_}});
    small_lora_ = LoraAdapters(lora, C_,
                               {{a + (c.scalar_gate ? "a_proj" : "f_a_proj"), R_},
                                {a + "b_proj", HV_},
                                {a + (c.full_rank_output_gate ? "g_proj" : "g_a_proj"), Go_}});
    if (!c.scalar_gate) f_b_lora_ = LoraAdapters(lora, R_, part(a + "f_b_proj", HV_ * K_));
    if (!c.full_rank_output_gate) g_b_lora_ = LoraAdapters(lora, V_, part(a + "g_b_proj", HV_ * V_));
    o_lora_ = LoraAdapters(lora, HV_ * V_, part(a + "o_proj", C_));
}

void KdaBlock::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const ParamInit w = ParamInit::normal(cfg_.init_std);
    const std::string a = prefix_ + "self_attn.";
    auto add = [&](const std::string& name, Shape shape, ParamInit init, bool decay) {
        add_param(specs, inits, name, shape, init, decay);
    };
    add(prefix_ + "input_layernorm.weight", Shape{C_}, ParamInit::constant(1.0), false);
    add(a + "q_proj.weight", Shape{H_ * K_, C_}, w, true);
    add(a + "k_proj.weight", Shape{H_ * K_, C_}, w, true);
    add(a + "v_proj.weight", Shape{HV_ * V_, C_}, w, true);
    fuse_last(specs, 3);
    add(a + "q_conv1d.weight", Shape{H_ * K_, W_}, w, true);
    add(a + "k_conv1d.weight", Shape{H_ * K_, W_}, w, true);
    add(a + "v_conv1d.weight", Shape{HV_ * V_, W_}, w, true);
    for (size_t i = specs.size() - 3; i < specs.size(); ++i) specs[i].narrowable = false;  // the convolution's: f32
    fuse_last(specs, 3);
    add(a + (cfg_.scalar_gate ? "a_proj.weight" : "f_a_proj.weight"), Shape{R_, C_}, w, true);
    add(a + "b_proj.weight", Shape{HV_, C_}, w, true);
    add(a + (cfg_.full_rank_output_gate ? "g_proj.weight" : "g_a_proj.weight"), Shape{Go_, C_}, w, true);
    fuse_last(specs, 3);
    if (!cfg_.scalar_gate) add(a + "f_b_proj.weight", Shape{HV_ * K_, R_}, w, true);
    // spec/kda.md §1.1: A_log = ln U(1, 16), or 0 with the lower-bound gate; dt_bias = softplus⁻¹(dt)
    add(a + "A_log", Shape{HV_},
        cfg_.gate_lower_bound < 0 ? ParamInit::constant(0.0) : ParamInit{ParamInit::Kind::log_uniform, 1.0, 16.0},
        false);
    add(a + "dt_bias", Shape{HV_ * gate_width()}, ParamInit{ParamInit::Kind::dt_inverse_softplus, 1e-3, 1e-1}, false);
    if (!cfg_.full_rank_output_gate) add(a + "g_b_proj.weight", Shape{HV_ * V_, V_}, w, true);
    add(a + "o_norm.weight", Shape{V_}, ParamInit::constant(1.0), false);
    add(a + "o_proj.weight", Shape{C_, HV_ * V_}, ParamInit::normal(cfg_.init_std / std::sqrt(2.0 * cfg_.n_layers)),
        true);
    for (const LoraAdapters* l : adapters(*this)) l->declare_params(specs, inits);
}

void KdaBlock::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    // narrowable: the projections' inputs and outputs; the decay gates (f, g: summed over a chunk), β, the norms'
    // statistics and the chunk states stay f32
    auto add = [&](const char* name, Shape s, bool narrowable = false) {
        specs.push_back({.name = prefix + name, .shape = s, .narrowable = narrowable});
    };
    add("ln", Shape{N, C_}, true);
    add("rstd", Shape{N});
    add("qkv_raw", Shape{N, Wqkv_}, true);
    add("qkv", Shape{N, Wqkv_}, true);
    add("qn", Shape{N, H_ * K_}, true);
    add("kn", Shape{N, H_ * K_}, true);
    add("v", Shape{N, HV_ * V_}, true);
    add("small", Shape{N, Ws_});
    add("f", Shape{N, HV_ * gate_width()});
    add("g", Shape{N, HV_ * K_});
    add("beta", Shape{N, HV_});
    add("o", Shape{N, HV_ * V_}, true);
    add("z", Shape{N, HV_ * V_}, true);
    add("y", Shape{N, HV_ * V_}, true);
    // chunk states for the backward when batch rows are the sequences (with document boundaries the
    // number of chunks depends on the data, and the backward recomputes them instead)
    add("states", Shape{max.batch * ((max.seq + cfg_.chunk_size - 1) / cfg_.chunk_size), HV_, K_, V_});
}

void KdaBlock::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    auto add = [&](const char* name, Shape s) { specs.push_back({prefix + name, DType::f32, s}); };
    add("ln", Shape{N, C_});
    add("qkv_raw", Shape{N, Wqkv_});
    add("qkv", Shape{N, Wqkv_});
    add("qn", Shape{N, H_ * K_});
    add("kn", Shape{N, H_ * K_});
    add("v", Shape{N, HV_ * V_});
    add("small", Shape{N, Ws_});
    add("f", Shape{N, HV_ * gate_width()});
    add("g", Shape{N, HV_ * K_});
    add("beta", Shape{N, HV_});
    add("o", Shape{N, HV_ * V_});
    add("z", Shape{N, HV_ * V_});
    add("y", Shape{N, HV_ * V_});
    for (const LoraAdapters* l : adapters(*this)) l->declare_scratch(specs, prefix, max);
}

ops::KdaInputs KdaBlock::kda_inputs(StepShape s, const Acts& a) const {
    const bool packed = !s.cu_seqlens.empty();
    const int64_t B = packed ? 1 : s.batch, T = packed ? s.tokens() : s.seq;
    return {a.qn.prefix(Shape{B, T, H_, K_}),
            a.kn.prefix(Shape{B, T, H_, K_}),
            a.v.prefix(Shape{B, T, HV_, V_}),
            a.g.prefix(Shape{B, T, HV_, K_}),
            a.beta.prefix(Shape{B, T, HV_}),
            TensorView(),
            packed ? s.cu_seqlens : std::span<const int64_t>()};
}

size_t KdaBlock::workspace_bytes(StepShape max, int num_threads) const {
    // shapes only: the bound holds for any document boundaries within the rows
    const int64_t B = max.batch, T = max.seq;
    auto shape = [](Shape s) { return TensorView(nullptr, DType::f32, s); };
    const ops::KdaInputs in{shape(Shape{B, T, H_, K_}),
                            shape(Shape{B, T, H_, K_}),
                            shape(Shape{B, T, HV_, V_}),
                            shape(Shape{B, T, HV_, K_}),
                            shape(Shape{B, T, HV_}),
                            TensorView(),
                            {}};
    return ops::kda_workspace_bound({.chunk_size = cfg_.chunk_size}, in, T, true, num_threads, false);
}

void KdaBlock::bind_weights(const BufferGroup& g, Weights& w, bool grad) const {
    auto v = [&](const std::string& name) { return param_view(g, name, grad); };
    const std::string a = prefix_ + "self_attn.";
    w.norm = v(prefix_ + "input_layernorm.weight");
    w.qkv = adjacent({v(a + "q_proj.weight"), v(a + "k_proj.weight"), v(a + "v_proj.weight")}, C_, a + "q/k/v_proj");
    w.conv = adjacent({v(a + "q_conv1d.weight"), v(a + "k_conv1d.weight"), v(a + "v_conv1d.weight")}, W_,
                      a + "q/k/v_conv1d");
    w.small = adjacent({v(a + (cfg_.scalar_gate ? "a_proj.weight" : "f_a_proj.weight")), v(a + "b_proj.weight"),
                        v(a + (cfg_.full_rank_output_gate ? "g_proj.weight" : "g_a_proj.weight"))},
                       C_, a + "gate projections");
    if (!cfg_.scalar_gate) w.f_b = v(a + "f_b_proj.weight");
    w.A_log = v(a + "A_log");
    w.dt_bias = v(a + "dt_bias");
    if (!cfg_.full_rank_output_gate) w.g_b = v(a + "g_b_proj.weight");
    w.o_norm = v(a + "o_norm.weight");
    w.o = v(a + "o_proj.weight");
}

void KdaBlock::set_pass(const PassOptions& o) {
    for (LoraAdapters* l : adapters(*this)) l->set_seed(o.lora_seed);
}

void KdaBlock::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    bind_weights(params, w_, false);
    has_grads_ = grads != nullptr;
    if (grads) bind_weights(*grads, g_, true);
    for (LoraAdapters* l : adapters(*this)) l->bind_params(params, grads);
}

KdaBlock::Acts KdaBlock::bind_acts(const BufferGroup& acts, const std::string& prefix, bool saved) const {
    Acts a;
    a.ln = acts.view(prefix + "ln");
    if (saved) a.rstd = acts.view(prefix + "rstd");
    a.qkv_raw = acts.view(prefix + "qkv_raw");
    a.qkv = acts.view(prefix + "qkv");
    a.qn = acts.view(prefix + "qn");
    a.kn = acts.view(prefix + "kn");
    a.v = acts.view(prefix + "v");
    a.small = acts.view(prefix + "small");
    a.f = acts.view(prefix + "f");
    a.g = acts.view(prefix + "g");
    a.beta = acts.view(prefix + "beta");
    a.o = acts.view(prefix + "o");
    a.z = acts.view(prefix + "z");
    a.y = acts.view(prefix + "y");
    if (saved) a.states = acts.view(prefix + "states");
    return a;
}

void KdaBlock::bind_saved(const BufferGroup& acts, const std::string& prefix) { a_ = bind_acts(acts, prefix, true); }

void KdaBlock::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    d_ = bind_acts(acts, prefix, false);
    for (LoraAdapters* l : adapters(*this)) l->bind_scratch(acts, prefix);
}

void KdaBlock::gates(int64_t N) {
    const int64_t HK = H_ * K_, HVV = HV_ * V_;
    auto rows = [&](const TensorView& t) { return t.slice0(0, N); };
    TensorView qkv = rows(a_.qkv), small = rows(a_.small);
    for (int64_t h = 0; h < H_; ++h) {
        ops::l2norm_forward({}, qkv.columns(h * K_, K_), rows(a_.qn).columns(h * K_, K_));
        ops::l2norm_forward({}, qkv.columns(HK + h * K_, K_), rows(a_.kn).columns(h * K_, K_));
    }
    ops::copy_rows(qkv.columns(2 * HK, HVV), rows(a_.v));
    // forget gate
    TensorView f = rows(a_.f), g = rows(a_.g);
    if (cfg_.scalar_gate) {
        ops::copy_rows(small.columns(0, HV_), f);
    } else {
        ops::linear_forward({}, small.columns(0, R_), w_.f_b, {}, f);
        f_b_lora_.forward(small.columns(0, R_), f);
    }
    const ops::KdaGateParams gp{.lower_bound = cfg_.gate_lower_bound};
    // NOTES: GDN's per-head decay is computed into y (free until the output norm writes it) and
    // broadcast over K into g, so the recurrence sees one gate layout for both variants
    if (cfg_.scalar_gate) {
        TensorView gs = rows(a_.y).reshape(Shape{N * HVV}).slice0(0, N * HV_).reshape(Shape{N, HV_, 1});
        ops::kda_gate_forward(gp, f.reshape(Shape{N, HV_, 1}), w_.A_log, w_.dt_bias, gs);
        ops::expand_groups(gs.reshape(Shape{N, HV_}), g);
    } else {
        ops::kda_gate_forward(gp, f.reshape(Shape{N, HV_, K_}), w_.A_log, w_.dt_bias, g.reshape(Shape{N, HV_, K_}));
    }
    ops::sigmoid_forward(small.columns(R_, HV_), rows(a_.beta));
}

void KdaBlock::finish(int64_t N, TensorView x, TensorView x_out) {
    const int64_t HVV = HV_ * V_;
    auto rows = [&](const TensorView& t) { return t.slice0(0, N); };
    TensorView small = rows(a_.small), o = rows(a_.o), z = rows(a_.z), y = rows(a_.y);
    // output gate and norm
    if (cfg_.full_rank_output_gate) {
        ops::copy_rows(small.columns(R_ + HV_, HVV), z);
    } else {
        ops::linear_forward({}, small.columns(R_ + HV_, V_), w_.g_b, {}, z);
        g_b_lora_.forward(small.columns(R_ + HV_, V_), z);
    }
    const ops::GatedRmsNormParams np{.eps = cfg_.o_norm_eps, .activation = cfg_.output_gate_activation};
    ops::gated_rmsnorm_forward(np, o.reshape(Shape{N * HV_, V_}), z.reshape(Shape{N * HV_, V_}), w_.o_norm,
                               y.reshape(Shape{N * HV_, V_}));
    start_output(x, x_out, N);
    ops::linear_forward({.accumulate = true}, y, w_.o, {}, rows(x_out));
    o_lora_.forward(y, rows(x_out));
}

void KdaBlock::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = s.tokens();
    const bool packed = !s.cu_seqlens.empty();
    auto rows = [&](const TensorView& t) { return t.slice0(0, N); };
    TensorView x = rows(x_in), ln = rows(a_.ln), raw = rows(a_.qkv_raw), qkv = rows(a_.qkv);
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, w_.norm, ln, rows(a_.rstd));
    ops::linear_forward({}, ln, w_.qkv, {}, raw);
    qkv_lora_.forward(ln, raw);
    ops::linear_forward({}, ln, w_.small, {}, rows(a_.small));
    small_lora_.forward(ln, rows(a_.small));
    const Shape conv_shape = packed ? Shape{1, N, Wqkv_} : Shape{s.batch, s.seq, Wqkv_};
    ops::causal_conv1d_forward({.activation = ops::Activation::silu}, raw.reshape(conv_shape), w_.conv,
                               qkv.reshape(conv_shape), s.cu_seqlens);
    gates(N);
    const ops::KdaParams kp{.chunk_size = cfg_.chunk_size};
    const ops::KdaInputs in = kda_inputs(s, a_);
    TensorView states = saves_states(s) ? a_.states.prefix(ops::kda_saved_states_shape(kp, in)) : TensorView();
    ops::kda_forward(kp, in, rows(a_.o).reshape(in.v.shape), {}, ws, states);
    finish(N, x, x_out);
}

void KdaBlock::declare_cache(std::vector<BufferSpec>& specs, const std::string& prefix, int64_t batch, int64_t) const {
    specs.push_back({prefix + "conv", DType::f32, Shape{batch, W_ - 1, Wqkv_}});  // the last W−1 inputs
    specs.push_back({prefix + "state", DType::f32, Shape{batch, HV_, K_, V_}});
    specs.push_back({prefix + "state_next", DType::f32, Shape{batch, HV_, K_, V_}});
}

void KdaBlock::bind_cache(const BufferGroup& cache, const std::string& prefix) {
    conv_cache_ = cache.view(prefix + "conv");
    state_ = cache.view(prefix + "state");
    state_next_ = cache.view(prefix + "state_next");
}

void KdaBlock::step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = batch;
    auto rows = [&](const TensorView& t) { return t.slice0(0, N); };
    TensorView x = rows(x_in), ln = rows(a_.ln), raw = rows(a_.qkv_raw), qkv = rows(a_.qkv);
    if (pos == 0) {  // a new sequence: empty convolution window and state
        ops::zero_rows(conv_cache_, conv_cache_.size(0));
        ops::zero_rows(state_, state_.size(0));
    }
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, w_.norm, ln, rows(a_.rstd));
    ops::linear_forward({}, ln, w_.qkv, {}, raw);
    qkv_lora_.forward(ln, raw);
    ops::linear_forward({}, ln, w_.small, {}, rows(a_.small));
    small_lora_.forward(ln, rows(a_.small));
    // the convolution over the cached W−1 inputs and this one, then the window moves on
    ops::causal_conv1d_step({.activation = ops::Activation::silu}, raw, w_.conv, conv_cache_.slice0(0, N), qkv);
    gates(N);
    // one token of the recurrence from the cached state
    const ops::KdaParams kp{.chunk_size = cfg_.chunk_size, .mode = ops::KdaMode::recurrent};
    ops::KdaInputs in = kda_inputs(StepShape{N, 1}, a_);
    in.h0 = state_;
    ops::kda_forward(kp, in, rows(a_.o).reshape(in.v.shape), state_next_, ws);
    ops::copy_rows(state_next_, state_);
    finish(N, x, x_out);
}

void KdaBlock::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) {
    TESSERA_CHECK(has_grads_, "{}: backward without gradient buffers", prefix_);
    const int64_t N = s.tokens(), HK = H_ * K_, HVV = HV_ * V_;
    const bool packed = !s.cu_seqlens.empty();
    auto rows = [&](const TensorView& t) { return t.slice0(0, N); };
    for (const TensorView* t : {&d_.ln, &d_.qkv_raw, &d_.qkv, &d_.qn, &d_.kn, &d_.v, &d_.small, &d_.f, &d_.g, &d_.beta,
                                &d_.o, &d_.z, &d_.y}) {
        ops::zero_rows(*t, N);
    }
    TensorView small = rows(a_.small), dsmall = rows(d_.small), o = rows(a_.o), z = rows(a_.z);
    ops::linear_backward(rows(dres), rows(a_.y), w_.o, rows(d_.y), g_.o, {});
    o_lora_.backward(rows(a_.y), rows(dres), rows(d_.y));
    const ops::GatedRmsNormParams np{.eps = cfg_.o_norm_eps, .activation = cfg_.output_gate_activation};
    const Shape heads{N * HV_, V_};
    ops::gated_rmsnorm_backward(np, rows(d_.y).reshape(heads), o.reshape(heads), z.reshape(heads), w_.o_norm,
                                rows(d_.o).reshape(heads), rows(d_.z).reshape(heads), g_.o_norm);
    if (cfg_.full_rank_output_gate) {
        ops::add_rows(rows(d_.z), dsmall.columns(R_ + HV_, HVV));
    } else {
        ops::linear_backward(rows(d_.z), small.columns(R_ + HV_, V_), w_.g_b, dsmall.columns(R_ + HV_, V_), g_.g_b, {});
        g_b_lora_.backward(small.columns(R_ + HV_, V_), rows(d_.z), dsmall.columns(R_ + HV_, V_));
    }
    // the recurrence
    const ops::KdaParams kp{.chunk_size = cfg_.chunk_size};
    const ops::KdaInputs in = kda_inputs(s, a_), din = kda_inputs(s, d_);
    TensorView states = saves_states(s) ? a_.states.prefix(ops::kda_saved_states_shape(kp, in)) : TensorView();
    ops::kda_backward(kp, in, rows(d_.o).reshape(in.v.shape), {}, {din.q, din.k, din.v, din.g, din.beta, {}}, ws,
                      states);
    // β = σ(b·h)
    ops::sigmoid_backward(rows(d_.beta), rows(a_.beta), dsmall.columns(R_, HV_));
    // forget gate
    const ops::KdaGateParams gp{.lower_bound = cfg_.gate_lower_bound};
    TensorView f = rows(a_.f), df = rows(d_.f), dg = rows(d_.g);
    if (cfg_.scalar_gate) {  // the broadcast's gradient sums over K (into dy, free again)
        TensorView dgs = rows(d_.y).reshape(Shape{N * HVV}).slice0(0, N * HV_).reshape(Shape{N, HV_, 1});
        ops::sum_groups(dg, dgs.reshape(Shape{N, HV_}));
        ops::kda_gate_backward(gp, dgs, f.reshape(Shape{N, HV_, 1}), w_.A_log, w_.dt_bias, df.reshape(Shape{N, HV_, 1}),
                               g_.A_log, g_.dt_bias);
        ops::add_rows(df, dsmall.columns(0, HV_));
    } else {
        ops::kda_gate_backward(gp, dg.reshape(Shape{N, HV_, K_}), f.reshape(Shape{N, HV_, K_}), w_.A_log, w_.dt_bias,
                               df.reshape(Shape{N, HV_, K_}), g_.A_log, g_.dt_bias);
        ops::linear_backward(df, small.columns(0, R_), w_.f_b, dsmall.columns(0, R_), g_.f_b, {});
        f_b_lora_.backward(small.columns(0, R_), df, dsmall.columns(0, R_));
    }
    // L2 norms, short convolutions, projections, input norm
    TensorView qkv = rows(a_.qkv), dqkv = rows(d_.qkv);
    for (int64_t h = 0; h < H_; ++h) {
        ops::l2norm_backward({}, rows(d_.qn).columns(h * K_, K_), qkv.columns(h * K_, K_), dqkv.columns(h * K_, K_));
        ops::l2norm_backward({}, rows(d_.kn).columns(h * K_, K_), qkv.columns(HK + h * K_, K_),
                             dqkv.columns(HK + h * K_, K_));
    }
    ops::add_rows(rows(d_.v), dqkv.columns(2 * HK, HVV));
    const Shape conv_shape = packed ? Shape{1, N, Wqkv_} : Shape{s.batch, s.seq, Wqkv_};
    ops::causal_conv1d_backward({.activation = ops::Activation::silu}, dqkv.reshape(conv_shape),
                                rows(a_.qkv_raw).reshape(conv_shape), w_.conv, rows(d_.qkv_raw).reshape(conv_shape),
                                g_.conv, s.cu_seqlens);
    TensorView ln = rows(a_.ln), dln = rows(d_.ln);
    ops::linear_backward(rows(d_.qkv_raw), ln, w_.qkv, dln, g_.qkv, {});
    qkv_lora_.backward(ln, rows(d_.qkv_raw), dln);
    ops::linear_backward(dsmall, ln, w_.small, dln, g_.small, {});
    small_lora_.backward(ln, dsmall, dln);
    start_input_grad(dres, N);
    ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln, rows(x_in), w_.norm, rows(a_.rstd), rows(dres), g_.norm);
}

double KdaBlock::forward_flops_per_token(int64_t) const {
    const double HVV = double(HV_ * V_);
    double f = 2.0 * double(C_) * double(Wqkv_ + Ws_) + 2.0 * HVV * double(C_);  // input and output projections
    if (!cfg_.scalar_gate) f += 2.0 * double(R_) * double(HV_ * K_);
    if (!cfg_.full_rank_output_gate) f += 2.0 * double(V_) * HVV;
    f += 2.0 * double(W_) * double(Wqkv_);                     // convolutions
    f += ops::kda_forward_flops(1, HV_, K_, cfg_.chunk_size);  // the recurrence (paper's count, K = V)
    for (const LoraAdapters* l : adapters(*this)) f += l->forward_flops_per_token();
    return f;
}

}  // namespace tessera::model
