// Attention block forward/backward: rmsnorm -> fused qkv GEMM -> rope -> flash attention -> o_proj.
#include "model/layers/attention_block.h"

#include <omp.h>

#include <cmath>
#include <cstring>

#include "ops/attention.h"
#include "ops/decode.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace tessera::model {

AttentionBlock::AttentionBlock(const ModelConfig& c, std::string param_prefix)
    : cfg_(c),
      prefix_(std::move(param_prefix)),
      C_(c.d_model),
      H_(c.n_heads),
      HKV_(c.n_kv_heads),
      D_(c.head_dim_or_default()),
      Q_(c.n_heads * c.head_dim_or_default()),
      KV_(c.n_kv_heads * c.head_dim_or_default()),
      G_(c.output_gate == "elementwise" ? Q_
         : c.output_gate == "headwise"  ? H_
                                        : 0),
      W_(Q_ + 2 * KV_ + G_),
      R_(c.rope_dim > 0 ? c.rope_dim : c.head_dim_or_default()),
      qkv_lora_(c.lora,
                C_,
                {{prefix_ + "self_attn.q_proj", Q_},
                 {prefix_ + "self_attn.k_proj", KV_},
                 {prefix_ + "self_attn.v_proj", KV_},
                 {prefix_ + "self_attn.g_proj", G_}}),
      o_lora_(c.lora, Q_, {{prefix_ + "self_attn.o_proj", C_}}) {}

template <class F>
void AttentionBlock::for_qk_heads(F&& f) const {
    for (int64_t h = 0; h < H_; ++h) f(h * D_, false, h);
    for (int64_t h = 0; h < HKV_; ++h) f(Q_ + h * D_, true, H_ + h);
}

void AttentionBlock::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const ParamInit w = ParamInit::normal(cfg_.init_std);
    const ParamInit out = ParamInit::normal(cfg_.init_std / std::sqrt(2.0 * double(cfg_.n_layers)));  // GPT-2
    add_param(specs, inits, prefix_ + "input_layernorm.weight", Shape{C_}, ParamInit::constant(1.0), false);
    add_param(specs, inits, prefix_ + "self_attn.q_proj.weight", Shape{Q_, C_}, w, true);
    add_param(specs, inits, prefix_ + "self_attn.k_proj.weight", Shape{KV_, C_}, w, true);
    add_param(specs, inits, prefix_ + "self_attn.v_proj.weight", Shape{KV_, C_}, w, true);
    if (G_ > 0) add_param(specs, inits, prefix_ + "self_attn.g_proj.weight", Shape{G_, C_}, w, true);
    fuse_last(specs, G_ > 0 ? 4 : 3);
    add_param(specs, inits, prefix_ + "self_attn.o_proj.weight", Shape{C_, Q_}, out, true);
    if (cfg_.qk_norm) {
        add_param(specs, inits, prefix_ + "self_attn.q_norm.weight", Shape{D_}, ParamInit::constant(1.0), false);
        add_param(specs, inits, prefix_ + "self_attn.k_norm.weight", Shape{D_}, ParamInit::constant(1.0), false);
    }
    qkv_lora_.declare_params(specs, inits);
    o_lora_.declare_params(specs, inits);
}

void AttentionBlock::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    auto add = [&](const char* name, Shape s, bool narrowable) {
        specs.push_back({.name = prefix + name, .shape = s, .narrowable = narrowable});
    };
    add("ln", Shape{N, C_}, true);
    add("rstd", Shape{N}, false);
    add("qkv", Shape{N, W_}, true);
    add("o", Shape{N, Q_}, true);
    add("lse", Shape{N * H_}, false);
    if (G_ > 0) {
        add("gate", Shape{N, G_}, true);
        add("y", Shape{N, Q_}, true);
    }
    if (cfg_.qk_norm) {
        add("qk_raw", Shape{N, Q_ + KV_}, true);
        add("qk_rstd", Shape{(H_ + HKV_) * N}, false);
    }
}

