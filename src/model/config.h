// Model configuration (the "model" section of a run config; docs/config.md): the dense decoder
// that the hybrid layers of later issues extend.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config_reader.h"
#include "ops/gated_rmsnorm.h"
#include "ops/rope.h"

namespace tessera::model {

// Upper bounds of the sizes a config may ask for: far above any published model, far below the int64
// overflow of their products (every buffer size is computed with checked products as well, core/tensor.h).
constexpr int64_t kMaxVocab = int64_t(1) << 24;  // token ids are int32
constexpr int64_t kMaxWidth = int64_t(1) << 17;  // d_model, ffn_dim, latent and head widths
constexpr int64_t kMaxCount = int64_t(1) << 12;  // layers, heads, groups
constexpr int64_t kMaxExperts = int64_t(1) << 16;
constexpr int64_t kMaxSeqLen = int64_t(1) << 24;  // tokens in one sequence (the design's 1M context, 16x)

// The routed feed-forward layers (docs/moe.md): layers from `first_dense` on (or the "moe" entries of
// `layers`) use a (Latent)MoE block instead of the dense MLP when experts > 0. Balancing and router losses are part of
// the model config because backward computes the losses' gradients; `balance` = frozen for fine-tuning.
struct MoeConfig {
    int64_t experts = 0;  // 0: every layer dense
    int64_t topk = 2;
    int64_t ffn_dim = 0;              // per routed expert (F)
    int64_t latent_dim = 0;           // LatentMoE width L; 0 = the experts see d_model
    bool latent_norm = false;         // Stable LatentMoE: RMSNorm over L before the up projection
    int64_t shared_ffn_dim = 0;       // shared expert width; 0 = none
    bool shared_expert_gate = false;  // Qwen3-Next: the shared output scaled by σ(w·x) per token
    std::string score = "sigmoid";
    bool normalize = true;
    double scaling = 1.0;
    int64_t groups = 1;
    int64_t topk_groups = 1;
    double capacity_factor = 0.0;  // 0 = dropless
    std::string overflow = "reroute";
    std::string activation = "swiglu";
    int64_t first_dense = 1;          // the first layers keep the dense MLP (first_k_dense_replace)
    std::vector<std::string> layers;  // per layer "moe" | "dense" (Qwen3-Next's mlp_only_layers); empty: first_dense
    std::string balance = "sign";     // sign | quantile | frozen
    double bias_update_rate = 1e-3;   // γ of the sign rule
    double seq_aux_coeff = 0.0;       // sequence-wise balance loss weight
    double global_aux_coeff = 0.0;    // global balance loss weight, pooled over the MoE layers (Qwen3-Next's)
    double z_loss_coeff = 0.0;        // router z-loss weight
    bool is_moe_layer(int64_t layer) const {
        return experts > 0 && (layers.empty() ? layer >= first_dense : layers[size_t(layer)] == "moe");
    }
    bool every_layer_moe(int64_t n_layers) const;  // experts > 0 and no dense layer
};

// A KDA or GDN layer (model/layers/kda_block.h). In a model config (the "kda" section) the width,
// input norm eps, init and layer count come from the model's keys; gdn layers set scalar_gate, a
// full-rank output gate and SiLU.
struct KdaConfig {
    int64_t d_model = 256;
    int64_t num_heads = 4;    // q/k heads (H)
    int64_t num_v_heads = 0;  // value heads (HV, a multiple of H); 0 = num_heads
    int64_t head_dim = 64;    // K
    int64_t head_v_dim = 0;   // V; 0 = head_dim
    int64_t conv_size = 4;
    bool scalar_gate = false;            // GDN: one decay per value head (a_proj), else KDA's per channel
    int64_t gate_rank = 0;               // rank of the f_a/f_b path; 0 = head_v_dim
    double gate_lower_bound = 0.0;       // 0: softplus form; < 0: lower-bound form (Kimi K3: −5)
    bool full_rank_output_gate = false;  // g_proj (Kimi K3, GDN) instead of g_a_proj / g_b_proj
    ops::GateActivation output_gate_activation = ops::GateActivation::sigmoid;  // silu for GDN
    double norm_eps = 1e-6;                                                     // the block's input RMSNorm
    double o_norm_eps = 1e-5;
    double init_std = 0.02;
    int64_t n_layers = 1;  // o_proj starts at init_std / sqrt(2·n_layers)
    int64_t chunk_size = 64;

