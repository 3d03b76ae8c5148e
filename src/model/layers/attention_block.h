// Pre-norm causal self-attention block (Llama layout and tensor names):
//   x_out = x_in + o_proj(attention(rope(q), rope(k), v) ⊙ σ(z)),  [q | k | v | z] = qkv_proj(rmsnorm(x_in))
// The sigmoid output gate (gated attention as in Qwen3-Next, arXiv 2505.06708; model.output_gate) is
// optional: z = g_proj(h) has one value per output element (elementwise) or per head (headwise).
// Qwen3-style options: model.qk_norm (RMSNorm over each head of q and k, weights q_norm / k_norm [D],
// before RoPE) and model.rope_dim (partial rotary: only the first rope_dim dims of a head rotate).
// q_proj, k_proj, v_proj (and g_proj) are separate parameters laid out back to back, so one GEMM computes
// all of them through a fused [Q + 2·KV + G, C] view. Letters: Q = H·D, KV = HKV·D, G = gate width.
#pragma once

#include "model/config.h"
#include "model/layers/block.h"
#include "model/lora.h"

namespace tessera::model {

class AttentionBlock : public Block {
  public:
    AttentionBlock(const ModelConfig& c, std::string param_prefix);

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    size_t workspace_bytes(StepShape max, int num_threads) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    void set_pass(const PassOptions& o) override {  // the training pass's LoRA dropout masks
        qkv_lora_.set_seed(o.lora_seed);
        o_lora_.set_seed(o.lora_seed);
    }
    void declare_cache(std::vector<BufferSpec>& specs,
                       const std::string& prefix,
                       int64_t batch,
                       int64_t max_len) const override;
    void bind_cache(const BufferGroup& cache, const std::string& prefix) override;
    void step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    double forward_flops_per_token(int64_t seq) const override;
    std::string kind() const override { return "attention"; }

  private:
    struct Weights {
        TensorView norm;            // [C]
        TensorView qkv;             // [W, C]: q_proj, k_proj, v_proj, g_proj
        TensorView o;               // [C, Q]
        TensorView q_norm, k_norm;  // [D] each (qk_norm)
    };
    // views of q, k, v inside a [N, Q + 2KV] (or [N, Q + KV]) row buffer, as [B, T, heads, width]
    // (width: the first `width` dims of each head; D by default)
    TensorView head_view(TensorView rows, StepShape s, int64_t col, int64_t heads, int64_t width = 0) const;
    // the q/k heads of a [N, *] buffer (q at column 0, k at Q) one at a time: f(head column, is_k, head index)
    template <class F>
    void for_qk_heads(F&& f) const;
    // the shape attention runs on: [B, T], or one packed row of B·T tokens with document boundaries
    StepShape attention_shape(StepShape s) const;
    // rmsnorm, the fused projection, q/k norms and RoPE from position pos; and the output gate, o_proj
    // and residual after attention wrote o
    void project(StepShape s, int64_t pos, TensorView x);
    void finish(int64_t N, TensorView x, TensorView x_out);

    ModelConfig cfg_;
    std::string prefix_;
    int64_t C_, H_, HKV_, D_, Q_, KV_, G_, W_;  // W_ = Q + 2KV + G
    int64_t R_;                                 // rotated dims per head
    LoraAdapters qkv_lora_, o_lora_;            // model.lora: q/k/v/g_proj, o_proj
    Weights w_, g_;
    bool has_grads_ = false;
    // saved: ln [N, C], rstd [N], qkv [N, W], o [N, Q], lse [B·H·T]; gated: gate [N, G], y [N, Q]
    // qk_norm: qk_raw [N, Q+KV] (q, k before the norms), qk_rstd [(H+HKV)·N] (per head, head-major)
    TensorView ln_, rstd_, qkv_, o_, lse_, gate_, y_, qk_raw_, qk_rstd_;
    // scratch: dln [N, C], dqkv [N, W], dqk [N, Q+KV] (pre-rope), do [N, Q]; gated: dy [N, Q];
    // qk_norm: dqn [N, Q+KV] (gradient of the normed q, k)
    TensorView dln_, dqkv_, dqk_, do_, dy_, dqn_;
    TensorView k_cache_, v_cache_;  // decoding: [B, L, KV] each
};

}  // namespace tessera::model
