// Pre-norm SwiGLU feed-forward block (Llama layout and tensor names):
//   x_out = x_in + down_proj(silu(gate_proj(h)) · up_proj(h)),  h = rmsnorm(x_in)
// gate_proj and up_proj are laid out back to back and run as one GEMM through a fused [2F, C] view.
#pragma once

#include "model/config.h"
#include "model/layers/block.h"
#include "model/lora.h"

namespace tessera::model {

class MlpBlock : public Block {
  public:
    MlpBlock(const ModelConfig& c, std::string param_prefix);

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    void set_pass(const PassOptions& o) override {  // the training pass's LoRA dropout masks
        gate_up_lora_.set_seed(o.lora_seed);
        down_lora_.set_seed(o.lora_seed);
    }
    double forward_flops_per_token(int64_t seq) const override;
    std::string kind() const override { return "mlp"; }

  private:
    struct Weights {
        TensorView norm;     // [C]
        TensorView gate_up;  // [2F, C]: gate_proj, up_proj
        TensorView down;     // [C, F]
    };
    // columns [col, col + F) of a [N, 2F] buffer
    TensorView half(TensorView rows, int64_t col) const;

    ModelConfig cfg_;
    std::string prefix_;
    int64_t C_, F_;
    LoraAdapters gate_up_lora_, down_lora_;  // model.lora: gate_proj, up_proj; down_proj
    Weights w_, g_;
    bool has_grads_ = false;
    TensorView ln_, rstd_, gu_, h_;  // saved: [N, C], [N], [N, 2F], [N, F]
    TensorView dln_, dgu_, dh_;      // scratch: [N, C], [N, 2F], [N, F]
};

}  // namespace tessera::model