void AttentionBlock::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    specs.push_back({prefix + "dln", DType::f32, Shape{N, C_}});
    specs.push_back({prefix + "dqkv", DType::f32, Shape{N, W_}});
    specs.push_back({prefix + "dqk", DType::f32, Shape{N, Q_ + KV_}});
    specs.push_back({prefix + "do", DType::f32, Shape{N, Q_}});
    if (G_ > 0) specs.push_back({prefix + "dy", DType::f32, Shape{N, Q_}});
    if (cfg_.qk_norm) specs.push_back({prefix + "dqn", DType::f32, Shape{N, Q_ + KV_}});
    qkv_lora_.declare_scratch(specs, prefix, max);
    o_lora_.declare_scratch(specs, prefix, max);
}

size_t AttentionBlock::workspace_bytes(StepShape max, int num_threads) const {
    // with document boundaries attention runs on one packed row of every token
    return ops::attention_workspace_bytes(DType::f32, max.tokens(), D_, num_threads);
}

void AttentionBlock::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    auto bind = [&](const BufferGroup& g, Weights& w, bool grad) {
        auto v = [&](const std::string& name) { return param_view(g, prefix_ + name, grad); };
        w.norm = v("input_layernorm.weight");
        std::vector<TensorView> parts{v("self_attn.q_proj.weight"), v("self_attn.k_proj.weight"),
                                      v("self_attn.v_proj.weight")};
        if (G_ > 0) parts.push_back(v("self_attn.g_proj.weight"));
        w.qkv = adjacent(parts, C_, prefix_ + "self_attn q/k/v/g projections");
        w.o = v("self_attn.o_proj.weight");
        if (cfg_.qk_norm) {
            w.q_norm = v("self_attn.q_norm.weight");
            w.k_norm = v("self_attn.k_norm.weight");
        }
    };
    bind(params, w_, false);
    has_grads_ = grads != nullptr;
    if (grads) bind(*grads, g_, true);
    qkv_lora_.bind_params(params, grads);
    o_lora_.bind_params(params, grads);
}

void AttentionBlock::bind_saved(const BufferGroup& acts, const std::string& prefix) {
    ln_ = acts.view(prefix + "ln");
    rstd_ = acts.view(prefix + "rstd");
    qkv_ = acts.view(prefix + "qkv");
    o_ = acts.view(prefix + "o");
    lse_ = acts.view(prefix + "lse");
    if (G_ > 0) {
        gate_ = acts.view(prefix + "gate");
        y_ = acts.view(prefix + "y");
    }
    if (cfg_.qk_norm) {
        qk_raw_ = acts.view(prefix + "qk_raw");
        qk_rstd_ = acts.view(prefix + "qk_rstd");
    }
}

void AttentionBlock::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    dln_ = acts.view(prefix + "dln");
    dqkv_ = acts.view(prefix + "dqkv");
    dqk_ = acts.view(prefix + "dqk");
    do_ = acts.view(prefix + "do");
    if (G_ > 0) dy_ = acts.view(prefix + "dy");
    if (cfg_.qk_norm) dqn_ = acts.view(prefix + "dqn");
    qkv_lora_.bind_scratch(acts, prefix);
    o_lora_.bind_scratch(acts, prefix);
}

TensorView AttentionBlock::head_view(TensorView rows, StepShape s, int64_t col, int64_t heads, int64_t width) const {
    return heads_view(rows, s, col, heads, D_, width > 0 ? width : D_);
}

