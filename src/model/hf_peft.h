// LoRA adapters in PEFT's format (https://huggingface.co/docs/peft): a directory with adapter_config.json (peft_type
// LORA, r, lora_alpha, use_rslora, target_modules, target_parameters, base_model_name_or_path) and
// adapter_model.safetensors holding "base_model.model.<module>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r]
// for every adapted module, under the module names of the transformers model (the Hugging Face tensor name of the
// adapted weight without ".weight", renamed as transformers renames it on load: Kimi-Linear's block_sparse_moe is
// mlp, its f_a_proj / f_b_proj live in self_attn.forget_gate; model/hf_checkpoint.h maps tessera's parameters to
// the stored names).
//
// Routed experts: transformers 5 holds them stacked, `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] (gate's rows
// then up's) and `.down_proj` [E, H, I], which PEFT adapts through target_parameters (lora.ParamWrapper): one adapter
// of rank R per parameter and expert, A [R·E, in] (expert e's ranks are rows e·R ..) and B [out, R·E] (expert e's rank
// k is column k·E + e), the module's two wrappers nested in parameter order (gate_up_proj's keys get ".base_layer").
// Fused stored projections are one transformers module: Qwen3-Next's in_proj_qkvz (q, k, v, z in row groups per key
// head), in_proj_ba (b, a) and gated attention's q_proj (q, gate per head). Wherever several tessera projections are
// one PEFT module (gate_up_proj too), their adapters of rank r are written as one at R = parts·r (A stacked, B block
// diagonal over the parts' rows, a part not adapted zero; rank_pattern and alpha_pattern, under the module's full
// name, keep the scale) when two or more are adapted, else at R = r; PEFT's read back at R = parts·r (B's
// off-diagonal blocks must be zero) or R = r (every part then starts from one shared A: the same function). Kimi K3
// has no transformers class: its adapters are refused in one line (export-hf --merge-lora writes them merged).
//
// modules_to_save: PEFT trains a copy of each such module whole and saves its tensors under the module's own name
// ("base_model.model.lm_head.weight"); the config lists the transformers modules. tessera writes and reads the
// parameters its model.lora.modules_to_save trains that way when each is stored one to one (not fused, offset or
// per expert: Qwen3-Next's zero-centred norms are refused in one line).
#pragma once

#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/hf_checkpoint.h"

namespace tessera::model {

struct PeftTensor {
    std::string param;  // tessera parameter: <module>.lora_A.weight or .lora_B.weight, or one modules_to_save trains
    std::string name;   // PEFT's key
    // parts > 0: the adapter is a part of PEFT's adapter on one stored tensor that several tessera projections are
    // (fused: Qwen3-Next's in_proj_qkvz holds q, k, v and z as row groups per head; the stacked experts' gate_up_proj
    // gate's rows then up's), for a routed expert's adapter (A [E, r, in], B [E, out, r]) on every expert at once:
    // part `part` of `parts`, its output rows `rows` of the stored tensor's `out`
    int part = 0, parts = 0;
    HfTensor::Rows rows = {};  // groups 0: `count` rows from `offset`
    int64_t out = 0;
    bool wide = false;  // two or more parts adapted: written at rank parts·r, each part its own block
    // modules_to_save: what the stored tensor is less than tessera's parameter (Qwen3NextRMSNorm's w of 1 + w: 1)
    float offset = 0.f;
};

// The PEFT keys of a model's adapter parameters and of those it trains whole (modules_to_save) (specs: the model with
// adapters, trainable marked; c: its config, lora included).
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
// bias, DoRA, rank or alpha patterns, fan_in_fan_out). Its modules_to_save become the tessera modules of the tensors
// the file saves for them (each entry must match one, at a module name's end, as PEFT matches).
struct PeftAdapter {
    LoraConfig lora;
    std::string base;
};
PeftAdapter read_peft_config(const std::string& dir, const ModelConfig& base, const std::string& model_type);
// Reads the adapters of dir into params (every adapter parameter of the map must be there, nothing else may be).
void load_peft_adapter(const std::string& dir, const std::vector<PeftTensor>& map, const BufferGroup& params);
// One tessera adapter parameter (whole: every expert) from the PEFT file's tensor t.name (`file` names it in
// errors); a stacked gate_up adapter must be one tessera can hold (R = 2r with zero off-diagonal blocks, or R = r).
Tensor peft_param(const Tensor& stored, const PeftTensor& t, const Shape& shape, const std::string& file);

bool is_peft_dir(const std::string& dir);
// The base a PEFT directory names (base_model_name_or_path, relative to the directory when not absolute).
std::string peft_base(const std::string& dir);

}  // namespace tessera::model
