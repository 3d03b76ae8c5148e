// Multi-head latent attention (MLA, DeepSeek-V2/V3) as a pre-norm residual block, with the optional
// sigmoid output gate (Gated Attention, arXiv 2505.06708) and the optional DSA lightning indexer
// (DeepSeek-V3.2): spec/dsa.md §1, docs/dsa.md.
//   h = rmsnorm(x);  c^Q = rmsnorm(W_DQ h) (q_lora) and q = W_UQ c^Q, or q = W_Q h;  q_h = [q^C (d_n) | q^R (d_r)]
//   [c^KV | k^R] = W_DKV h;  c^KV = rmsnorm(c^KV);  q^R, k^R rotated (interleaved pairs; identity when NoPE)
//   MQA mode: q̂_h = [W_UK_hᵀ q^C_h | q^R_h], entry c_s = [c^KV_s | k^R_s] (D_k = r_kv + d_r), shared by all heads
//   o^C_h = softmax_s(τ q̂_h·c_s) c_s[:r_kv] over s ≤ t (dense) or the indexer's top-k set S_t (DSA)
//   o_h = W_UV_h o^C_h;  y = o ⊙ σ(W_G h) (elementwise, per head with "headwise", or no gate);  x_out = x + W_O y
// Indexer: q^I = W_IQ c^Q (or W_IQ h), k^I = LayerNorm(W_IK h), both rotated on their first d_r^I dims
// (rotate-half pairs), w = W_Iw h · (H^I·d^I)^-1/2; I[t,s] = Σ_j w_j relu(q^I_j·k^I_s); S_t = top-k of I.
// One attention path for every mode: MQA entries of width D_k, the value being their first r_kv dims.
// Dense layers run the flash attention op (k = v = the entry, one kv head; the value's last d_r outputs
// are discarded and get zero gradient), DSA layers the sparse_attention op over S_t.
// Training stages (spec/dsa.md §3.1): "sparse": top-k attention; the LM loss trains everything but the
// indexer, the indexer learns only from KL(p ‖ softmax(I)) over S_t, p = the head mean of the layer's own
// attention probabilities, with detached inputs (no KL gradient reaches h or c^Q). "dense_warmup":
// attention over every s ≤ t and the KL over all of them (indices and p are [T, T] per sequence: O(T²)
// memory, for the moderate warm-up lengths); the model trains only the indexer then (Model::trainable).
// Tensor names follow DeepSeek-V3.2 / Kimi checkpoints: self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
// q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, g_proj}, self_attn.indexer.{wq_b, wk,
// k_norm (weight, bias), weights_proj}. kv_b_proj rows per head are [W_UK_h (d_n) | W_UV_h (d_v)].
#pragma once

#include <array>

#include "model/config.h"
#include "model/layers/block.h"
#include "model/lora.h"
#include "ops/dsa.h"
#include "parallel/comm.h"

namespace tessera::model {

// The indexer KL of the backward passes since the last take (sparse stage) or of the warm-up passes.
struct DsaLayerStats {
    double kl = 0.0;  // mean over the passes of each pass's mean KL per row
    int64_t passes = 0;
};

class MlaBlock : public Block {
  public:
    MlaBlock(const MlaConfig& c, std::string param_prefix, const LoraConfig& lora = {});

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    size_t workspace_bytes(StepShape max, int num_threads) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    // LM-loss backward of the main path; with an indexer, adds the KL gradient of the indexer weights.
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    void declare_cache(std::vector<BufferSpec>& specs,
                       const std::string& prefix,
                       int64_t batch,
                       int64_t max_len) const override;
    void bind_cache(const BufferGroup& cache, const std::string& prefix) override;
    // one token: the entry (and indexer key) join the caches; attention over every cached entry, or over
    // the indexer's top-k of them
    void step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    double forward_flops_per_token(int64_t seq) const override;
    std::string kind() const override { return cfg_.dsa.enabled() ? "dsa" : "mla"; }
    void set_pass(const PassOptions& o) override;

    // The indexer's KL loss and its gradient into the indexer weights only (after forward; the warm-up
    // stage runs this instead of backward; ws: the workspace forward and backward get). Returns the mean KL
    // per row of this pass.
    double indexer_backward(StepShape s, std::span<std::byte> ws);
    bool is_indexer_param(const std::string& name) const;
    bool head_independent_gradient(const std::string& param) const override { return is_indexer_param(param); }
    // Tensor parallelism (model/layers/tensor_slice.h): this block runs the group's share of the layer's heads, its
    // indexer whole; the indexer's teacher is the mean over every rank's heads (summed over the group).
    void share_heads(parallel::Comm* group) { head_group_ = group; }
    DsaLayerStats take_stats();
    const MlaConfig& config() const { return cfg_; }

