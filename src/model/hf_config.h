// Hugging Face config.json -> tessera model config, for the families the engine targets:
//   kimi_linear (Kimi-Linear: KDA + MLA (NoPE) + MoE),   kimi_k3 (its text_config: KDA with lower-bound gate and
//   full-rank output gate, gated MLA with NoPE, Stable LatentMoE with SiTU),   qwen3_next (Gated DeltaNet + gated
//   GQA + MoE),   deepseek_v32 (MLA + DSA indexer on every layer + group-limited MoE).
// A Kimi config that also carries `index_topk` (with `index_n_heads`, `index_head_dim`) is the gated DSA
// variant: its full-attention layers become "dsa". Every key of the file is accounted for: mapped,
// known to be irrelevant to the architecture (token ids, dtype, generation defaults), or listed in
// `unsupported` with what the engine does not do yet — nothing is silently ignored.
#pragma once

#include <string>
#include <vector>

#include "core/config_reader.h"
#include "model/config.h"

namespace tessera::model {

struct HfImport {
    std::string family;      // e.g. "Kimi K3 (kimi_k3)"
    std::string model_type;  // kimi_k3 | kimi_linear | qwen3_next | deepseek_v32
    ModelConfig model;
    std::vector<std::string> unsupported;  // one line each
};

// True for a Hugging Face config (it has "model_type" or "architectures"), false for a tessera run config.
bool is_hf_config(const Json& doc);
// Throws with the file and key for unknown families, missing keys or contradictions.
HfImport import_hf_config(const Json& doc, const std::string& where);
// The gate every command that builds a model from a Hugging Face checkpoint passes (logits, generate; anything
// opening a model source): any unsupported entry throws one line naming it (and how many more there are), so a
// feature tessera does not build never yields a silently different model. `inspect` lists them instead.
void require_supported(const HfImport& imported, const std::string& where);
// The Hugging Face config.json of a tessera model, the inverse of the import (importing it gives the same
// model), in the family its layers imply: gdn / gqa layers -> Qwen3-Next; every layer dsa, ungated, with
// RoPE -> DeepSeek-V3.2; otherwise Kimi-Linear (kda / mla / dsa), or Kimi K3 (model_type kimi_k3, the
// Kimi-Linear keys under text_config) with Attention Residuals. Throws naming what the family's format
// cannot express (a headwise gate, a selection bias Qwen lacks, KDA with grouped value heads, ...).
// tokens: the ids written as bos_token_id, eos_token_id and pad_token_id (null when negative or outside the
// vocabulary: transformers builds its embedding with padding_idx = pad_token_id and refuses one out of range, and
// warns about bos / eos out of range). A tied model exported as Kimi says tie_word_embeddings = false: transformers'
// Kimi-Linear never ties, and the export writes the head as its own tensor (model/hf_checkpoint.h).
struct HfSpecialTokens {
    int64_t bos = -1, eos = -1, pad = -1;
};
Json export_hf_config(const ModelConfig& m, const HfSpecialTokens& tokens = {});
// config.json's quantization_config for routed experts written in MXFP4 (`export-hf --expert-dtype mxfp4`): Kimi K3's
// compressed-tensors entry (mxfp4-pack-quantized, groups of 32, uint8 scales) with every module but the routed
// experts' ignored.
Json mxfp4_experts_quantization_config();

}  // namespace tessera::model
