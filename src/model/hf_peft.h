// LoRA adapters in PEFT's format (https://huggingface.co/docs/peft): a directory with adapter_config.json (peft_type
// LORA, r, lora_alpha, use_rslora, target_modules, base_model_name_or_path) and adapter_model.safetensors holding
// "base_model.model.<module>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r] for every adapted module, under
// the module names of the transformers model (the Hugging Face tensor name of the adapted weight without
// ".weight"; model/hf_checkpoint.h maps tessera's parameters to those). What PEFT writes for transformers' stacked
// 3-D expert parameters (target_parameters: one adapter over all experts, gate and up fused) and for fused stored
// projections (Qwen3-Next's in_proj_qkvz) has no one-to-one tessera form yet: such adapters are refused in one line
// (export-hf --merge-lora writes them merged), as are modules_to_save.
#pragma once

#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "model/config.h"

namespace tessera::model {

struct PeftTensor {
    std::string param;  // tessera parameter: <module>.lora_A.weight or .lora_B.weight
    std::string name;   // PEFT's key
};

// The PEFT keys of a model's adapter parameters (specs: the model with adapters; c: its config, lora included).
std::vector<PeftTensor> peft_tensor_map(const std::vector<BufferSpec>& specs,
                                        const ModelConfig& c,
                                        const std::string& model_type);

// Writes dir (created; files written atomically): adapter_config.json naming the exact modules adapted (their
// transformers names) and the adapters in f32.
void save_peft_adapter(const std::string& dir,
                       const std::vector<PeftTensor>& map,
                       const BufferGroup& params,
                       const LoraConfig& c,
                       const std::string& base);

// A PEFT directory's LoRA config, as tessera's model.lora: its adapted modules by their tessera names (exactly the
// modules the file holds), and the base it names (base_model_name_or_path; relative to the directory when not
// absolute). One-line errors for what tessera does not read (other peft_type, dropout at inference is ignored,
// bias, DoRA, rank or alpha patterns, modules_to_save, fan_in_fan_out).
struct PeftAdapter {
    LoraConfig lora;
    std::string base;
};
PeftAdapter read_peft_config(const std::string& dir, const ModelConfig& base, const std::string& model_type);
// Reads the adapters of dir into params (every adapter parameter of the map must be there, nothing else may be).
void load_peft_adapter(const std::string& dir, const std::vector<PeftTensor>& map, const BufferGroup& params);

bool is_peft_dir(const std::string& dir);
// The base a PEFT directory names (base_model_name_or_path, relative to the directory when not absolute).
std::string peft_base(const std::string& dir);

}  // namespace tessera::model