    int64_t hv() const { return num_v_heads > 0 ? num_v_heads : num_heads; }
    int64_t v_dim() const { return head_v_dim > 0 ? head_v_dim : head_dim; }
    int64_t rank() const { return gate_rank > 0 ? gate_rank : v_dim(); }
    void validate(const std::string& where) const;
};

// The lightning indexer and the training stage of a DSA layer; topk = 0: a dense MLA layer.
struct DsaConfig {
    int64_t topk = 0;
    int64_t heads = 4;             // H^I
    int64_t head_dim = 32;         // d^I
    int64_t rope_dim = 16;         // d_r^I rotated dims at the start of q^I and k^I; 0 = none
    std::string stage = "sparse";  // sparse | dense_warmup
    double kl_coeff = 1.0;         // λ of the indexer KL loss
    int64_t dk_slabs = 4;          // fixed query slabs of the deterministic dk^I / dc scatters
    bool enabled() const { return topk > 0; }
    bool warmup() const { return stage == "dense_warmup"; }
};

// An MLA / gated DSA layer (model/layers/mla_block.h). In a model config (the "mla" section) the
// width, heads, rope theta, gate, input norm eps and init come from the model's own keys.
struct MlaConfig {
    int64_t d_model = 256;
    int64_t num_heads = 4;
    int64_t q_lora_rank = 0;  // r_q; 0 = q_proj straight from h (Kimi-Linear)
    int64_t kv_lora_rank = 64;
    int64_t qk_nope_dim = 32;  // d_n
    int64_t qk_rope_dim = 16;  // d_r: the decoupled key piece shared by all heads
    int64_t v_head_dim = 32;   // d_v
    bool rope = true;          // false: NoPE (Kimi K3), the d_r slices stay but are never rotated
    double rope_theta = 10000.0;
    ops::RopeScaling rope_scaling;     // YaRN on the d_r slices and the indexer's rope dims
    double softmax_scale = 0.0;        // τ; 0 = (d_n + d_r)^-1/2
    std::string output_gate = "none";  // none | headwise | elementwise
    double norm_eps = 1e-6;            // the block's input RMSNorm
    double latent_eps = 1e-6;          // q_a_layernorm, kv_a_layernorm, indexer k_norm
    double init_std = 0.02;
    int64_t n_layers = 1;  // o_proj starts at init_std / sqrt(2·n_layers)
    DsaConfig dsa;

    int64_t qk_head_dim() const { return qk_nope_dim + qk_rope_dim; }
    int64_t entry_dim() const { return kv_lora_rank + qk_rope_dim; }  // D_k
    int64_t gate_width() const {
        return output_gate == "elementwise" ? num_heads * v_head_dim : output_gate == "headwise" ? num_heads : 0;
    }
    // τ: softmax_scale, else (d_n + d_r)^-1/2, times g(factor, mscale_all_dim)² under YaRN with mscale_all_dim
    // (DeepSeek-V3's MLA; spec/dsa.md §1.2)
    double scale() const {
        if (softmax_scale > 0) return softmax_scale;
        const double m = rope_scaling.enabled() && rope_scaling.mscale_all_dim > 0
                             ? ops::yarn_mscale(rope_scaling.factor, rope_scaling.mscale_all_dim)
                             : 1.0;
        return m * m / std::sqrt(double(qk_head_dim()));
    }
    void validate(const std::string& where) const;
};

// LoRA fine-tuning (arXiv 2106.09685; PEFT's LoraConfig keys): the base model is frozen and rank-r adapters
// y += s·(x·Aᵀ)·Bᵀ train on the linears named by target_modules (PEFT module names: q_proj, o_proj, gate_proj,
// ...; a name matches a module whose dotted path equals it or ends with "." + it), with s = alpha / r (rsLoRA:
// alpha / √r). modules_to_save: modules trained in full beside the adapters (embed_tokens, lm_head, norm, ...).
struct LoraConfig {
    int64_t rank = 0;  // 0: no LoRA, every parameter trains
    double alpha = 16.0;
    bool rslora = false;
    double dropout = 0.0;  // PEFT's lora_dropout on the adapters' input while training (not on the routed experts')
    std::vector<std::string> target_modules;
    std::vector<std::string> modules_to_save;
    // how the frozen base's GEMM weights (projections, experts, embedding, head) are held: f32 | bf16 (2 bytes a
    // parameter, widened per GEMM block; the norms, biases, gates and convolutions stay f32)
    std::string base_dtype = "f32";
    // how the frozen routed experts are held: f32 | bf16 | mxfp4 (OCP MXFP4, 4.25 bits a parameter, core/mxfp4.h:
    // an MXFP4 checkpoint's experts byte for byte, others quantised on load; widened per GEMM block). Default:
    // base_dtype
    std::string expert_dtype = "f32";

    bool enabled() const { return rank > 0; }
    double scale() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }
    // whether a PEFT module name list names the module at `path` (a parameter name without ".weight")
    static bool names(const std::vector<std::string>& list, const std::string& path);
    void validate(const std::string& where) const;
};