void AttentionBlock::project(StepShape s, int64_t pos, TensorView x) {
    const int64_t N = s.tokens();
    TensorView ln = ln_.slice0(0, N), qkv = qkv_.slice0(0, N);
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, w_.norm, ln, rstd_.slice0(0, N));
    ops::linear_forward({}, ln, w_.qkv, {}, qkv);
    qkv_lora_.forward(ln, qkv);
    if (cfg_.qk_norm) {  // RMSNorm over each head of q and k (from a copy: backward needs the inputs)
        ops::copy_rows(qkv.columns(0, Q_ + KV_), qk_raw_.slice0(0, N));
        for_qk_heads([&](int64_t col, bool is_k, int64_t head) {
            ops::rmsnorm_forward({.eps = cfg_.norm_eps}, qk_raw_.slice0(0, N).columns(col, D_),
                                 is_k ? w_.k_norm : w_.q_norm, qkv.columns(col, D_),
                                 qk_rstd_.prefix(Shape{qk_rstd_.numel()}).slice0(head * N, (head + 1) * N));
        });
    }
    // positions per batch row (relative within documents), from pos
    const ops::RopeParams rope{.theta = cfg_.rope_theta, .offset = pos, .scaling = cfg_.rope_scaling};
    TensorView q = head_view(qkv, s, 0, H_, R_), k = head_view(qkv, s, Q_, HKV_, R_);
    ops::rope_forward(rope, q, q);
    ops::rope_forward(rope, k, k);
}

void AttentionBlock::finish(int64_t N, TensorView x, TensorView x_out) {
    TensorView o = o_.slice0(0, N);
    if (G_ > 0)
        ops::output_gate_forward(qkv_.slice0(0, N).columns(Q_ + 2 * KV_, G_), o, gate_.slice0(0, N), y_.slice0(0, N));
    start_output(x, x_out, N);
    const TensorView in = G_ > 0 ? y_.slice0(0, N) : o;
    ops::linear_forward({.accumulate = true}, in, w_.o, {}, x_out.slice0(0, N));
    o_lora_.forward(in, x_out.slice0(0, N));
}

void AttentionBlock::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = s.tokens();
    TensorView x = x_in.slice0(0, N), qkv = qkv_.slice0(0, N), o = o_.slice0(0, N);
    project(s, 0, x);
    const StepShape a = attention_shape(s);  // one packed row when documents are kept apart
    ops::attention_forward({}, head_view(qkv, a, 0, H_), head_view(qkv, a, Q_, HKV_), head_view(qkv, a, Q_ + KV_, HKV_),
                           o.reshape(Shape{a.batch, a.seq, H_, D_}), lse_.prefix(Shape{a.batch, H_, a.seq}), ws,
                           s.cu_seqlens);
    finish(N, x, x_out);
}

void AttentionBlock::declare_cache(std::vector<BufferSpec>& specs,
                                   const std::string& prefix,
                                   int64_t batch,
                                   int64_t max_len) const {
    specs.push_back({prefix + "k", DType::f32, Shape{batch, max_len, KV_}});
    specs.push_back({prefix + "v", DType::f32, Shape{batch, max_len, KV_}});
}

void AttentionBlock::bind_cache(const BufferGroup& cache, const std::string& prefix) {
    k_cache_ = cache.view(prefix + "k");
    v_cache_ = cache.view(prefix + "v");
}

void AttentionBlock::step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte>) {
    const int64_t L = k_cache_.size(1);
    TESSERA_CHECK(pos < L, "{}: position {} is past the {}-token cache", prefix_, pos, L);
    TensorView x = x_in.slice0(0, batch), qkv = qkv_.slice0(0, batch);
    project(StepShape{batch, 1}, pos, x);
    ops::copy_rows(qkv.columns(Q_, KV_), cache_rows(k_cache_, batch, pos));
    ops::copy_rows(qkv.columns(Q_ + KV_, KV_), cache_rows(v_cache_, batch, pos));
    const Shape kv{batch, L, HKV_, D_};
    ops::cached_attention(1.0 / std::sqrt(double(D_)), strided(qkv, Shape{batch, H_, D_}, {qkv.strides[0], D_, 1}),
                          k_cache_.slice0(0, batch).reshape(kv), v_cache_.slice0(0, batch).reshape(kv), {}, pos + 1,
                          o_.slice0(0, batch).reshape(Shape{batch, H_, D_}));
    finish(batch, x, x_out);
}

