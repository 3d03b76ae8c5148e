// Model configuration (the "model" section of a run config; docs/config.md): the dense decoder
// that the hybrid layers of later issues extend.
#pragma once

#include <cstdint>

#include "core/config_reader.h"

namespace tessera::model {

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

    int64_t head_dim_or_default() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
    void validate(const std::string& where) const;  // throws with the offending key
};

ModelConfig parse_model_config(const Json& section, const std::string& where);
Json to_json(const ModelConfig& c);

}  // namespace tessera::model
