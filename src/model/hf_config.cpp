// Hugging Face config import (see hf_config.h). Field meanings: spec/kimi_k3.md §1 (Kimi), spec/dsa.md §7
// (DeepSeek-V3.2), the Qwen3-Next model card and config; the files under configs/hf/ are the published ones.
#include "model/hf_config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/check.h"

namespace tessera::model {

namespace {
// Keys of a config object, each marked when read; what is left at the end is reported, not dropped.
class Keys {
  public:
    Keys(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {
        TESSERA_CHECK(obj.is_object(), "{}: a Hugging Face config must be a JSON object", where_);
    }
    bool has(const std::string& k) const { return obj_.contains(k) && !obj_.at(k).is_null(); }
    const Json& get(const std::string& k) {
        used_.insert(k);
        TESSERA_CHECK(has(k), "{}: missing key \"{}\"", where_, k);
        return obj_.at(k);
    }
    int64_t integer(const std::string& k) {
        const Json& v = get(k);
        TESSERA_CHECK(v.is_number_integer(), "{}: \"{}\" must be an integer, not {}", where_, k, v.dump());
        return v.get<int64_t>();
    }
    int64_t integer_or(const std::string& k, int64_t def) { return has(k) ? integer(k) : (used_.insert(k), def); }
    double number_or(const std::string& k, double def) {
        if (!has(k)) return used_.insert(k), def;
        const Json& v = get(k);
        TESSERA_CHECK(v.is_number(), "{}: \"{}\" must be a number, not {}", where_, k, v.dump());
        return v.get<double>();
    }
    bool boolean_or(const std::string& k, bool def) {
        if (!has(k)) return used_.insert(k), def;
        const Json& v = get(k);
        TESSERA_CHECK(v.is_boolean(), "{}: \"{}\" must be true or false, not {}", where_, k, v.dump());
        return v.get<bool>();
    }
    std::string text_or(const std::string& k, const std::string& def) {
        if (!has(k)) return used_.insert(k), def;
        const Json& v = get(k);
        TESSERA_CHECK(v.is_string(), "{}: \"{}\" must be a string, not {}", where_, k, v.dump());
        return v.get<std::string>();
    }
    void ignore(std::initializer_list<const char*> ks) {
        for (const char* k : ks) used_.insert(k);
    }
    // keys never read: "key = value (not interpreted)"
    void report_rest(std::vector<std::string>& out) const {
        for (auto it = obj_.begin(); it != obj_.end(); ++it) {
            if (used_.count(it.key()) || it.key().rfind('_', 0) == 0) continue;
            std::string v = it.value().dump();
            if (v.size() > 60) v = v.substr(0, 57) + "...";
            out.push_back(fmt::format("{}: key \"{}\" = {} is not interpreted", where_, it.key(), v));
        }
    }
    const std::string& where() const { return where_; }

  private:
    const Json& obj_;
    std::string where_;
    std::set<std::string> used_;
};

// Keys that describe tokens, storage, caching or generation, not the architecture. (quantization_config: how the
// weights are stored, which the load reads per tensor: MXFP4 `weight_packed` + `weight_scale` and block FP8 with
// `weight_scale_inv` dequantised or held, model/hf_checkpoint.h; a tensor stored any other way is missing there.)
void ignore_common(Keys& k) {
    k.ignore({"quantization_config"});
    k.ignore({"architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache",
              "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "max_position_embeddings",
              "model_max_length", "attention_dropout", "output_router_logits", "ignore_index", "ep_size",
              // transformers PretrainedConfig defaults serialised into nested configs
              "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "chunk_size_feed_forward",
              "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample",
              "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task",
              "forced_bos_token_id", "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id",
              "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
              "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores", "prefix",
              "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
              "return_dict_in_generate", "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss",
              "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p", "torchscript", "typical_p", "use_bfloat16"});
}

void common_shape(Keys& k, ModelConfig& m, std::vector<std::string>& unsupported) {
    m.vocab_size = k.integer("vocab_size");
    m.d_model = k.integer("hidden_size");
    m.n_layers = k.integer("num_hidden_layers");
    m.n_heads = k.integer("num_attention_heads");
    m.n_kv_heads = k.integer_or("num_key_value_heads", m.n_heads);
    m.ffn_dim = k.integer_or("intermediate_size", 0);
    m.norm_eps = k.number_or("rms_norm_eps", 1e-6);
    m.init_std = k.number_or("initializer_range", 0.02);
    m.tie_embeddings = k.boolean_or("tie_word_embeddings", false);
    const std::string act = k.text_or("hidden_act", "silu");
    TESSERA_CHECK(act == "silu" || act == "situ", "{}: hidden_act \"{}\" is not supported (silu or situ)", k.where(),
                  act);
    m.moe.activation = act == "situ" ? "situ" : "swiglu";
    m.mlp_activation = m.moe.activation;
    if (act == "situ") {
        const double beta = k.number_or("activation_situ_beta", 4.0),
                     lin = k.number_or("activation_situ_linear_beta", 25.0);
        if (beta != 4.0 || lin != 25.0) {
            unsupported.push_back(
                fmt::format("SiTU betas {} / {} (the engine's SiTU-GLU is fixed at 4 / 25)", beta, lin));
        }
    }
    const int64_t mtp = k.integer_or("num_nextn_predict_layers", 0);
    if (mtp > 0)
        unsupported.push_back(fmt::format("{} multi-token-prediction layer(s) (num_nextn_predict_layers)", mtp));
    if (k.boolean_or("attention_bias", false)) unsupported.push_back("attention projection biases (attention_bias)");
}

// The rotary settings of a transformers config into m.rope_theta and m.rope_scaling; returns
// partial_rotary_factor (default_partial when absent). As transformers' convert_rope_params_to_dict /
// standardize_rope_params: a non-null `rope_scaling` (older files) replaces `rope_parameters`; the dict's own
// rope_theta and partial_rotary_factor win over the top-level keys; a yarn dict without
// original_max_position_embeddings takes the top-level one (which also wins when both exist), else
// max_position_embeddings; a null factor is max_position_embeddings / original. Types other than default and
// yarn are unsupported.
double import_rope(Keys& k, ModelConfig& m, double default_partial, std::vector<std::string>& unsupported) {
    m.rope_theta = k.number_or("rope_theta", m.rope_theta);
    double partial = k.number_or("partial_rotary_factor", default_partial);
    const char* key = k.has("rope_scaling") ? "rope_scaling" : k.has("rope_parameters") ? "rope_parameters" : nullptr;
    k.ignore({"rope_scaling", "rope_parameters"});
    if (!key) return partial;
    Keys y(k.get(key), k.where() + ": " + key);
    const std::string type = y.has("rope_type") ? y.text_or("rope_type", "") : y.text_or("type", "default");
    y.ignore({"type", "rope_type"});
    m.rope_theta = y.number_or("rope_theta", m.rope_theta);
    partial = y.number_or("partial_rotary_factor", partial);
    if (type == "default") {
        y.report_rest(unsupported);
        return partial;
    }
    if (type != "yarn") {
        unsupported.push_back(fmt::format("rope type \"{}\" ({}): tessera builds default RoPE and YaRN", type, key));
        y.ignore({"factor", "original_max_position_embeddings"});
        y.report_rest(unsupported);
        return partial;
    }
    ops::RopeScaling& s = m.rope_scaling;
    s.type = ops::RopeScaling::Type::yarn;
    const int64_t max_pos = k.integer_or("max_position_embeddings", 0);
    s.original_max_position = k.has("original_max_position_embeddings")
                                  ? k.integer("original_max_position_embeddings")
                                  : y.integer_or("original_max_position_embeddings", max_pos);
    y.ignore({"original_max_position_embeddings"});
    TESSERA_CHECK(s.original_max_position > 0, "{}: yarn needs original_max_position_embeddings", y.where());
    s.factor = y.has("factor") ? y.number_or("factor", 1.0) : double(max_pos) / double(s.original_max_position);
    y.ignore({"factor"});
    auto or_default = [](double v, double def) { return v != 0 ? v : def; };  // transformers: `x or default`
    s.beta_fast = or_default(y.number_or("beta_fast", 0.0), 32.0);
    s.beta_slow = or_default(y.number_or("beta_slow", 0.0), 1.0);
    s.mscale = y.number_or("mscale", 0.0);
    s.mscale_all_dim = y.number_or("mscale_all_dim", 0.0);
    s.attention_factor = y.number_or("attention_factor", 0.0);
    s.truncate = y.boolean_or("truncate", true);
    s.validate(y.where());
    y.report_rest(unsupported);
    return partial;
}

// a derived copy of a field (transformers 5 re-serialises them): absent, or equal to what the config implies
void same(Keys& k, const char* key, const Json& want) {
    if (!k.has(key)) return k.ignore({key});
    TESSERA_CHECK(k.get(key) == want, "{}: \"{}\" = {} contradicts the layer settings ({})", k.where(), key,
                  k.get(key).dump(), want.dump());
}

// model.moe.first_dense when the dense layers are the first ones, else the per-layer map
void set_moe_layers(ModelConfig& m, const std::vector<std::string>& layers) {
    int64_t first = 0;
    while (first < int64_t(layers.size()) && layers[size_t(first)] == "dense") ++first;
    const bool prefix = std::all_of(layers.begin() + first, layers.end(), [](const auto& t) { return t == "moe"; });
    m.moe.first_dense = prefix ? first : 0;
    m.moe.layers = prefix ? std::vector<std::string>{} : layers;
}

void mla_shape(Keys& k, ModelConfig& m) {
    m.mla.q_lora_rank = k.integer_or("q_lora_rank", 0);  // null (Kimi-Linear): q_proj from the input
    m.mla.kv_lora_rank = k.integer("kv_lora_rank");
    m.mla.qk_nope_dim = k.integer("qk_nope_head_dim");
    m.mla.qk_rope_dim = k.integer("qk_rope_head_dim");
    m.mla.v_head_dim = k.integer("v_head_dim");
    m.n_kv_heads = m.n_heads;  // MLA has no grouped kv heads
}

void deepseek_moe(Keys& k, ModelConfig& m, const char* experts, const char* topk, const char* shared) {
    m.moe.experts = k.integer(experts);
    m.moe.topk = k.integer(topk);
    m.moe.ffn_dim = k.integer("moe_intermediate_size");
    m.moe.shared_ffn_dim = k.integer_or(shared, 0) * m.moe.ffn_dim;
    m.moe.scaling = k.number_or("routed_scaling_factor", 1.0);
    m.moe.balance = "sign";  // aux-loss-free (noaux_tc)
}

// Which layers are MoE, as transformers 5 decides: its mlp_layer_types ("dense" | "sparse") when the file has
// them, else the first first_k_dense_replace layers dense (transformers' default k when the key is absent).
// A map of that shape becomes model.moe.first_dense, any other model.moe.layers.
void moe_layers(Keys& k, ModelConfig& m, int64_t default_first_dense) {
    const int64_t first = std::min(k.integer_or("first_k_dense_replace", default_first_dense), m.n_layers);
    TESSERA_CHECK(first >= 0, "{}: first_k_dense_replace must be >= 0", k.where());
    std::vector<std::string> layers;
    for (int64_t i = 0; i < m.n_layers; ++i) layers.push_back(i < first ? "dense" : "moe");
    if (k.has("mlp_layer_types")) {
        const Json& types = k.get("mlp_layer_types");
        TESSERA_CHECK(types.is_array() && int64_t(types.size()) == m.n_layers,
                      "{}: mlp_layer_types must list num_hidden_layers = {} entries", k.where(), m.n_layers);
        for (size_t i = 0; i < types.size(); ++i) {
            TESSERA_CHECK(types[i] == "dense" || types[i] == "sparse",
                          "{}: mlp_layer_types entry {} is not dense or sparse", k.where(), types[i].dump());
            layers[i] = types[i] == "sparse" ? "moe" : "dense";
        }
    }
    set_moe_layers(m, layers);
}

void check_moe_layer_freq(Keys& k, std::vector<std::string>& unsupported) {
    const int64_t freq = k.integer_or("moe_layer_freq", 1);
    if (freq != 1) unsupported.push_back(fmt::format("MoE on every {}th layer only (moe_layer_freq)", freq));
}

// Kimi-Linear / Kimi K3 text config (model_type kimi_linear)
void import_kimi(Keys& k, HfImport& r) {
    ModelConfig& m = r.model;
    common_shape(k, m, r.unsupported);
    mla_shape(k, m);
    k.ignore({"head_dim"});  // hidden_size / heads: an artefact the model never uses (spec/kimi_k3.md §1.2)
    m.mla.rope = !k.boolean_or("mla_use_nope", false);
    m.output_gate = k.boolean_or("mla_use_output_gate", false) ? "elementwise" : "none";
    import_rope(k, m, 1.0, r.unsupported);
    if (m.rope_scaling.enabled()) {  // transformers' Kimi-Linear has no rotary embedding to scale
        r.unsupported.push_back("YaRN rope scaling on a Kimi config (what the Kimi code makes of it is not built)");
        m.rope_scaling = {};
    }
    // KDA
    Keys lin(k.get("linear_attn_config"), k.where() + ": linear_attn_config");
    m.kda.num_heads = lin.integer("num_heads");
    m.kda.head_dim = lin.integer("head_dim");
    m.kda.conv_size = lin.integer_or("short_conv_kernel_size", 4);
    m.kda.gate_lower_bound = lin.number_or("gate_lower_bound", 0.0);
    m.kda.full_rank_output_gate = lin.boolean_or("use_full_rank_gate", false);
    m.kda.o_norm_eps = m.norm_eps;  // the gated output norm uses rms_norm_eps (transformers' KimiLinearRMSNormGated)
    m.attention.assign(size_t(m.n_layers), "");
    const bool dsa = k.has("index_topk");
    for (const char* list : {"kda_layers", "full_attn_layers"}) {
        const Json& v = lin.get(list);
        TESSERA_CHECK(v.is_array(), "{}: \"{}\" must be a list of 1-based layer numbers", lin.where(), list);
        for (const Json& e : v) {
            TESSERA_CHECK(e.is_number_integer() && e.get<int64_t>() >= 1 && e.get<int64_t>() <= m.n_layers,
                          "{}: {} entry {} is not a layer number in [1, {}]", lin.where(), list, e.dump(), m.n_layers);
            std::string& slot = m.attention[size_t(e.get<int64_t>() - 1)];
            TESSERA_CHECK(slot.empty(), "{}: layer {} is listed twice", lin.where(), e.get<int64_t>());
            slot = std::string(list) == "kda_layers" ? "kda" : dsa ? "dsa" : "mla";
        }
    }
    for (size_t i = 0; i < m.attention.size(); ++i) {
        TESSERA_CHECK(!m.attention[i].empty(), "{}: layer {} (1-based) is in neither kda_layers nor full_attn_layers",
                      lin.where(), i + 1);
    }
    lin.report_rest(r.unsupported);
    // transformers 5 re-serialises derived copies of these fields: they must agree
    Json layer_types = Json::array();
    for (int64_t i = 0; i < m.n_layers; ++i) {
        layer_types.push_back(m.attention[size_t(i)] == "kda" ? "linear_attention" : "full_attention");
    }
    same(k, "layer_types", layer_types);
    same(k, "linear_num_heads", m.kda.num_heads);
    same(k, "linear_head_dim", m.kda.head_dim);
    same(k, "linear_conv_kernel_dim", m.kda.conv_size);
    same(k, "qk_head_dim", m.mla.qk_nope_dim + m.mla.qk_rope_dim);
    same(k, "pretraining_tp", 1);
    if (dsa) {  // the gated DSA variant of the full-attention layers
        m.mla.dsa.topk = k.integer("index_topk");
        m.mla.dsa.heads = k.integer("index_n_heads");
        m.mla.dsa.head_dim = k.integer("index_head_dim");
        m.mla.dsa.rope_dim = std::min(m.mla.qk_rope_dim, m.mla.dsa.head_dim);
    }
    // MoE
    deepseek_moe(k, m, "num_experts", "num_experts_per_token", "num_shared_experts");
    moe_layers(k, m, 1);  // KimiLinearConfig's default first_k_dense_replace
    m.moe.latent_dim = k.integer_or("routed_expert_hidden_size", 0);
    m.moe.latent_norm = k.boolean_or("latent_moe_use_norm", false);
    m.moe.score = k.text_or("moe_router_activation_func", "sigmoid");
    TESSERA_CHECK(m.moe.score == "sigmoid" || m.moe.score == "softmax",
                  "{}: moe_router_activation_func \"{}\" is not supported", k.where(), m.moe.score);
    m.moe.normalize = k.boolean_or("moe_renormalize", true);
    if (k.boolean_or("use_grouped_topk", false)) {
        m.moe.groups = k.integer_or("num_expert_group", 1);
        m.moe.topk_groups = k.integer_or("topk_group", 1);
    }
    k.ignore({"num_expert_group", "topk_group"});
    const std::string method = k.text_or("topk_method", "noaux_tc");
    if (method != "noaux_tc") r.unsupported.push_back(fmt::format("topk_method \"{}\"", method));
    check_moe_layer_freq(k, r.unsupported);
    m.attn_res_block_size = k.integer_or("attn_res_block_size", 0);
}

void import_qwen3_next(Keys& k, HfImport& r) {
    ModelConfig& m = r.model;
    common_shape(k, m, r.unsupported);
    m.head_dim = k.integer_or("head_dim", 0);
    m.output_gate = "elementwise";  // q_proj carries a per-element gate (packed per head in the checkpoint)
    m.attention.clear();
    if (k.has("layer_types")) {  // transformers 5 writes the map; older configs give the interval
        const Json& types = k.get("layer_types");
        TESSERA_CHECK(types.is_array() && int64_t(types.size()) == m.n_layers,
                      "{}: layer_types must list num_hidden_layers = {} entries", k.where(), m.n_layers);
        for (const Json& t : types) {
            TESSERA_CHECK(t == "linear_attention" || t == "full_attention",
                          "{}: layer_types entry {} is not linear_attention or full_attention", k.where(), t.dump());
            m.attention.push_back(t == "full_attention" ? "gqa" : "gdn");
        }
        k.ignore({"full_attention_interval"});
    } else {
        const int64_t interval = k.integer("full_attention_interval");
        TESSERA_CHECK(interval >= 1, "{}: full_attention_interval must be >= 1", k.where());
        for (int64_t i = 0; i < m.n_layers; ++i) m.attention.push_back((i + 1) % interval == 0 ? "gqa" : "gdn");
    }
    m.kda.num_heads = k.integer("linear_num_key_heads");
    m.kda.num_v_heads = k.integer("linear_num_value_heads");
    m.kda.head_dim = k.integer("linear_key_head_dim");
    m.kda.head_v_dim = k.integer("linear_value_head_dim");
    m.kda.conv_size = k.integer_or("linear_conv_kernel_dim", 4);
    // transformers' Qwen3NextConfig defaults partial_rotary_factor to 0.25 and rotates int(head_dim · factor) dims
    const double partial = import_rope(k, m, 0.25, r.unsupported);
    const int64_t D = m.head_dim_or_default(), rot = int64_t(partial * double(D));
    if (rot <= 0 || rot % 2 != 0) {
        r.unsupported.push_back(fmt::format(
            "partial_rotary_factor {} of head_dim {}: int(head_dim · factor) = {} rotary dims (transformers then "
            "rotates {} dims at the frequencies of a {}-dim rotation; tessera rotates an even, positive number)",
            partial, D, rot, rot + rot % 2, rot));
    } else {
        m.rope_dim = rot == D ? 0 : rot;
    }
    m.kda.o_norm_eps = m.norm_eps;  // the gated output norm uses rms_norm_eps
    m.qk_norm = true;               // Qwen3's per-head q_norm / k_norm
    if (k.boolean_or("use_sliding_window", false)) r.unsupported.push_back("sliding-window attention");
    k.ignore({"sliding_window", "max_window_layers"});
    m.moe.experts = k.integer("num_experts");
    m.moe.topk = k.integer("num_experts_per_tok");
    m.moe.ffn_dim = k.integer("moe_intermediate_size");
    m.moe.shared_ffn_dim = k.integer_or("shared_expert_intermediate_size", 0);
    m.moe.shared_expert_gate = m.moe.shared_ffn_dim > 0;  // shared_expert_gate: σ(w·x) on the shared output
    m.moe.score = "softmax";
    m.moe.normalize = k.boolean_or("norm_topk_prob", true);
    m.moe.balance = "frozen";  // Qwen routes without a selection bias
    // Qwen3NextDecoderLayer: MoE where the layer is not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    const int64_t step = k.integer_or("decoder_sparse_step", 1);
    TESSERA_CHECK(step >= 1, "{}: decoder_sparse_step must be >= 1, not {}", k.where(), step);
    std::vector<std::string> layers(size_t(m.n_layers), "moe");
    for (int64_t i = 0; i < m.n_layers; ++i) layers[size_t(i)] = (i + 1) % step == 0 ? "moe" : "dense";
    if (k.has("mlp_only_layers")) {
        const Json& dense = k.get("mlp_only_layers");
        TESSERA_CHECK(dense.is_array(), "{}: mlp_only_layers must be a list of 0-based layer indices", k.where());
        for (const Json& e : dense) {
            TESSERA_CHECK(e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() < m.n_layers,
                          "{}: mlp_only_layers entry {} is not a layer index in [0, {})", k.where(), e.dump(),
                          m.n_layers);
            layers[size_t(e.get<int64_t>())] = "dense";
        }
    }
    k.ignore({"mlp_only_layers"});
    set_moe_layers(m, layers);
    // Qwen3NextForCausalLM adds router_aux_loss_coef · load_balancing_loss_func only when output_router_logits is
    // set (the published configs have it false): the global balance loss pooled over the MoE layers (docs/moe.md)
    const double aux = k.number_or("router_aux_loss_coef", 0.001);  // Qwen3NextConfig's default
    m.moe.global_aux_coeff = k.boolean_or("output_router_logits", false) ? aux : 0.0;
}

void import_deepseek_v32(Keys& k, HfImport& r) {
    ModelConfig& m = r.model;
    common_shape(k, m, r.unsupported);
    mla_shape(k, m);
    m.attention = {"dsa"};
    m.mla.dsa.topk = k.integer("index_topk");
    m.mla.dsa.heads = k.integer("index_n_heads");
    m.mla.dsa.head_dim = k.integer("index_head_dim");
    m.mla.dsa.rope_dim = std::min(m.mla.qk_rope_dim, m.mla.dsa.head_dim);
    // YaRN on MLA's and the indexer's rope dims; MLA's τ then takes g(factor, mscale_all_dim)² (spec/dsa.md §1.2)
    const double partial = import_rope(k, m, 1.0, r.unsupported);
    if (partial != 1.0) {
        r.unsupported.push_back(fmt::format("partial_rotary_factor {} of the MLA rope dims", partial));
    }
    // transformers 5's derived copies: every layer indexed, dense layers first
    same(k, "layer_types", Json(std::vector<std::string>(size_t(m.n_layers), "indexed_attention")));
    same(k, "qk_head_dim", m.mla.qk_nope_dim + m.mla.qk_rope_dim);
    same(k, "head_dim", m.mla.qk_rope_dim);  // transformers' rotary width
    if (k.boolean_or("mlp_bias", false)) r.unsupported.push_back("MLP biases (mlp_bias)");
    deepseek_moe(k, m, "n_routed_experts", "num_experts_per_tok", "n_shared_experts");
    moe_layers(k, m, 3);  // DeepseekV32Config's default first_k_dense_replace
    m.moe.score = k.text_or("scoring_func", "sigmoid");
    m.moe.normalize = k.boolean_or("norm_topk_prob", true);
    m.moe.groups = k.integer_or("n_group", 1);
    m.moe.topk_groups = k.integer_or("topk_group", 1);
    const std::string method = k.text_or("topk_method", "noaux_tc");
    if (method != "noaux_tc") r.unsupported.push_back(fmt::format("topk_method \"{}\"", method));
    check_moe_layer_freq(k, r.unsupported);
}

}  // namespace

void require_supported(const HfImport& imported, const std::string& where) {
    if (imported.unsupported.empty()) return;
    const size_t more = imported.unsupported.size() - 1;
    TESSERA_FAIL(
        "{}: {} uses what tessera does not build: {}{} (`tessera inspect` lists it); refusing to run a "
        "different model",
        where, imported.family, imported.unsupported.front(),
        more ? fmt::format(" (and {} more)", more) : std::string());
}

namespace {

// Kimi K3's vision_config (spec/kimi_k3.md §1.5); text_width: the language model's hidden size. Keys that ask for
// what the tower does not build (another norm, activation, merge or projector type, biases) are unsupported.
VisionConfig parse_hf_vision_config(const Json& doc,
                                    int64_t text_width,
                                    const std::string& where,
                                    std::vector<std::string>& unsupported) {
    TESSERA_CHECK(doc.is_object(), "{}: vision_config must be an object", where);
    auto integer = [&](const char* key) -> int64_t {
        TESSERA_CHECK(doc.contains(key) && doc[key].is_number_integer(), "{}: vision_config.{} must be an integer",
                      where, key);
        return doc[key].get<int64_t>();
    };
    auto text_or = [&](const char* key, const std::string& built) {
        if (doc.contains(key) && doc[key] != Json(built))
            unsupported.push_back(
                fmt::format("vision_config.{} {} (the tower builds \"{}\")", key, doc[key].dump(), built));
    };
    auto flag_false = [&](const char* key) {
        if (doc.contains(key) && doc[key] != Json(false))
            unsupported.push_back(fmt::format("vision_config.{} {} (the tower has no biases)", key, doc[key].dump()));
    };
    VisionConfig c;
    c.patch_size = integer("patch_size");
    c.width = integer("vt_hidden_size");
    c.layers = integer("vt_num_hidden_layers");
    c.heads = integer("vt_num_attention_heads");
    c.ffn_dim = integer("vt_intermediate_size");
    TESSERA_CHECK(doc.contains("qkv_hidden_size") || c.width % c.heads == 0,
                  "{}: vision_config: vt_hidden_size {} is not a whole number of {} heads", where, c.width, c.heads);
    const int64_t qkv = doc.contains("qkv_hidden_size") ? integer("qkv_hidden_size") : c.width;
    TESSERA_CHECK(c.heads > 0 && qkv % c.heads == 0, "{}: vision_config.qkv_hidden_size {} is not {} whole heads",
                  where, qkv, c.heads);
    c.head_dim = qkv / c.heads;
    if (doc.contains("init_pos_emb_height")) c.pos_height = integer("init_pos_emb_height");
    if (doc.contains("init_pos_emb_width")) c.pos_width = integer("init_pos_emb_width");
    if (doc.contains("merge_kernel_size")) {
        const Json& m = doc["merge_kernel_size"];
        TESSERA_CHECK(m.is_array() && m.size() == 2 && m[0].is_number_integer() && m[1].is_number_integer(),
                      "{}: vision_config.merge_kernel_size must be [h, w]", where);
        c.merge_h = m[0].get<int64_t>();
        c.merge_w = m[1].get<int64_t>();
    }
    if (doc.contains("projector_ln_eps")) {
        TESSERA_CHECK(doc["projector_ln_eps"].is_number(), "{}: vision_config.projector_ln_eps must be a number",
                      where);
        c.projector_eps = doc["projector_ln_eps"].get<double>();
    }
    if (doc.contains("text_hidden_size")) {
        TESSERA_CHECK(integer("text_hidden_size") == text_width,
                      "{}: vision_config.text_hidden_size {} is not the language model's hidden size {}", where,
                      integer("text_hidden_size"), text_width);
    }
    if (doc.contains("mm_hidden_size")) {
        TESSERA_CHECK(integer("mm_hidden_size") == c.width,
                      "{}: vision_config.mm_hidden_size {} must equal vt_hidden_size {}", where,
                      integer("mm_hidden_size"), c.width);
    }
    c.text_width = text_width;
    text_or("norm_type", "rmsnorm");
    text_or("mlp_type", "mlp2");
    text_or("activation_func", "gelu_pytorch_tanh");
    text_or("projector_hidden_act", "gelu");
    text_or("pos_emb_type", "divided_fixed");
    text_or("pos_emb_interpolation_mode", "bilinear");
    text_or("merge_type", "sd2_tpool");
    text_or("mm_projector_type", "patchmergerv2");
    flag_false("attn_bias");
    flag_false("linear_bias");
    flag_false("patch_embed_proj_bias");
    return c;
}

}  // namespace

bool is_hf_config(const Json& doc) {
    return doc.is_object() && (doc.contains("model_type") || doc.contains("architectures"));
}

HfImport import_hf_config(const Json& doc, const std::string& where) {
    Keys top(doc, where);
    HfImport r;
    const std::string type = top.text_or("model_type", "");
    r.model_type = type;
    if (type == "kimi_k3") {
        r.family = "Kimi K3 (kimi_k3; text model kimi_linear)";
        top.ignore({"architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
                    "ignore_index", "tie_word_embeddings", "transformers_version"});
        top.ignore({"image_placeholder", "media_placeholder_token_id", "vision_config"});
        Keys text(top.get("text_config"), where + ": text_config");
        ignore_common(text);
        import_kimi(text, r);
        text.report_rest(r.unsupported);
        if (doc.contains("vision_config")) {
            r.model.vision = parse_hf_vision_config(doc["vision_config"], r.model.d_model, where, r.unsupported);
            TESSERA_CHECK(
                doc.contains("media_placeholder_token_id") && doc["media_placeholder_token_id"].is_number_integer(),
                "{}: vision_config is set but media_placeholder_token_id (the image token) is not", where);
            r.model.vision.image_token = doc["media_placeholder_token_id"].get<int64_t>();
            r.model.vision.validate(where + ": vision_config");
        }
        r.family = text.has("index_topk") ? "Kimi K3 with gated DSA (kimi_k3)" : r.family;
    } else if (type == "kimi_linear") {
        r.family =
            doc.contains("index_topk") ? "Kimi-Linear with gated DSA (kimi_linear)" : "Kimi-Linear (kimi_linear)";
        ignore_common(top);
        import_kimi(top, r);
    } else if (type == "qwen3_next") {
        r.family = "Qwen3-Next (qwen3_next)";
        ignore_common(top);
        import_qwen3_next(top, r);
    } else if (type == "deepseek_v32") {
        r.family = "DeepSeek-V3.2 (deepseek_v32)";
        ignore_common(top);
        import_deepseek_v32(top, r);
    } else {
        TESSERA_FAIL("{}: model_type \"{}\" is not a supported family (kimi_k3, kimi_linear, qwen3_next, deepseek_v32)",
                     where, type);
    }
    top.report_rest(r.unsupported);
    clear_unread_keys(r.model);  // e.g. intermediate_size when every layer is MoE
    r.model.validate(where);
    return r;
}

Json mxfp4_experts_quantization_config() {
    // the entry of Kimi K3's release (configs/hf/kimi_k3.json), its ignore list one pattern: not a routed expert
    const Json weights = {{"actorder", nullptr},
                          {"block_structure", nullptr},
                          {"dynamic", false},
                          {"group_size", 32},
                          {"num_bits", 4},
                          {"observer", "minmax"},
                          {"observer_kwargs", Json::object()},
                          {"scale_dtype", "torch.uint8"},
                          {"strategy", "group"},
                          {"symmetric", true},
                          {"type", "float"},
                          {"zp_dtype", nullptr}};
    return {{"config_groups",
             {{"group_0",
               {{"format", "mxfp4-pack-quantized"},
                {"input_activations", nullptr},
                {"output_activations", nullptr},
                {"targets", {"Linear"}},
                {"weights", weights}}}}},
            {"format", "mxfp4-pack-quantized"},
            {"global_compression_ratio", nullptr},
            {"ignore", {"re:^(?!.*\\.experts\\.[0-9]+\\.).*$"}},
            {"kv_cache_scheme", nullptr},
            {"quant_method", "compressed-tensors"},
            {"quantization_status", "compressed"}};
}

}  // namespace tessera::model
