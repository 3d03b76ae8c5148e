// What a model config amounts to, without allocating it: the layer map (layer i -> attention type and
// feed-forward kind, as ranges), parameter counts (total, embedding, active per token: routed experts
// count k/E), forward and training FLOPs per token at a sequence length, and the bytes of the weights
// and of full AdamW training (f32 parameters, gradients and two moments) or, with model.lora, of LoRA training (the
// frozen base's f32 weights, the trained parameters' 16 B), and the position encoding (RoPE, YaRN).
// `tessera inspect` prints it.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"

namespace tessera::model {

struct ModelSummary {
    struct LayerRange {
        int64_t first = 0, last = 0;  // inclusive
        std::string attention, ffn;   // e.g. "kda", "moe"
    };
    std::vector<LayerRange> layers;
    std::string residuals;  // "plain" or the Attention Residuals block structure
    std::string positions;  // the rotary embedding and its YaRN scaling, or none
    int64_t params = 0, embedding_params = 0, routed_expert_params = 0;
    int64_t vision_params = 0;  // model.vision: the image tower and projector (frozen; not in active_params)
    VisionConfig vision;
    // model.lora: the parameters that train (adapters and modules_to_save), the adapted modules, the config
    int64_t trained_params = 0, frozen_params = 0, adapted_modules = 0;
    int64_t frozen_bytes = 0;  // as held (model.lora.base_dtype)
    LoraConfig lora;
    double active_params = 0;  // per token: everything but the routed experts, plus k/E of them
    double forward_flops_per_token = 0, train_flops_per_token = 0;
    int64_t seq = 0;
    std::string str() const;  // the report (one item per line)
};

ModelSummary summarize(const ModelConfig& c, int64_t seq);

}  // namespace tessera::model
