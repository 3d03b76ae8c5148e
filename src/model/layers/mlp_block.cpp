// Gated MLP block forward/backward: rmsnorm -> fused gate/up GEMM -> SwiGLU or SiTU-GLU -> down_proj.
#include "model/layers/mlp_block.h"

#include <cmath>

#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/situ_glu.h"
#include "ops/swiglu.h"

namespace tessera::model {

MlpBlock::MlpBlock(const ModelConfig& c, std::string param_prefix)
    : cfg_(c),
      prefix_(std::move(param_prefix)),
      C_(c.d_model),
      F_(c.ffn_dim),
      gate_up_lora_(c.lora, C_, {{prefix_ + "mlp.gate_proj", F_}, {prefix_ + "mlp.up_proj", F_}}),
      down_lora_(c.lora, F_, {{prefix_ + "mlp.down_proj", C_}}) {}

void MlpBlock::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const ParamInit w = ParamInit::normal(cfg_.init_std);
    const ParamInit out = ParamInit::normal(cfg_.init_std / std::sqrt(2.0 * double(cfg_.n_layers)));
    add_param(specs, inits, prefix_ + "post_attention_layernorm.weight", Shape{C_}, ParamInit::constant(1.0), false);
    add_param(specs, inits, prefix_ + "mlp.gate_proj.weight", Shape{F_, C_}, w, true);
    add_param(specs, inits, prefix_ + "mlp.up_proj.weight", Shape{F_, C_}, w, true);
    fuse_last(specs, 2);
    add_param(specs, inits, prefix_ + "mlp.down_proj.weight", Shape{C_, F_}, out, true);
    gate_up_lora_.declare_params(specs, inits);
    down_lora_.declare_params(specs, inits);
}

void MlpBlock::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    specs.push_back({.name = prefix + "ln", .shape = Shape{N, C_}, .narrowable = true});
    specs.push_back({.name = prefix + "rstd", .shape = Shape{N}});
    specs.push_back({.name = prefix + "gate_up", .shape = Shape{N, 2 * F_}, .narrowable = true});
    specs.push_back({.name = prefix + "h", .shape = Shape{N, F_}, .narrowable = true});
}

void MlpBlock::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    specs.push_back({prefix + "dln", DType::f32, Shape{N, C_}});
    specs.push_back({prefix + "dgate_up", DType::f32, Shape{N, 2 * F_}});
    specs.push_back({prefix + "dh", DType::f32, Shape{N, F_}});
    gate_up_lora_.declare_scratch(specs, prefix, max);
    down_lora_.declare_scratch(specs, prefix, max);
}

void MlpBlock::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    auto bind = [&](const BufferGroup& g, Weights& w, bool grad) {
        auto v = [&](const std::string& name) { return param_view(g, prefix_ + name, grad); };
        w.norm = v("post_attention_layernorm.weight");
        w.gate_up = adjacent({v("mlp.gate_proj.weight"), v("mlp.up_proj.weight")}, C_, prefix_ + "mlp gate/up");
        w.down = v("mlp.down_proj.weight");
    };
    bind(params, w_, false);
    has_grads_ = grads != nullptr;
    if (grads) bind(*grads, g_, true);
    gate_up_lora_.bind_params(params, grads);
    down_lora_.bind_params(params, grads);
}

void MlpBlock::bind_saved(const BufferGroup& acts, const std::string& prefix) {
    ln_ = acts.view(prefix + "ln");
    rstd_ = acts.view(prefix + "rstd");
    gu_ = acts.view(prefix + "gate_up");
    h_ = acts.view(prefix + "h");
}

void MlpBlock::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    dln_ = acts.view(prefix + "dln");
    dgu_ = acts.view(prefix + "dgate_up");
    dh_ = acts.view(prefix + "dh");
    gate_up_lora_.bind_scratch(acts, prefix);
    down_lora_.bind_scratch(acts, prefix);
}

TensorView MlpBlock::half(TensorView rows, int64_t col) const { return rows.columns(col, F_); }

void MlpBlock::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = s.tokens();
    TensorView x = x_in.slice0(0, N), ln = ln_.slice0(0, N), gu = gu_.slice0(0, N), h = h_.slice0(0, N);
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, w_.norm, ln, rstd_.slice0(0, N));
    ops::linear_forward({}, ln, w_.gate_up, {}, gu);
    gate_up_lora_.forward(ln, gu);
    if (cfg_.mlp_activation == "situ") {
        ops::situ_glu_forward({}, half(gu, 0), half(gu, F_), h);
    } else {
        ops::swiglu_forward(half(gu, 0), half(gu, F_), h);
    }
    start_output(x, x_out, N);
    ops::linear_forward({.accumulate = true}, h, w_.down, {}, x_out.slice0(0, N));
    down_lora_.forward(h, x_out.slice0(0, N));
}

void MlpBlock::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) {
    TESSERA_CHECK(has_grads_, "{}: backward without gradient buffers", prefix_);
    const int64_t N = s.tokens();
    TensorView d = dres.slice0(0, N), gu = gu_.slice0(0, N), dgu = dgu_.slice0(0, N), dh = dh_.slice0(0, N);
    TensorView dln = dln_.slice0(0, N);
    ops::zero_rows(dh_, N);
    ops::linear_backward(d, h_.slice0(0, N), w_.down, dh, g_.down, {});
    down_lora_.backward(h_.slice0(0, N), d, dh);
    ops::zero_rows(dgu_, N);
    if (cfg_.mlp_activation == "situ") {
        ops::situ_glu_backward({}, dh, half(gu, 0), half(gu, F_), half(dgu, 0), half(dgu, F_));
    } else {
        ops::swiglu_backward(dh, half(gu, 0), half(gu, F_), half(dgu, 0), half(dgu, F_));
    }
    ops::zero_rows(dln_, N);
    ops::linear_backward(dgu, ln_.slice0(0, N), w_.gate_up, dln, g_.gate_up, {});
    gate_up_lora_.backward(ln_.slice0(0, N), dgu, dln);
    start_input_grad(dres, N);
    ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln, x_in.slice0(0, N), w_.norm, rstd_.slice0(0, N), d, g_.norm);
}

double MlpBlock::forward_flops_per_token(int64_t) const {
    return 2.0 * 3.0 * double(C_) * double(F_) + gate_up_lora_.forward_flops_per_token() +
           down_lora_.forward_flops_per_token();
}

}  // namespace tessera::model