  private:
    struct Weights {
        TensorView norm, h_proj;  // [C], [Wh, C]: q_a_proj or q_proj | kv_a_proj_with_mqa | g_proj | wk | weights_proj
        TensorView q_norm, q_b;   // [r_q], [H·Dq, r_q] (q_lora only)
        TensorView kv_norm, kv_b, o;          // [r_kv], [H·(d_n+d_v), r_kv], [C, H·d_v]
        TensorView iq, ik_norm_w, ik_norm_b;  // [H^I·d^I, r_q or C], [d^I], [d^I]
    };
    struct Acts {
        TensorView ln, rstd, hp, cq, cq_rstd, q, kv, kv_rstd, qhat, oc, lse, ov, gate, y;
        TensorView qi, ki, wi, ki_mean, ki_rstd, idx;
    };
    struct Scratch {
        TensorView dln, dhp, dcq, dq, dkv, dv, dqhat, doc, dy, dov, p, dqi, dki, dwi, dqi_pre, dki_pre;
    };
    void bind_weights(const BufferGroup& g, Weights& w, bool grad) const;
    int64_t index_width(StepShape max) const;  // K of the saved indices: topk, or T in the warm-up
    // W_UK (value false) or W_UV of kv_b_proj-shaped w [H·(d_n+d_v), r_kv] as per-head matrices (ops/matmul.h)
    TensorView kv_b_part(TensorView w, bool value) const;
    int64_t oc_width() const;                           // per-head width of oc: D_k (dense) or r_kv (DSA)
    StepShape flat(StepShape s) const;                  // [B, T], or one packed row when documents are packed
    ops::SparseAttentionParams sparse_params() const;   // the sparse attention of DSA layers
    TensorView q_rows(const Acts& a, int64_t N) const;  // q [N, H·Dq] (its own buffer or columns of hp)
    float indexer_weight_scale() const { return float(1.0 / std::sqrt(double(HI_ * DI_))); }  // (H^I·d^I)^-1/2
    void indexer_forward(StepShape s, int64_t pos);
    // the projections up to q̂, the entries and the indexer's q, k, w (positions from pos); and W_UV, the
    // gate, o_proj and the residual after attention wrote oc
    void project(StepShape s, int64_t pos, TensorView x);
    void finish(int64_t N, TensorView x, TensorView x_out);
    double lora_flops() const;
    void select(StepShape s, std::span<std::byte> ws);

    MlaConfig cfg_;
    std::string prefix_;
    int64_t C_, H_, RQ_, RKV_, DN_, DR_, DV_, DQ_, DK_, G_, HI_, DI_;
    int64_t Wq_, Wh_, Wmain_;  // widths: q part of hp, all of hp, the part the LM loss trains
    int64_t col_kv_, col_g_, col_ik_, col_iw_;
    // model.lora: q_a_proj (or q_proj) / kv_a_proj_with_mqa / g_proj; q_b_proj; o_proj; kv_b_proj (merged: its
    // per-head absorbed use takes W + s·B·A, recomputed before each use, and backward projects its gradient)
    LoraAdapters h_lora_, q_b_lora_, o_lora_, kv_b_lora_;
    TensorView kv_b_;                 // the kv_b_proj weight the attention uses now (w_.kv_b or the merged one)
    TensorView kv_b_merged_, dkv_b_;  // scratch [H·(d_n+d_v), r_kv] with kv_b_proj adapters
    template <class Self>
    static auto adapters(Self& b) {
        return std::array{&b.h_lora_, &b.q_b_lora_, &b.o_lora_, &b.kv_b_lora_};
    }
    Weights w_, g_;
    bool has_grads_ = false;
    bool lora_ = false;  // model.lora is on (the blocks of this kind share its scratch)
    Acts a_;
    Scratch d_;
    PassOptions pass_;
    TensorView entries_, index_keys_, rows_;  // decoding caches: [B, L, D_k], [B, L, d^I]; the selection [B, topk]
    DsaLayerStats stats_;
    parallel::Comm* head_group_ = nullptr;  // share_heads
};

}  // namespace tessera::model
