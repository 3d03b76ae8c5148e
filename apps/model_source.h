// The model behind a --checkpoint argument: a tessera checkpoint or run directory (its latest checkpoint),
// or a Hugging Face checkpoint directory (config.json with a model_type: Kimi-Linear, Kimi K3, Qwen3-Next or
// DeepSeek-V3.2 weights), refused with one line when its config uses a feature tessera does not build.
#pragma once

#include <string>

#include "core/buffer_spec.h"
#include "model/model.h"

namespace tessera::apps {

struct ModelSource {
    std::string path;        // the checkpoint directory
    bool hf = false;         // a Hugging Face directory
    std::string model_type;  // hf: kimi_linear, kimi_k3, ...
    model::ModelConfig config;
    int64_t context = 4096;  // tessera: the trained sequence length
    // Reads the weights into params (of a model built from `config`).
    void load(const model::Model& m, const BufferGroup& params) const;
};

ModelSource open_model_source(const std::string& path);

}  // namespace tessera::apps
