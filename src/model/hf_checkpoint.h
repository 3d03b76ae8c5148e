// Hugging Face checkpoints of the Kimi family (kimi_linear, kimi_k3), Qwen3-Next (qwen3_next) and DeepSeek-V3.2
// (deepseek_v32; tessera uses its names, experts stored one by one): where each
// tessera parameter lives
// in the published tensor layout (spec/kimi_k3.md §5), and loading / saving sharded safetensors with a
// `model.safetensors.index.json`. Differences from tessera's own layout: the `language_model.` prefix
// (K3), `block_sparse_moe.` for MoE layers with one w1 (gate) / w3 (up) / w2 (down) tensor per expert
// instead of grouped [E, ...] tensors, convolution weights [C, 1, W] instead of [C, W], and A_log as
// [1, 1, HV, 1] (Kimi-Linear) or zero-padded to 128 (K3; a non-zero pad is refused). Routed experts
// stored as MXFP4 (`weight_packed` + `weight_scale`, K3's release) are dequantised on load, or kept byte for byte
// when the experts are held in MXFP4 (model.lora.expert_dtype).
// Qwen3-Next fuses projections: in_proj_qkvz holds q, k, v and the output gate z interleaved per key head,
// in_proj_ba holds b and a per key head, conv1d the q, k, v channels, and the attention q_proj holds
// [query | gate] per head; its RMSNorm weights (not the gated output norm) are zero-centred (stored w − 1).
// Loading reports a missing tensor, a wrong shape and any tensor the model does not use (never ignored).
#pragma once

#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "model/config.h"

namespace tessera::model {

struct HfTensor {
    std::string param;       // tessera parameter
    std::string name;        // Hugging Face tensor
    Shape shape;             // as stored (dense)
    int64_t expert = -1;     // >= 0: slice [expert] of a grouped [E, ...] tessera parameter
    int64_t pad_to = 0;      // > 0: a 1-D parameter stored zero-padded to this length
    std::string alias = {};  // another name the tensor may carry (transformers 5 saves dense MLPs of MoE
                             // models under block_sparse_moe.)
    // Part of a fused stored tensor (groups > 0): the parameter's rows are, for g < groups, the stored rows
    // [g·stride + offset, g·stride + offset + count); several parameters then share one stored name.
    struct Rows {
        int64_t offset = 0, count = 0, stride = 0, groups = 0;
    } rows = {};
    float offset = 0.f;  // stored = parameter − offset (zero-centred norm weights: 1)
    // A second stored copy of a parameter (a tied model's lm_head, a copy of the embedding): `saved` copies are
    // written (transformers' Kimi-Linear never ties its head, so it must find one) and `load_only` ones are not;
    // on load either may be absent, and when present it must equal the parameter.
    enum class Copy : uint8_t { none, saved, load_only };
    Copy copy = Copy::none;
    bool here = true;  // false: an expert another rank holds (expert parallelism): known, not loaded here
};

// The Hugging Face tensors of a model config, in parameter order. model_type: kimi_linear, kimi_k3 or
// qwen3_next (whose checkpoints hold no MoE selection bias: the model's stays zero).
std::vector<HfTensor> hf_tensor_map(const std::vector<BufferSpec>& params,
                                    const ModelConfig& c,
                                    const std::string& model_type);

// Stored tensor name -> its file, from dir's model.safetensors.index.json or its single model.safetensors.
std::map<std::string, std::string> stored_tensors(const std::string& dir);
// Whether a map entry is the parameter (or its expert's slice) stored as is: no row groups, padding or offset.
inline bool is_plain(const HfTensor& t) { return t.rows.groups == 0 && t.pad_to == 0 && t.offset == 0.f; }

// Writes safetensors shards (f32, or bf16 rounded to nearest even) of at most ~shard_bytes each plus
// model.safetensors.index.json into dir (created; every file written atomically). expert_dtype mxfp4: the routed
// experts (map entries with an expert) as compressed-tensors' MXFP4, Kimi K3's release layout: <name minus "weight">
// weight_packed + weight_scale, quantised by core/mxfp4.h's rule (exact for values that came from MXFP4 with its
// scales); otherwise (f32, the default) as dtype.
void save_hf_checkpoint(const std::string& dir,
                        const std::vector<HfTensor>& map,
                        const BufferGroup& params,
                        size_t shard_bytes = size_t(4) << 30,
                        DType dtype = DType::f32,
                        DType expert_dtype = DType::f32);
// A rank holding experts [first, first + count) of the grouped expert parameters (expert parallelism): their
// tensors land in its slice, the other experts' are marked not here.
std::vector<HfTensor> slice_experts(std::vector<HfTensor> map, int64_t first, int64_t count);
// Reads dir (model.safetensors.index.json, or a single model.safetensors) into params (any float dtype
// on disk is converted).
// every_tensor: a stored tensor the map does not name is an error (false: the map is a part of the model).
void load_hf_checkpoint(const std::string& dir,
                        const std::vector<HfTensor>& map,
                        const BufferGroup& params,
                        bool every_tensor = true);

// A Kimi checkpoint whose config ties the embeddings but which stores an lm_head different from the embedding
// (transformers' KimiLinearForCausalLM never ties, and saves its own head) computes with that head: the model is
// then untied (returns true). Other families tie in transformers: a differing stored head is refused on load.
bool untie_stored_head(const std::string& dir, ModelConfig& config, const std::string& model_type);

}  // namespace tessera::model
