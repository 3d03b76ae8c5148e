// LoRA adapters (arXiv 2106.09685) on one projection y = x·Wᵀ of a block, W possibly fused (q/k/v rows of one
// GEMM): every targeted part, rows [row, row + out) of W, adds y[:, row:row + out] += s·(x·Aᵀ)·Bᵀ with A [r, in],
// B [out, r] and s = model.lora's scale (alpha / r, rsLoRA alpha / √r). Initialised as PEFT does: A from
// kaiming_uniform(a = √5) = U(−1/√in, 1/√in), B zero, so a fresh adapter leaves the model's output as it was.
// Parameters are named after the module they adapt, as PEFT names them: "<module>.lora_A.weight",
// "<module>.lora_B.weight" (module = the weight's name without ".weight").
// Backward recomputes u = x·Aᵀ (r columns: cheaper than keeping it) and accumulates
//   dB += s·dyᵀ·u,  du = s·dy·B,  dA += duᵀ·x,  dx += du·A.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "model/layers/block.h"
#include "ops/lora.h"

namespace tessera::model {

class LoraAdapters {
  public:
    struct Part {
        std::string module;  // e.g. "model.layers.3.self_attn.q_proj"
        int64_t rows = 0;    // its rows of W
    };
    LoraAdapters() = default;  // none
    // parts in W's row order; only those model.lora targets get adapters (none without LoRA)
    LoraAdapters(const LoraConfig& c, int64_t in, const std::vector<Part>& parts);

    bool empty() const { return adapters_.empty(); }
    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const;
    // u and du [N, r], shared by every projection of the blocks that share `prefix` (used one at a time)
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const;
    void bind_params(const BufferGroup& params, const BufferGroup* grads);
    void bind_scratch(const BufferGroup& acts, const std::string& prefix);

    // y [N, Σ rows] (row-strided) += the adapters' outputs for x [N, in]
    void forward(TensorView x, TensorView y) const;
    // dy [N, Σ rows]: the adapters' gradients accumulate, and dx [N, in] += their input gradient
    void backward(TensorView x, TensorView dy, TensorView dx) const;
    double forward_flops_per_token() const;

    // For a weight W [Σ rows, in] used in a form the two thin GEMMs cannot follow (MLA's absorbed kv_b_proj): W
    // itself without adapters, else W + s·B·A written into `scratch` (one adapter covering all of W). Backward:
    // the adapter's gradients from the merged weight's gradient dW.
    TensorView merged(TensorView w, TensorView scratch) const;
    void backward_from_weight(TensorView dw) const;
    double scale() const { return scale_; }
    // the pass's dropout seed (PassOptions::lora_seed; 0: no dropout)
    void set_seed(uint64_t seed) { seed_ = seed; }

  private:
    struct Adapter {
        std::string module;
        int64_t row = 0, rows = 0;
        uint64_t stream = 0;  // its dropout masks' (a hash of the module)
        TensorView a, b, da, db;
    };
    ops::LoraParams params(const Adapter& a) const;
    int64_t rank_ = 0, in_ = 0;
    double scale_ = 1.0, dropout_ = 0.0;
    uint64_t seed_ = 0;
    std::vector<Adapter> adapters_;
    TensorView u_, du_, xd_;
};

// The merged model: every parameter of `merged` (a model without LoRA) from `params` (the same model with adapters),
// each adapted weight W plus s·B·A (routed experts expert by expert).
void merge_lora(const LoraConfig& c, const BufferGroup& params, const BufferGroup& merged);

// Whether a parameter is an adapter's A or B ("<module>.lora_A.weight", "<module>.lora_B.weight").
inline bool is_adapter(const std::string& param) {
    return param.ends_with(".lora_A.weight") || param.ends_with(".lora_B.weight");
}

}  // namespace tessera::model
