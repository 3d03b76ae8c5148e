// Model configuration (the "model" section of a run config; docs/config.md): the dense decoder
// that the hybrid layers of later issues extend.
#pragma once

#include <cstdint>
#include <string>

#include "core/config_reader.h"

namespace tessera::model {

// The routed feed-forward layers (docs/moe.md): layers from `first_dense` on use a (Latent)MoE block
// instead of the dense MLP when experts > 0. Balancing and router losses are part of the model config
// because backward computes the losses' gradients; `balance` = frozen for fine-tuning.
struct MoeConfig {
    int64_t experts = 0;  // 0: every layer dense
    int64_t topk = 2;
    int64_t ffn_dim = 0;         // per routed expert (F)
    int64_t latent_dim = 0;      // LatentMoE width L; 0 = the experts see d_model
    bool latent_norm = false;    // Stable LatentMoE: RMSNorm over L before the up projection
    int64_t shared_ffn_dim = 0;  // shared expert width; 0 = none
    std::string score = "sigmoid";
    bool normalize = true;
    double scaling = 1.0;
    int64_t groups = 1;
    int64_t topk_groups = 1;
    double capacity_factor = 0.0;  // 0 = dropless
    std::string overflow = "reroute";
    std::string activation = "swiglu";
    int64_t first_dense = 1;         // the first layers keep the dense MLP (first_k_dense_replace)
    std::string balance = "sign";    // sign | quantile | frozen
    double bias_update_rate = 1e-3;  // γ of the sign rule
    double seq_aux_coeff = 0.0;      // sequence-wise balance loss weight
    double z_loss_coeff = 0.0;       // router z-loss weight
    bool is_moe_layer(int64_t layer) const { return experts > 0 && layer >= first_dense; }
};

struct ModelConfig {
    int64_t vocab_size = 258;  // byte tokenizer: 256 bytes + <|endoftext|> + <|pad|>
    int64_t d_model = 256;
    int64_t n_layers = 4;
    int64_t n_heads = 4;
    int64_t n_kv_heads = 4;
    int64_t head_dim = 0;  // 0: d_model / n_heads
    int64_t ffn_dim = 768;
    double norm_eps = 1e-6;
    double rope_theta = 10000.0;
    bool tie_embeddings = false;
    double init_std = 0.02;
    MoeConfig moe;

    int64_t head_dim_or_default() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
    void validate(const std::string& where) const;  // throws with the offending key
};

ModelConfig parse_model_config(const Json& section, const std::string& where);
Json to_json(const ModelConfig& c);
Json to_json(const MoeConfig& m);

}  // namespace tessera::model
