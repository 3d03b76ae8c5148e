// Pre-norm (Latent)MoE feed-forward block: x_out = x_in + moe(rmsnorm(x_in)) (ops/moe.h, docs/moe.md).
// Tensor names follow DeepSeek-V3 / Kimi checkpoints where they exist: mlp.gate.weight (router),
// mlp.gate.e_score_correction_bias (the selection bias: a parameter without gradient, moved by the
// balancing rule after each optimizer step), mlp.shared_experts.*; the routed experts are stored
// grouped, mlp.experts.{gate,up}_proj.weight [E, F, L] and mlp.experts.down_proj.weight [E, L, F];
// the LatentMoE projections are mlp.routed_expert_down_proj [L, C], mlp.routed_expert_up_proj [C, L]
// and mlp.routed_expert_norm [L] (Kimi K3).
// Per step the block accumulates its routing statistics over the recorded forwards (the micro-batches
// of one optimizer step): demand per expert, re-routed and dropped pairs, router losses, routing
// entropy; update_bias() applies the balancing rule to them and take_stats() hands them out.
#pragma once

#include <functional>
#include <span>

#include "model/config.h"
#include "model/layers/block.h"
#include "ops/moe.h"
#include "ops/moe_balance.h"
#include "parallel/ep.h"

namespace tessera::model {

struct MoeLayerStats {
    ops::MoeLoad load;
    int64_t tokens = 0, rerouted = 0, dropped = 0;
    int64_t a2a_bytes = 0;  // expert parallelism: bytes this rank's forwards sent to other ranks (backward: the same)
    double a2a_seconds = 0.0, a2a_exposed_seconds = 0.0;  // the exchanges on the communication thread; waited for
    double seq_aux_loss = 0.0, z_loss = 0.0;              // means over the recorded forwards
    float bias_min = 0.f, bias_max = 0.f;
};

class MoeBlock : public Block {
  public:
    // expert_group of more than one rank: expert parallelism, this rank holding experts
    // [rank·E/EP, (rank+1)·E/EP) (parallel/ep.h).
    MoeBlock(const ModelConfig& c,
             std::string param_prefix,
             parallel::Comm* expert_group = nullptr,
             int64_t ep_chunks = 1);

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    double forward_flops_per_token(int64_t seq) const override;
    std::string kind() const override { return "moe"; }
    void set_pass(const PassOptions& o) override {
        pass_ = o;
        p_.lora.seed = o.lora_seed;  // the shared and latent adapters' dropout masks
    }
    void saved_replaced() override { saved_.offsets_host = nullptr; }

    // After the optimizer step: moves the selection bias by the configured rule from this step's routing;
    // sum_over_ranks (when set) first turns this rank's expert counts into every rank's.
    void update_bias(const std::function<void(std::span<int64_t>)>& sum_over_ranks);
    void take_stats(MoeLayerStats& out);  // this step's statistics (into out, reusing its storage); clears them
    // The global balance loss (model.moe.global_aux_coeff; ops/router.h): the last forward's router choices and
    // Σ_rows ŝ per expert and its token count, which the model pools over its MoE layers, and the pooled loss's
    // ∂L/∂ŝ that the next backward adds (scaled by the pass's loss scale).
    std::span<const double> balance_choices() const { return bal_choices_; }
    std::span<const double> balance_prob_sums() const { return bal_probs_; }
    int64_t balance_rows() const { return bal_rows_; }
    void set_balance_grad(std::span<const double> g) { bal_grad_.assign(g.begin(), g.end()); }
    const std::string& prefix() const { return prefix_; }
    std::pair<int64_t, int64_t> local_experts() const;  // [first, first + count) of the layer's experts

  private:
    ops::MoeDims dims(int64_t tokens) const;
    // model.lora: the adapted projections (module name under "mlp.", where its pair goes, A's and B's shapes
    // without the experts' leading dim, whether it is the routed experts'), those model.lora targets
    struct Adapter {
        std::string module;
        ops::LoraPair ops::MoeLora::*pair;
        Shape a, b;
        bool experts;
    };
    std::vector<Adapter> adapters_;
    int64_t lora_rank() const { return adapters_.empty() ? 0 : cfg_.lora.rank; }
    std::span<const int64_t> sequences(StepShape s);  // sequence starts for the balance loss

    ModelConfig cfg_;
    MoeConfig m_;
    std::string prefix_;
    ops::MoeParams p_;
    ops::BalanceRule rule_;
    int64_t C_, L_;
    TensorView norm_, d_norm_;
    ops::MoeWeights w_, g_;
    bool has_grads_ = false;
    bool bias_frozen_ = false;  // the selection bias does not train (model.lora): update_bias leaves it
    TensorView ln_, rstd_, dln_;
    StepShape max_{};
    ops::MoeSaved saved_;
    // on a GPU, the last forward's expert offsets on the host, written by the layout, read by the expert passes
    // without a read-back; dropped when the saved group is replaced (the passes then read the offsets back)
    std::vector<int32_t> offsets_host_;
    ops::MoeScratch scratch_;
    PassOptions pass_;
    std::vector<int64_t> starts_;
    // this step's statistics
    std::vector<int64_t> demand_;
    // host copies of a device's small buffers (the step's demand, the selection bias, quantile balancing's scores)
    std::vector<int32_t> demand_host_;
    std::vector<float> bias_host_, scores_host_;
    int64_t tokens_ = 0, rerouted_ = 0, dropped_ = 0, forwards_ = 0, a2a_bytes_ = 0;
    double entropy_sum_ = 0.0, seq_aux_ = 0.0, z_loss_ = 0.0;
    std::vector<double> bal_choices_, bal_probs_, bal_grad_, bal_scaled_;
    int64_t bal_rows_ = 0;
    std::unique_ptr<ops::QuantileBalancer> quantile_;
    std::unique_ptr<parallel::ExpertParallelStage> ep_;  // null: every expert here
};

}  // namespace tessera::model
