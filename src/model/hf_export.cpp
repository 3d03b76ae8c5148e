// Hugging Face config export (see hf_config.h): each family's config.json as the inverse of its import in
// hf_config.cpp, refusing, with the family and the reason, what the format cannot express.
#include <cmath>

#include "core/check.h"
#include "model/hf_config.h"

namespace tessera::model {

namespace {
// Requirements of one family's format: a failed one throws naming the family and what it needs.
struct Need {
    const char* family;
    void operator()(bool ok, const char* what) const {
        TESSERA_CHECK(ok, "this model cannot be written as a {} config: {}", family, what);
    }
    void dropless(const MoeConfig& e, bool global_aux = false) const {
        (*this)(e.capacity_factor == 0 && e.seq_aux_coeff == 0 && e.z_loss_coeff == 0 &&
                    (global_aux || e.global_aux_coeff == 0),
                global_aux ? "routing is dropless with at most the global balance loss (model.moe.global_aux_coeff)"
                           : "routing is dropless without auxiliary losses");
    }
};

// the keys common_shape reads, for an architecture and model type
Json shape_keys(const ModelConfig& m, const char* architecture, const char* model_type, int64_t kv_heads) {
    return {{"architectures", {architecture}},
            {"model_type", model_type},
            {"vocab_size", m.vocab_size},
            {"hidden_size", m.d_model},
            {"num_hidden_layers", m.n_layers},
            {"num_attention_heads", m.n_heads},
            {"num_key_value_heads", kv_heads},
            {"intermediate_size", m.ffn_dim},
            {"rms_norm_eps", m.norm_eps},
            {"initializer_range", m.init_std},
            {"tie_word_embeddings", m.tie_embeddings}};
}

// a special token id, or null when there is none in the vocabulary
Json token_id(const ModelConfig& m, int64_t id) { return id >= 0 && id < m.vocab_size ? Json(id) : Json(nullptr); }

void token_keys(const ModelConfig& m, const HfSpecialTokens& t, Json& j) {
    j["bos_token_id"] = token_id(m, t.bos);
    j["eos_token_id"] = token_id(m, t.eos);
    j["pad_token_id"] = token_id(m, t.pad);
}

// transformers 5's rope_parameters: rope_theta, the YaRN fields of model.rope_scaling, and
// partial_rotary_factor when given
Json rope_parameters(const ModelConfig& m, double partial = 0) {
    Json j = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
    if (partial > 0) j["partial_rotary_factor"] = partial;
    const ops::RopeScaling& s = m.rope_scaling;
    if (!s.enabled()) return j;
    j["rope_type"] = "yarn";
    j.update(Json{{"factor", s.factor},
                  {"original_max_position_embeddings", s.original_max_position},
                  {"beta_fast", s.beta_fast},
                  {"beta_slow", s.beta_slow},
                  {"truncate", s.truncate}});
    if (s.mscale != 0) j["mscale"] = s.mscale;
    if (s.mscale_all_dim != 0) j["mscale_all_dim"] = s.mscale_all_dim;
    if (s.attention_factor != 0) j["attention_factor"] = s.attention_factor;
    return j;
}

// a partial_rotary_factor f with int(D · f) == rot in double arithmetic (what transformers computes)
// YaRN's extended context, which transformers checks against factor · original_max_position_embeddings
void yarn_context(const ModelConfig& m, Json& j) {
    const ops::RopeScaling& s = m.rope_scaling;
    if (s.enabled()) j["max_position_embeddings"] = int64_t(std::llround(double(s.original_max_position) * s.factor));
}

// first_k_dense_replace, and mlp_layer_types when the dense layers are not just the first ones (transformers 5's
// Kimi-Linear and DeepSeek-V3.2 follow the list)
int64_t leading_dense(const ModelConfig& m) {
    int64_t first = 0;
    while (first < m.n_layers && !m.moe.is_moe_layer(first)) ++first;
    return first;
}
bool dense_prefix(const ModelConfig& m) {
    for (int64_t i = leading_dense(m); i < m.n_layers; ++i) {
        if (!m.moe.is_moe_layer(i)) return false;
    }
    return true;
}
void mlp_layer_keys(const ModelConfig& m, Json& j) {
    j["first_k_dense_replace"] = leading_dense(m);
    if (dense_prefix(m)) return;
    Json types = Json::array();
    for (int64_t i = 0; i < m.n_layers; ++i) types.push_back(m.moe.is_moe_layer(i) ? "sparse" : "dense");
    j["mlp_layer_types"] = types;
}

double partial_factor(int64_t rot, int64_t D) {
    double f = double(rot) / double(D);
    while (int64_t(f * double(D)) < rot) f = std::nextafter(f, 2.0);
    return f;
}

// Kimi K3's vision_config (the keys the import reads; what it does not read must be the tower's defaults)
Json export_vision(const VisionConfig& v) {
    const Need need{"Kimi K3 vision"};
    const VisionConfig d;
    need(v.channels == d.channels && v.max_grid == d.max_grid && v.rope_theta == d.rope_theta &&
             v.norm_eps == d.norm_eps,
         "the tower sees 3 colours, rotates grids up to 512 patches at theta 10000 and its norms use bf16's epsilon");
    return Json{{"patch_size", v.patch_size},
                {"vt_hidden_size", v.width},
                {"vt_num_hidden_layers", v.layers},
                {"vt_num_attention_heads", v.heads},
                {"qkv_hidden_size", v.qkv_width()},
                {"vt_intermediate_size", v.ffn_dim},
                {"norm_type", "rmsnorm"},
                {"mlp_type", "mlp2"},
                {"activation_func", "gelu_pytorch_tanh"},
                {"attn_bias", false},
                {"linear_bias", false},
                {"patch_embed_proj_bias", false},
                {"pos_emb_type", "divided_fixed"},
                {"init_pos_emb_height", v.pos_height},
                {"init_pos_emb_width", v.pos_width},
                {"pos_emb_interpolation_mode", "bilinear"},
                {"merge_kernel_size", {v.merge_h, v.merge_w}},
                {"merge_type", "sd2_tpool"},
                {"mm_projector_type", "patchmergerv2"},
                {"mm_hidden_size", v.width},
                {"projector_hidden_act", "gelu"},
                {"projector_ln_eps", v.projector_eps},
                {"text_hidden_size", v.text_width}};
}

Json export_kimi(const ModelConfig& m, const HfSpecialTokens& tokens) {
    const Need need{"Kimi-Linear / Kimi K3"};
    Json kda_layers = Json::array(), full_layers = Json::array();
    for (int64_t i = 0; i < m.n_layers; ++i) {
        const std::string& t = m.layer_type(i);
        need(t == "kda" || t == "mla" || t == "dsa", "only kda, mla and dsa layers exist there");
        (t == "kda" ? kda_layers : full_layers).push_back(i + 1);  // 1-based
    }
    need(!(m.has_layer_type("mla") && m.has_layer_type("dsa")), "full-attention layers are all mla or all dsa");
    need(m.output_gate != "headwise", "the MLA output gate is elementwise or absent");
    const KdaConfig& k = m.kda;
    need(k.hv() == k.num_heads && k.v_dim() == k.head_dim && k.rank() == k.head_dim,
         "KDA value heads, value dim and gate rank equal the q/k heads and head dim");
    need(m.moe.experts > 0, "the feed-forward layers are MoE after first_k_dense_replace dense ones");
    need(m.moe.shared_ffn_dim % m.moe.ffn_dim == 0, "the shared experts' width is a multiple of the expert width");
    need(dense_prefix(m), "the dense MLP layers are the first first_k_dense_replace ones (Kimi's code reads no map)");
    need(m.moe.activation == m.mlp_activation || m.moe.every_layer_moe(m.n_layers),
         "one activation (hidden_act) for the dense MLP and the experts");
    need.dropless(m.moe);
    need(m.mla.softmax_scale == 0, "the MLA softmax scale is (d_n + d_r)^-1/2");
    need(!m.rope_scaling.enabled(), "there is no rope scaling (transformers' Kimi-Linear has no rotary embedding)");
    need(k.o_norm_eps == m.norm_eps,
         "the KDA output norm uses rms_norm_eps (set model.kda.o_norm_eps = model.norm_eps)");
    Json lin = {{"num_heads", k.num_heads},
                {"head_dim", k.head_dim},
                {"short_conv_kernel_size", k.conv_size},
                {"kda_layers", kda_layers},
                {"full_attn_layers", full_layers}};
    if (k.gate_lower_bound < 0) lin["gate_lower_bound"] = k.gate_lower_bound;
    if (k.full_rank_output_gate) lin["use_full_rank_gate"] = true;
    Json j = shape_keys(m, "KimiLinearForCausalLM", "kimi_linear", m.n_heads);
    j.update(Json{{"rope_theta", m.rope_theta},
                  {"hidden_act", m.moe.activation == "situ" ? "situ" : "silu"},
                  {"q_lora_rank", m.mla.q_lora_rank > 0 ? Json(m.mla.q_lora_rank) : Json(nullptr)},
                  {"kv_lora_rank", m.mla.kv_lora_rank},
                  {"qk_nope_head_dim", m.mla.qk_nope_dim},
                  {"qk_rope_head_dim", m.mla.qk_rope_dim},
                  {"v_head_dim", m.mla.v_head_dim},
                  {"mla_use_nope", !m.mla.rope},
                  {"mla_use_output_gate", m.output_gate == "elementwise"},
                  {"linear_attn_config", lin},
                  {"num_experts", m.moe.experts},
                  {"num_experts_per_token", m.moe.topk},
                  {"moe_intermediate_size", m.moe.ffn_dim},
                  {"num_shared_experts", m.moe.shared_ffn_dim / m.moe.ffn_dim},
                  {"moe_router_activation_func", m.moe.score},
                  {"moe_renormalize", m.moe.normalize},
                  {"routed_scaling_factor", m.moe.scaling},
                  {"use_grouped_topk", true},
                  {"num_expert_group", m.moe.groups},
                  {"topk_group", m.moe.topk_groups},
                  {"topk_method", "noaux_tc"},
                  {"first_k_dense_replace", leading_dense(m)},
                  {"moe_layer_freq", 1},
                  {"num_nextn_predict_layers", 0}});
    if (m.moe.latent_dim > 0) {
        j["routed_expert_hidden_size"] = m.moe.latent_dim;
        j["latent_moe_use_norm"] = m.moe.latent_norm;
    }
    if (m.has_layer_type("dsa")) {
        need(m.mla.dsa.rope_dim == std::min(m.mla.qk_rope_dim, m.mla.dsa.head_dim),
             "the indexer rotates qk_rope_head_dim dims");
        j["index_topk"] = m.mla.dsa.topk;
        j["index_n_heads"] = m.mla.dsa.heads;
        j["index_head_dim"] = m.mla.dsa.head_dim;
    }
    j["tie_word_embeddings"] = false;  // a tied model's head is written as lm_head.weight: no loader ties it
    token_keys(m, tokens, j);
    need(m.attn_res_block_size > 0 || !m.vision.enabled(), "an image tower comes with Kimi K3's Attention Residuals");
    if (m.attn_res_block_size == 0) return j;
    // Attention Residuals exist only in Kimi K3: its wrapper around the Kimi-Linear text config
    j["attn_res_block_size"] = m.attn_res_block_size;
    Json k3 = {{"architectures", {"KimiK3ForConditionalGeneration"}},
               {"model_type", "kimi_k3"},
               {"tie_word_embeddings", false},
               {"text_config", j}};
    token_keys(m, tokens, k3);
    if (m.vision.enabled()) {
        k3["vision_config"] = export_vision(m.vision);
        k3["media_placeholder_token_id"] = m.vision.image_token;
    }
    return k3;
}

Json export_qwen3_next(const ModelConfig& m, const HfSpecialTokens& tokens) {
    const Need need{"Qwen3-Next"};
    need(!m.vision.enabled(), "an image tower exists only in Kimi K3");
    Json types = Json::array();
    for (int64_t i = 0; i < m.n_layers; ++i) {
        const std::string& t = m.layer_type(i);
        need(t == "gdn" || t == "gqa", "only gdn and gqa layers exist there");
        types.push_back(t == "gdn" ? "linear_attention" : "full_attention");
    }
    need(m.output_gate == "elementwise" && m.qk_norm, "the attention has an elementwise gate and q/k norms");
    const KdaConfig& k = m.kda;
    need(k.gate_lower_bound == 0 && k.o_norm_eps == m.norm_eps,
         "the GDN decay is the softplus form and its output norm uses rms_norm_eps");
    const MoeConfig& e = m.moe;
    need(e.experts > 0, "the model has routed experts (num_experts > 0)");
    need(m.mlp_activation == "swiglu" || e.every_layer_moe(m.n_layers), "the dense MLP layers are SwiGLU");
    need(e.score == "softmax" && e.groups == 1 && e.scaling == 1.0 && e.latent_dim == 0 && e.activation == "swiglu",
         "the router is a plain softmax top-k over SwiGLU experts");
    need(e.balance == "frozen", "there is no selection bias (set model.moe.balance = frozen)");
    need(e.shared_expert_gate == (e.shared_ffn_dim > 0), "a shared expert comes with its sigmoid gate");
    need.dropless(e, true);
    const int64_t D = m.head_dim_or_default(), rot = m.rope_dim > 0 ? m.rope_dim : D;
    Json j = shape_keys(m, "Qwen3NextForCausalLM", "qwen3_next", m.n_kv_heads);
    j.update(Json{{"head_dim", D},
                  {"hidden_act", "silu"},
                  {"layer_types", types},
                  {"linear_num_key_heads", k.num_heads},
                  {"linear_num_value_heads", k.hv()},
                  {"linear_key_head_dim", k.head_dim},
                  {"linear_value_head_dim", k.v_dim()},
                  {"linear_conv_kernel_dim", k.conv_size},
                  {"rope_parameters", rope_parameters(m, partial_factor(rot, D))},
                  {"num_experts", e.experts},
                  {"num_experts_per_tok", e.topk},
                  {"moe_intermediate_size", e.ffn_dim},
                  {"shared_expert_intermediate_size", e.shared_ffn_dim},
                  {"norm_topk_prob", e.normalize},
                  {"decoder_sparse_step", 1},
                  {"router_aux_loss_coef", e.global_aux_coeff},
                  {"output_router_logits", e.global_aux_coeff > 0}});
    Json dense = Json::array();  // Qwen3NextDecoderLayer: a dense MLP on these layers (0-based)
    for (int64_t i = 0; i < m.n_layers; ++i) {
        if (!e.is_moe_layer(i)) dense.push_back(i);
    }
    j["mlp_only_layers"] = dense;
    token_keys(m, tokens, j);
    yarn_context(m, j);
    return j;
}

Json export_deepseek_v32(const ModelConfig& m, const HfSpecialTokens& tokens) {
    const Need need{"DeepSeek-V3.2"};
    need(!m.vision.enabled(), "an image tower exists only in Kimi K3");
    for (int64_t i = 0; i < m.n_layers; ++i) need(m.layer_type(i) == "dsa", "every layer is dsa");
    const MlaConfig& a = m.mla;
    need(m.output_gate == "none" && a.rope && a.q_lora_rank > 0 && a.softmax_scale == 0 && a.latent_eps == 1e-6,
         "MLA is ungated with RoPE, a q_lora path, the (d_n + d_r)^-1/2 scale and latent norm eps 1e-6");
    need(a.dsa.rope_dim == std::min(a.qk_rope_dim, a.dsa.head_dim), "the indexer rotates qk_rope_head_dim dims");
    const MoeConfig& e = m.moe;
    need(e.experts > 0 && e.score == "sigmoid" && e.latent_dim == 0 && e.activation == "swiglu" &&
             m.mlp_activation == "swiglu" && !e.shared_expert_gate,
         "the MoE has a sigmoid router over SwiGLU experts");
    need(e.shared_ffn_dim % e.ffn_dim == 0, "the shared experts' width is a multiple of the expert width");
    need.dropless(e);
    Json j = shape_keys(m, "DeepseekV32ForCausalLM", "deepseek_v32", m.n_heads);
    j.update(Json{{"hidden_act", "silu"},
                  {"rope_parameters", rope_parameters(m)},
                  {"q_lora_rank", a.q_lora_rank},
                  {"kv_lora_rank", a.kv_lora_rank},
                  {"qk_nope_head_dim", a.qk_nope_dim},
                  {"qk_rope_head_dim", a.qk_rope_dim},
                  {"v_head_dim", a.v_head_dim},
                  {"index_topk", a.dsa.topk},
                  {"index_n_heads", a.dsa.heads},
                  {"index_head_dim", a.dsa.head_dim},
                  {"n_routed_experts", e.experts},
                  {"num_experts_per_tok", e.topk},
                  {"moe_intermediate_size", e.ffn_dim},
                  {"n_shared_experts", e.shared_ffn_dim / e.ffn_dim},
                  {"routed_scaling_factor", e.scaling},
                  {"norm_topk_prob", e.normalize},
                  {"n_group", e.groups},
                  {"topk_group", e.topk_groups},
                  {"scoring_func", "sigmoid"},
                  {"topk_method", "noaux_tc"},
                  {"num_nextn_predict_layers", 0}});
    mlp_layer_keys(m, j);
    token_keys(m, tokens, j);
    yarn_context(m, j);
    return j;
}
}  // namespace

Json export_hf_config(const ModelConfig& m, const HfSpecialTokens& tokens) {
    if (m.has_layer_type("gdn") || m.has_layer_type("gqa")) return export_qwen3_next(m, tokens);
    if (!m.has_layer_type("kda") && !m.has_layer_type("mla") && m.output_gate == "none" && m.mla.rope) {
        return export_deepseek_v32(m, tokens);
    }
    return export_kimi(m, tokens);
}

}  // namespace tessera::model