// Kimi K3's image tower and projector (the "vision" section; model/vision.h): images in, one row of the language
// model's width per image token out. layers = 0: no tower.
struct VisionConfig {
    int64_t layers = 0;  // 0: no tower
    int64_t width = 1024;
    int64_t heads = 12;
    int64_t head_dim = 128;  // q, k, v are heads × head_dim wide (not necessarily width)
    int64_t ffn_dim = 4096;
    int64_t patch_size = 14;
    int64_t channels = 3;
    int64_t pos_height = 64, pos_width = 64;  // the learned position table, resized to each grid
    int64_t merge_h = 2, merge_w = 2;         // patches per image token
    int64_t max_grid = 512;                   // the 2-D RoPE's largest grid side
    double rope_theta = 10000.0;
    double norm_eps = 0x1p-7;  // the tower's RMSNorms set none: bf16's machine epsilon, as the released model runs
    double projector_eps = 1e-5;
    int64_t max_patches = 4096;  // patches one forward takes (its buffers): 64x64, one 896x896-pixel image
    int64_t text_width = 0;      // the projector's output: the language model's d_model (not a key: set from it)
    int64_t image_token = 0;     // the token whose positions take the image rows, in order (Kimi K3: 163605)

    bool enabled() const { return layers > 0; }
    int64_t patch_dim() const { return channels * patch_size * patch_size; }
    int64_t qkv_width() const { return heads * head_dim; }
    int64_t merged_width() const { return merge_h * merge_w * width; }
    int64_t num_params() const;
    void validate(const std::string& where) const;
};

// Pipeline parallelism (docs/parallel.md): the layers [first, last) one stage holds (last −1: to the end). The first
// stage holds the embedding, the last the final norm and the head; a stage between holds its layers only.
struct LayerRange {
    int64_t first = 0, last = -1;
};

struct ModelConfig {
    int64_t vocab_size = 258;  // byte tokenizer: 256 bytes + <|endoftext|> + <|pad|>
    int64_t d_model = 256;
    int64_t n_layers = 4;
    int64_t n_heads = 4;
    int64_t n_kv_heads = 4;
    int64_t head_dim = 0;  // 0: d_model / n_heads
    int64_t ffn_dim = 768;
    std::string mlp_activation = "swiglu";  // the dense MLP layers: swiglu | situ (Kimi K3's SiTU-GLU)
    double norm_eps = 1e-6;
    double rope_theta = 10000.0;
    ops::RopeScaling rope_scaling;  // "rope_scaling" section: YaRN on every rotary dim (gqa, mla/dsa, indexer)
    bool tie_embeddings = false;
    double init_std = 0.02;
    // per layer (one entry = every layer): gqa (grouped-query, rotary) | mla (latent, dense) | dsa (latent +
    // indexer top-k) | kda | gdn (linear attention)
    std::vector<std::string> attention{"gqa"};
    std::string output_gate = "none";  // gqa, mla and dsa layers: none | headwise | elementwise sigmoid gate
    bool qk_norm = false;              // gqa layers: RMSNorm over each head of q and k (Qwen3)
    int64_t rope_dim = 0;              // gqa layers: rotated dims per head (partial rotary); 0 = the head dim
    // Attention Residuals (Kimi K3; model/attn_res.h): layers per depth block B; 0 = plain residual stream
    int64_t attn_res_block_size = 0;
    MlaConfig mla;
    KdaConfig kda;
    MoeConfig moe;
    LoraConfig lora;
    VisionConfig vision;

    int64_t head_dim_or_default() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
    const std::string& layer_type(int64_t layer) const {
        return attention.size() == 1 ? attention[0] : attention[layer];
    }
    bool has_layer_type(const std::string& type) const;
    // frozen parameters, which checkpoints do not hold (they come from train.base): a LoRA base, an image tower
    bool has_frozen_params() const { return lora.enabled() || vision.enabled(); }
    bool has_rotary_dims() const;  // a gqa layer, an mla/dsa layer with rope, or a dsa indexer with rope dims
    MlaConfig mla_layer(
        bool dsa) const;  // mla with the model's width, heads, rope θ, gate, eps, init; topk 0 unless dsa
    KdaConfig kda_layer(bool gdn) const;            // kda with the model's width, eps, init and layer count
    void validate(const std::string& where) const;  // throws with the offending key
};

ModelConfig parse_model_config(const Json& section, const std::string& where);
// Puts every key no layer of the model reads back to its default (validation refuses such keys set to
// anything else): for configs derived from another format, e.g. a Hugging Face config's
// intermediate_size when every layer is MoE.
void clear_unread_keys(ModelConfig& c);
Json to_json(const ModelConfig& c);
Json to_json(const MoeConfig& m);
Json to_json(const MlaConfig& m);
Json to_json(const KdaConfig& k);
Json to_json(const LoraConfig& l);
Json to_json(const VisionConfig& v);
Json to_json(const ops::RopeScaling& s);

}  // namespace tessera::model