void AttentionBlock::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) {
    TESSERA_CHECK(has_grads_, "{}: backward without gradient buffers", prefix_);
    const int64_t N = s.tokens();
    TensorView d = dres.slice0(0, N), o = o_.slice0(0, N), qkv = qkv_.slice0(0, N);
    TensorView dO = do_.slice0(0, N), dqk = dqk_.slice0(0, N), dqkv = dqkv_.slice0(0, N), dln = dln_.slice0(0, N);
    ops::zero_rows(dqkv_, N);
    if (G_ > 0) {
        ops::zero_rows(dy_, N);
        ops::linear_backward(d, y_.slice0(0, N), w_.o, dy_.slice0(0, N), g_.o, {});
        o_lora_.backward(y_.slice0(0, N), d, dy_.slice0(0, N));
        ops::output_gate_backward(dy_.slice0(0, N), o, gate_.slice0(0, N), dO, dqkv.columns(Q_ + 2 * KV_, G_));
    } else {
        ops::zero_rows(do_, N);
        ops::linear_backward(d, o, w_.o, dO, g_.o, {});
        o_lora_.backward(o, d, dO);
    }
    ops::zero_rows(dqk_, N);
    const StepShape a = attention_shape(s);
    ops::attention_backward({}, dO.reshape(Shape{a.batch, a.seq, H_, D_}), head_view(qkv, a, 0, H_),
                            head_view(qkv, a, Q_, HKV_), head_view(qkv, a, Q_ + KV_, HKV_),
                            o.reshape(Shape{a.batch, a.seq, H_, D_}), lse_.prefix(Shape{a.batch, H_, a.seq}),
                            head_view(dqk, a, 0, H_), head_view(dqk, a, Q_, HKV_), head_view(dqkv, a, Q_ + KV_, HKV_),
                            ws, s.cu_seqlens);
    // through RoPE (the first R dims of each head; the rest pass), into dqkv or, with qk_norm, into dqn
    TensorView target = cfg_.qk_norm ? dqn_.slice0(0, N) : dqkv;
    if (cfg_.qk_norm) ops::zero_rows(dqn_, N);
    const ops::RopeParams rope{.theta = cfg_.rope_theta, .scaling = cfg_.rope_scaling};
    ops::rope_backward(rope, head_view(dqk, s, 0, H_, R_), head_view(target, s, 0, H_, R_));
    ops::rope_backward(rope, head_view(dqk, s, Q_, HKV_, R_), head_view(target, s, Q_, HKV_, R_));
    if (R_ < D_) {
        for_qk_heads([&](int64_t col, bool, int64_t) {
            ops::add_rows(dqk.columns(col + R_, D_ - R_), target.columns(col + R_, D_ - R_));
        });
    }
    if (cfg_.qk_norm) {
        for_qk_heads([&](int64_t col, bool is_k, int64_t head) {
            ops::rmsnorm_backward({.eps = cfg_.norm_eps}, target.columns(col, D_),
                                  qk_raw_.slice0(0, N).columns(col, D_), is_k ? w_.k_norm : w_.q_norm,
                                  qk_rstd_.prefix(Shape{qk_rstd_.numel()}).slice0(head * N, (head + 1) * N),
                                  dqkv.columns(col, D_), is_k ? g_.k_norm : g_.q_norm);
        });
    }
    ops::zero_rows(dln_, N);
    ops::linear_backward(dqkv, ln_.slice0(0, N), w_.qkv, dln, g_.qkv, {});
    qkv_lora_.backward(ln_.slice0(0, N), dqkv, dln);
    start_input_grad(dres, N);
    ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln, x_in.slice0(0, N), w_.norm, rstd_.slice0(0, N), d, g_.norm);
}

StepShape AttentionBlock::attention_shape(StepShape s) const {
    return s.cu_seqlens.empty() ? s : StepShape{1, s.tokens(), s.cu_seqlens};
}

double AttentionBlock::forward_flops_per_token(int64_t seq) const {
    const double proj = 2.0 * double(C_) * double(W_) + 2.0 * double(Q_) * double(C_) +
                        qkv_lora_.forward_flops_per_token() + o_lora_.forward_flops_per_token();
    const double scores = ops::attention_forward_flops(1, seq, H_, D_, true) / double(seq);
    return proj + scores;
}

}  // namespace tessera::model
