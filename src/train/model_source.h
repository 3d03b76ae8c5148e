// The model behind a path: a tessera checkpoint or run directory (its latest checkpoint), a LoRA fine-tune's
// checkpoint (its adapters on the base it names, train.base), a PEFT adapter directory (adapter_config.json: the
// adapters on its base_model_name_or_path), or a Hugging Face checkpoint directory (config.json
// with a model_type: Kimi-Linear, Kimi K3, Qwen3-Next or DeepSeek-V3.2 weights), refused with one line when its
// config uses a feature tessera does not build. `train`, `logits`, `generate` and `export-hf` read models through
// it; train.base (fine-tuning) starts from one.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "model/model.h"
#include "parallel/mesh.h"
#include "train/checkpoint.h"

namespace tessera::train {

struct ModelSource {
    std::string path;        // the checkpoint directory
    bool hf = false;         // a Hugging Face directory
    std::string model_type;  // hf: kimi_linear, kimi_k3, ...
    model::ModelConfig config;
    int64_t context = 4096;  // tessera: the trained sequence length
    std::string base;        // a fine-tune's checkpoint: the base it trained on (train.base; empty: none)
    bool peft = false;       // a PEFT adapter directory (model/hf_peft.h) on the base it names
    // Reads every parameter of a model built from `config` into params (a fine-tune: the base's weights, then the
    // checkpoint's; the base's hash checked).
    void load(const model::Model& m, const BufferGroup& params) const;
    // The Hugging Face directory whose tokenizer the model reads (its own, or its base's, when it holds tokenizer.json
    // or tiktoken.model); empty: the byte tokenizer.
    std::string tokenizer_dir() const;
};

ModelSource open_model_source(const std::string& path);

// The Hugging Face family a tessera model is written as (export-hf): kimi_linear, kimi_k3, qwen3_next, deepseek_v32.
std::string hf_family(const model::ModelConfig& c);
// The family whose module names a source's adapters carry in PEFT's form (a Hugging Face base's own, else hf_family).
std::string peft_family(const ModelSource& s);

// Fine-tuning (train.base): the run's model section is the base's architecture with the run's own model.lora;
// `run_model` (the run config's model section) may hold nothing else. One-line errors name what is wrong.
Json base_model_json(const ModelSource& base, const Json& run_model, const std::string& where);

// The base's weights at `targets` (whole, this rank's expert slice, or this rank's FSDP ranges; ParamTarget::param
// indexes m.param_specs(); adapters' targets are left alone, but a PEFT base fills them). A base that is itself a
// tessera LoRA fine-tune is refused (merge it first: export-hf --merge-lora).
void load_base(const ModelSource& base,
               const model::Model& m,
               const BufferGroup& params,
               const std::vector<ParamTarget>& targets,
               ExpertSlice experts);

// The frozen parameters' content as one number, the same whatever the layout of ranks: the sum over their elements
// of a 20-bit hash of (name, index in the whole tensor, bits), each element counted on one rank (`pieces`: the
// frozen targets this rank holds; `sharded`: whether a parameter is held as ranges, each element on one rank; else
// whole dense ones count on rank 0 and experts on the first of their replicas). Collective with a mesh. A
// fine-tune's checkpoints record it; resuming and inference check the base against it.
// `done`, when set, is called with each piece once it is hashed (the weight budget releases a mapped one).
int64_t frozen_hash(const model::Model& m,
                    const std::vector<ParamTarget>& pieces,
                    const std::function<bool(size_t)>& sharded,
                    const parallel::Mesh* mesh,
                    const std::function<void(const ParamTarget&)>& done = {});

}  // namespace tessera::train
