// The KDA attention block (Kimi Linear; spec/kda.md §1) and its scalar-gate sibling GDN (Gated
// DeltaNet, arXiv 2412.06464):
//   h = rmsnorm(x);  [q|k|v] = silu(causal_conv(W_qkv·h));  q, k L2-normalised per head
//   g = gate(f_b·f_a·h)  (KDA, per channel)  or  gate(a·h)  (GDN, one per head), β = σ(b·h)
//   o = KDA(q, k, v, g, β);  y = rmsnorm_V(o)·w_onorm·act(z),  z = g_b·g_a·h (low rank) or g·h (full rank)
//   x_out = x + o_proj(y)
// gate(·) is −exp(A_log)·softplus(· + dt_bias), or lower_bound·σ(exp(A_log)·(· + dt_bias)).
// Tensor names follow the Kimi-Linear / Kimi K3 checkpoints (self_attn.q_proj, q_conv1d, f_a_proj,
// f_b_proj, b_proj, A_log, dt_bias, g_a_proj / g_b_proj or g_proj, o_norm, o_proj); GDN uses fla's
// a_proj. The q/k/v projections, the three convolutions, and the small projections taken from h
// (f_a or a, b, g_a or g) are laid out back to back and each group runs as one op.
// With document boundaries (StepShape::cu_seqlens) the convolutions and the recurrence restart at
// every document start.
#pragma once

#include <array>

#include "model/config.h"
#include "model/layers/block.h"
#include "model/lora.h"
#include "ops/kda.h"

namespace tessera::model {

class KdaBlock : public Block {
  public:
    KdaBlock(const KdaConfig& c, std::string param_prefix, const LoraConfig& lora = {});

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    size_t workspace_bytes(StepShape max, int num_threads) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    void set_pass(const PassOptions& o) override;  // the training pass's LoRA dropout masks
    void declare_cache(std::vector<BufferSpec>& specs,
                       const std::string& prefix,
                       int64_t batch,
                       int64_t max_len) const override;
    void bind_cache(const BufferGroup& cache, const std::string& prefix) override;
    // one token: the convolution window and the recurrent state [HV, K, V] carry the past (O(1) in pos)
    void step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    double forward_flops_per_token(int64_t seq) const override;
    std::string kind() const override { return cfg_.scalar_gate ? "gdn" : "kda"; }

  private:
    template <class Self>
    static auto adapters(Self& b) {
        return std::array{&b.qkv_lora_, &b.small_lora_, &b.f_b_lora_, &b.g_b_lora_, &b.o_lora_};
    }
    struct Weights {
        TensorView norm;     // [C]
        TensorView qkv;      // [Wqkv, C]: q_proj, k_proj, v_proj
        TensorView conv;     // [Wqkv, W]: q_conv1d, k_conv1d, v_conv1d
        TensorView small;    // [Ws, C]: f_a_proj (or a_proj), b_proj, g_a_proj (or g_proj)
        TensorView f_b;      // [HV·K, R] (KDA only)
        TensorView A_log;    // [HV]
        TensorView dt_bias;  // [HV·K] (KDA) or [HV] (GDN)
        TensorView g_b;      // [HV·V, V] (low-rank output gate only)
        TensorView o_norm;   // [V]
        TensorView o;        // [C, HV·V]
    };
    struct Acts {  // saved by forward (or, in scratch, the gradients of the same buffers)
        TensorView ln, rstd, qkv_raw, qkv, qn, kn, v, small, f, g, beta, o, z, y, states;
    };
    int64_t gate_width() const { return cfg_.scalar_gate ? 1 : K_; }  // decays per value head
    void bind_weights(const BufferGroup& g, Weights& w, bool grad) const;
    Acts bind_acts(const BufferGroup& acts, const std::string& prefix, bool saved) const;
    ops::KdaInputs kda_inputs(StepShape s, const Acts& a) const;
    bool saves_states(StepShape s) const { return s.cu_seqlens.empty(); }
    // after the convolution: l2-normalised q, k, v, the decays g and β; and the output norm, gate, o_proj
    // and residual after the recurrence wrote o
    void gates(int64_t N);
    void finish(int64_t N, TensorView x, TensorView x_out);

    KdaConfig cfg_;
    std::string prefix_;
    int64_t C_, H_, HV_, K_, V_, R_, W_;
    int64_t Wqkv_, Ws_, Go_;  // widths: [q|k|v], [f_a or a | b | g_a or g], output gate input
    // model.lora: q/k/v_proj; f_a (a) / b / g_a (g) _proj; f_b_proj; g_b_proj; o_proj
    LoraAdapters qkv_lora_, small_lora_, f_b_lora_, g_b_lora_, o_lora_;
    Weights w_, g_;
    bool has_grads_ = false;
    Acts a_, d_;                                  // saved activations and their gradients (scratch)
    TensorView conv_cache_, state_, state_next_;  // decoding: [B, W−1, Wqkv], [B, HV, K, V] × 2
};

}  // namespace tessera::model
