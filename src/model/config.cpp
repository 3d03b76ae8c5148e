// Model config parsing, validation and serialisation.
#include "model/config.h"

#include <algorithm>
#include <functional>

#include "core/check.h"
#include "ops/causal_conv1d.h"

namespace tessera::model {

namespace {
MoeConfig parse_moe_config(const Json& section, const std::string& where) {
    ConfigReader r(section, where);
    MoeConfig d, c;
    c.experts = r.integer("experts", d.experts);
    c.topk = r.integer("topk", d.topk);
    c.ffn_dim = r.integer("ffn_dim", d.ffn_dim);
    c.latent_dim = r.integer("latent_dim", d.latent_dim);
    c.latent_norm = r.boolean("latent_norm", d.latent_norm);
    c.shared_ffn_dim = r.integer("shared_ffn_dim", d.shared_ffn_dim);
    c.shared_expert_gate = r.boolean("shared_expert_gate", d.shared_expert_gate);
    c.score = r.choice("score", d.score, {"softmax", "sigmoid"});
    c.normalize = r.boolean("normalize", d.normalize);
    c.scaling = r.number("scaling", d.scaling);
    c.groups = r.integer("groups", d.groups);
    c.topk_groups = r.integer("topk_groups", d.topk_groups);
    c.capacity_factor = r.number("capacity_factor", d.capacity_factor);
    c.overflow = r.choice("overflow", d.overflow, {"reroute", "drop"});
    c.activation = r.choice("activation", d.activation, {"swiglu", "situ"});
    TESSERA_CHECK(!(r.has("first_dense") && r.has("layers")),
                  "{}: give model.moe.first_dense or model.moe.layers, not both", where);
    c.first_dense = r.integer("first_dense", d.first_dense);
    if (r.has("layers")) {
        c.layers = r.choice_list("layers", "moe", {"moe", "dense"});
        c.first_dense = 0;  // unused with the map
    }
    c.balance = r.choice("balance", d.balance, {"sign", "quantile", "frozen"});
    c.bias_update_rate = r.number("bias_update_rate", d.bias_update_rate);
    c.seq_aux_coeff = r.number("seq_aux_coeff", d.seq_aux_coeff);
    c.global_aux_coeff = r.number("global_aux_coeff", d.global_aux_coeff);
    c.z_loss_coeff = r.number("z_loss_coeff", d.z_loss_coeff);
    r.finish();
    return c;
}

LoraConfig parse_lora_config(const Json& section, const std::string& where) {
    ConfigReader r(section, where);
    LoraConfig d, c;
    c.rank = r.integer("rank", d.rank);
    c.alpha = r.number("alpha", d.alpha);
    c.rslora = r.boolean("rslora", d.rslora);
    c.dropout = r.number("dropout", d.dropout);
    c.target_modules = r.names("target_modules");
    c.modules_to_save = r.names("modules_to_save");
    c.base_dtype = r.choice("base_dtype", d.base_dtype, {"f32", "bf16"});
    c.expert_dtype = r.choice("expert_dtype", c.base_dtype, {"f32", "bf16", "mxfp4"});
    r.finish();
    c.validate(where);
    return c;
}

MlaConfig parse_mla_config(const Json& section, const std::string& where) {
    ConfigReader r(section, where);
    MlaConfig d, c;
    c.q_lora_rank = r.integer("q_lora_rank", d.q_lora_rank);
    c.kv_lora_rank = r.integer("kv_lora_rank", d.kv_lora_rank);
    c.qk_nope_dim = r.integer("qk_nope_dim", d.qk_nope_dim);
    c.qk_rope_dim = r.integer("qk_rope_dim", d.qk_rope_dim);
    c.v_head_dim = r.integer("v_head_dim", d.v_head_dim);
    c.rope = r.boolean("rope", d.rope);
    c.softmax_scale = r.number("softmax_scale", d.softmax_scale);
    c.latent_eps = r.number("latent_eps", d.latent_eps);
    if (r.has("dsa")) {
        ConfigReader q(r.section("dsa"), where + ".dsa");
        c.dsa.topk = q.integer("topk", d.dsa.topk);
        c.dsa.heads = q.integer("heads", d.dsa.heads);
        c.dsa.head_dim = q.integer("head_dim", d.dsa.head_dim);
        c.dsa.rope_dim = q.integer("rope_dim", d.dsa.rope_dim);
        c.dsa.stage = q.choice("stage", d.dsa.stage, {"sparse", "dense_warmup"});
        c.dsa.kl_coeff = q.number("kl_coeff", d.dsa.kl_coeff);
        c.dsa.dk_slabs = q.integer("dk_slabs", d.dsa.dk_slabs);
        q.finish();
    }
    r.finish();
    return c;
}

VisionConfig parse_vision_config(const Json& section, const std::string& where, int64_t d_model) {
    ConfigReader r(section, where);
    VisionConfig d, c;
    c.layers = r.integer("layers", d.layers);
    c.width = r.integer("width", d.width);
    c.heads = r.integer("heads", d.heads);
    c.head_dim = r.integer("head_dim", d.head_dim);
    c.ffn_dim = r.integer("ffn_dim", d.ffn_dim);
    c.patch_size = r.integer("patch_size", d.patch_size);
    c.channels = r.integer("channels", d.channels);
    c.pos_height = r.integer("pos_height", d.pos_height);
    c.pos_width = r.integer("pos_width", d.pos_width);
    c.merge_h = r.integer("merge_h", d.merge_h);
    c.merge_w = r.integer("merge_w", d.merge_w);
    c.max_grid = r.integer("max_grid", d.max_grid);
    c.rope_theta = r.number("rope_theta", d.rope_theta);
    c.norm_eps = r.number("norm_eps", d.norm_eps);
    c.projector_eps = r.number("projector_eps", d.projector_eps);
    c.max_patches = r.integer("max_patches", d.max_patches);
    c.image_token = r.integer("image_token", d.image_token);
    c.text_width = d_model;
    r.finish();
    return c;
}

KdaConfig parse_kda_config(const Json& section, const std::string& where, int64_t n_heads) {
    ConfigReader r(section, where);
    KdaConfig d, c;
    c.num_heads = r.integer("num_heads", n_heads);
    c.num_v_heads = r.integer("num_v_heads", d.num_v_heads);
    c.head_dim = r.integer("head_dim", d.head_dim);
    c.head_v_dim = r.integer("head_v_dim", d.head_v_dim);
    c.conv_size = r.integer("conv_size", d.conv_size);
    c.gate_rank = r.integer("gate_rank", d.gate_rank);
    c.gate_lower_bound = r.number("gate_lower_bound", d.gate_lower_bound);
    c.full_rank_output_gate = r.boolean("full_rank_output_gate", d.full_rank_output_gate);
    c.o_norm_eps = r.number("o_norm_eps", d.o_norm_eps);
    c.chunk_size = r.integer("chunk_size", d.chunk_size);
    r.finish();
    return c;
}

ops::RopeScaling parse_rope_scaling(const Json& section, const std::string& where) {
    ConfigReader r(section, where);
    ops::RopeScaling d, c;
    c.type = r.choice("type", "yarn", {"none", "yarn"}) == "yarn" ? ops::RopeScaling::Type::yarn
                                                                  : ops::RopeScaling::Type::none;
    c.factor = r.number("factor", d.factor);
    c.original_max_position = r.integer("original_max_position", d.original_max_position);
    c.beta_fast = r.number("beta_fast", d.beta_fast);
    c.beta_slow = r.number("beta_slow", d.beta_slow);
    c.mscale = r.number("mscale", d.mscale);
    c.mscale_all_dim = r.number("mscale_all_dim", d.mscale_all_dim);
    c.attention_factor = r.number("attention_factor", d.attention_factor);
    c.truncate = r.boolean("truncate", d.truncate);
    r.finish();
    if (c.type == ops::RopeScaling::Type::none) c = d;  // nothing else applies
    return c;
}

// lo <= v <= hi, or an error naming the key and the range
void in_range(int64_t v, int64_t lo, int64_t hi, const std::string& where, const std::string& key) {
    TESSERA_CHECK(v >= lo && v <= hi, "{}: {} = {} must be in [{}, {}]", where, key, v, lo, hi);
}

void validate_moe(const MoeConfig& m, int64_t n_layers, const std::string& where) {
    TESSERA_CHECK(m.experts >= 0, "{}: model.moe.experts must be >= 0 (0 = dense)", where);
    if (m.experts == 0) return;
    in_range(m.experts, 0, kMaxExperts, where, "model.moe.experts");
    TESSERA_CHECK(m.topk >= 1 && m.topk <= m.experts, "{}: model.moe.topk {} must be in [1, experts = {}]", where,
                  m.topk, m.experts);
    TESSERA_CHECK(m.ffn_dim > 0, "{}: model.moe.ffn_dim must be positive (the routed experts' width)", where);
    TESSERA_CHECK(m.latent_dim >= 0 && m.shared_ffn_dim >= 0,
                  "{}: model.moe.latent_dim and shared_ffn_dim must be >= 0", where);
    in_range(m.ffn_dim, 1, kMaxWidth, where, "model.moe.ffn_dim");
    in_range(m.latent_dim, 0, kMaxWidth, where, "model.moe.latent_dim");
    in_range(m.shared_ffn_dim, 0, kMaxWidth, where, "model.moe.shared_ffn_dim");
    TESSERA_CHECK(!m.shared_expert_gate || m.shared_ffn_dim > 0,
                  "{}: model.moe.shared_expert_gate needs a shared expert (model.moe.shared_ffn_dim > 0)", where);
    TESSERA_CHECK(!m.latent_norm || m.latent_dim > 0, "{}: model.moe.latent_norm needs model.moe.latent_dim > 0",
                  where);
    TESSERA_CHECK(m.groups >= 1 && m.experts % m.groups == 0 && m.topk_groups >= 1 && m.topk_groups <= m.groups,
                  "{}: model.moe.groups {} must divide experts {} and topk_groups {} be in [1, groups]", where,
                  m.groups, m.experts, m.topk_groups);
    TESSERA_CHECK(m.topk <= m.topk_groups * (m.experts / m.groups),
                  "{}: model.moe.topk {} exceeds the experts of the kept groups", where, m.topk);
    TESSERA_CHECK(m.capacity_factor >= 0, "{}: model.moe.capacity_factor must be >= 0 (0 = dropless)", where);
    TESSERA_CHECK(m.first_dense >= 0, "{}: model.moe.first_dense must be >= 0", where);
    TESSERA_CHECK(m.layers.empty() || int64_t(m.layers.size()) == n_layers,
                  "{}: model.moe.layers lists {} layers for model.n_layers = {} (one \"moe\" or \"dense\" per layer)",
                  where, m.layers.size(), n_layers);
    TESSERA_CHECK(m.bias_update_rate >= 0 && m.seq_aux_coeff >= 0 && m.global_aux_coeff >= 0 && m.z_loss_coeff >= 0,
                  "{}: model.moe.bias_update_rate, seq_aux_coeff, global_aux_coeff and z_loss_coeff must be >= 0",
                  where);
    TESSERA_CHECK(m.balance != "quantile" || m.topk < m.experts,
                  "{}: model.moe.balance = quantile needs topk < experts", where);
}
// Visits every key no layer of the model reads that is set to anything but its default:
// visit(key, why, reset), where reset() puts the key back to its default.
template <class Visit>
void unread_keys(ModelConfig& c, Visit&& visit) {
    const ModelConfig d;
    const bool gqa = c.has_layer_type("gqa"), mla = c.has_layer_type("mla"), dsa = c.has_layer_type("dsa");
    const bool kda = c.has_layer_type("kda"), gdn = c.has_layer_type("gdn");
    bool any_dense = false;
    for (int64_t i = 0; i < c.n_layers; ++i) any_dense |= !c.moe.is_moe_layer(i);
    auto unread = [&](bool set, const std::string& key, const std::string& why, auto reset) {
        if (set) visit(key, why, std::function<void()>(reset));
    };
    const std::string no_gqa = "no layer is \"gqa\" (model.attention)";
    unread(c.qk_norm != d.qk_norm && !gqa, "qk_norm", no_gqa, [&] { c.qk_norm = d.qk_norm; });
    unread(c.rope_dim != d.rope_dim && !gqa, "rope_dim", no_gqa, [&] { c.rope_dim = d.rope_dim; });
    unread(c.head_dim != d.head_dim && !gqa, "head_dim", no_gqa, [&] { c.head_dim = d.head_dim; });
    unread(c.n_kv_heads != c.n_heads && !gqa, "n_kv_heads", no_gqa, [&] { c.n_kv_heads = c.n_heads; });
    unread(c.output_gate != d.output_gate && !gqa && !mla && !dsa, "output_gate",
           "no layer is \"gqa\", \"mla\" or \"dsa\" (model.attention)", [&] { c.output_gate = d.output_gate; });
    // n_heads: the gqa / mla / dsa heads, else only the default of model.kda.num_heads
    unread(c.n_heads != d.n_heads && !gqa && !mla && !dsa && c.kda.num_heads != c.n_heads, "n_heads",
           "no layer is \"gqa\", \"mla\" or \"dsa\" and model.kda.num_heads is set",
           [&] { c.n_heads = c.n_kv_heads = d.n_heads; });
    const bool rotary = gqa || ((mla || dsa) && c.mla.rope) || (dsa && c.mla.dsa.rope_dim > 0);
    unread(c.rope_theta != d.rope_theta && !rotary, "rope_theta",
           "no layer rotates (no gqa layer, model.mla.rope "
           "false or no mla/dsa layer, no dsa indexer rope)",
           [&] { c.rope_theta = d.rope_theta; });
    const std::string all_moe = "every layer is MoE (model.moe.first_dense = 0)";
    unread(c.ffn_dim != d.ffn_dim && !any_dense, "ffn_dim", all_moe, [&] { c.ffn_dim = d.ffn_dim; });
    unread(c.mlp_activation != d.mlp_activation && !any_dense, "mlp_activation", all_moe,
           [&] { c.mlp_activation = d.mlp_activation; });
    // the moe section: everything but experts is read only by MoE layers; two keys only in some modes
    const Json moe = to_json(c.moe), moe_default = to_json(MoeConfig{});
    for (auto it = moe.begin(); it != moe.end(); ++it) {
        // "layers" is written only when set (the default writes first_dense): find, not operator[] (undefined
        // behaviour on a const object without the key)
        const auto def = moe_default.find(it.key());
        if (it.key() == "experts" || (def != moe_default.end() && it.value() == *def)) continue;
        unread(c.moe.experts == 0, "moe." + it.key(), "model.moe.experts = 0 (no MoE layer)",
               [&] { c.moe = MoeConfig{}; });
        unread(it.key() == "overflow" && c.moe.capacity_factor == 0, "moe.overflow",
               "the experts are dropless (model.moe.capacity_factor = 0)", [&] { c.moe.overflow = d.moe.overflow; });
        unread(it.key() == "bias_update_rate" && c.moe.balance != "sign", "moe.bias_update_rate",
               "model.moe.balance is not \"sign\"", [&] { c.moe.bias_update_rate = d.moe.bias_update_rate; });
    }
    const Json indexer = to_json(c.mla)["dsa"], indexer_default = to_json(MlaConfig{})["dsa"];
    for (auto it = indexer.begin(); it != indexer.end(); ++it) {
        unread(it.value() != indexer_default.at(it.key()) && !dsa, "mla.dsa." + it.key(),
               "no layer is \"dsa\" (model.attention)", [&] { c.mla.dsa = DsaConfig{}; });
    }
    // gdn layers always have a scalar gate (one decay per value head) and a full-rank output gate
    const KdaConfig kd;
    unread(c.kda.gate_rank != kd.gate_rank && gdn && !kda, "kda.gate_rank",
           "\"gdn\" layers have a scalar gate and no layer is \"kda\"", [&] { c.kda.gate_rank = kd.gate_rank; });
    unread(c.kda.full_rank_output_gate != kd.full_rank_output_gate && gdn && !kda, "kda.full_rank_output_gate",
           "\"gdn\" layers always have a full-rank output gate and no layer is \"kda\"",
           [&] { c.kda.full_rank_output_gate = kd.full_rank_output_gate; });
}

// A key no layer of the model reads, set to anything but its default, is an error naming it: a setting that
// silently changes nothing is a misunderstanding (model.mla without an mla layer was the first such rule).
// Defaults stay accepted, so configs written by to_json and older checkpoints still load.
void check_unread_keys(const ModelConfig& c, const std::string& where) {
    ModelConfig copy = c;
    unread_keys(copy, [&](const std::string& key, const std::string& why, const std::function<void()>&) {
        TESSERA_FAIL("{}: model.{} is set but {}; remove it", where, key, why);
    });
    if (c.moe.experts > 0) {
        bool any_moe = false;
        for (int64_t i = 0; i < c.n_layers; ++i) any_moe |= c.moe.is_moe_layer(i);
        TESSERA_CHECK(any_moe, "{}: model.moe.first_dense = {} leaves no MoE layer in {} layers", where,
                      c.moe.first_dense, c.n_layers);
    }
}
}  // namespace

void clear_unread_keys(ModelConfig& c) {
    // a reset can make another key unread (no MoE layer left) or read: repeat until nothing changes
    for (bool changed = true; changed;) {
        changed = false;
        unread_keys(c, [&](const std::string&, const std::string&, const std::function<void()>& reset) {
            reset();
            changed = true;
        });
    }
}

ModelConfig parse_model_config(const Json& section, const std::string& where) {
    ConfigReader r(section, where);
    ModelConfig d, c;
    c.vocab_size = r.integer("vocab_size", d.vocab_size);
    c.d_model = r.integer("d_model", d.d_model);
    c.n_layers = r.integer("n_layers", d.n_layers);
    c.n_heads = r.integer("n_heads", d.n_heads);
    c.n_kv_heads = r.integer("n_kv_heads", c.n_heads);
    c.head_dim = r.integer("head_dim", d.head_dim);
    c.ffn_dim = r.integer("ffn_dim", d.ffn_dim);
    c.mlp_activation = r.choice("mlp_activation", d.mlp_activation, {"swiglu", "situ"});
    c.norm_eps = r.number("norm_eps", d.norm_eps);
    c.rope_theta = r.number("rope_theta", d.rope_theta);
    if (r.has("rope_scaling")) c.rope_scaling = parse_rope_scaling(r.section("rope_scaling"), where + ".rope_scaling");
    c.tie_embeddings = r.boolean("tie_embeddings", d.tie_embeddings);
    c.init_std = r.number("init_std", d.init_std);
    c.attention = r.choice_list("attention", "gqa", {"gqa", "mla", "dsa", "kda", "gdn"});
    c.output_gate = r.choice("output_gate", d.output_gate, {"none", "headwise", "elementwise"});
    c.qk_norm = r.boolean("qk_norm", d.qk_norm);
    c.rope_dim = r.integer("rope_dim", d.rope_dim);
    c.attn_res_block_size = r.integer("attn_res_block_size", d.attn_res_block_size);
    if (r.has("mla")) {
        TESSERA_CHECK(c.has_layer_type("mla") || c.has_layer_type("dsa"),
                      "{}: model.mla is set but no layer is \"mla\" or \"dsa\" (model.attention)", where);
        c.mla = parse_mla_config(r.section("mla"), where + ".mla");
    }
    if (r.has("kda")) {
        TESSERA_CHECK(c.has_layer_type("kda") || c.has_layer_type("gdn"),
                      "{}: model.kda is set but no layer is \"kda\" or \"gdn\" (model.attention)", where);
        c.kda = parse_kda_config(r.section("kda"), where + ".kda", c.n_heads);
    } else {
        c.kda.num_heads = c.n_heads;
    }
    if (r.has("moe")) c.moe = parse_moe_config(r.section("moe"), where + ".moe");
    if (r.has("lora")) c.lora = parse_lora_config(r.section("lora"), where + ".lora");
    if (r.has("vision")) c.vision = parse_vision_config(r.section("vision"), where + ".vision", c.d_model);
    r.finish();
    c.validate(where);
    check_unread_keys(c, where);
    return c;
}

void ModelConfig::validate(const std::string& where) const {
    auto positive = [&](int64_t v, const char* key) {
        TESSERA_CHECK(v > 0, "{}: model.{} must be positive, not {}", where, key, v);
    };
    positive(vocab_size, "vocab_size");
    positive(d_model, "d_model");
    positive(n_layers, "n_layers");
    positive(n_heads, "n_heads");
    positive(n_kv_heads, "n_kv_heads");
    positive(ffn_dim, "ffn_dim");
    TESSERA_CHECK(head_dim >= 0, "{}: model.head_dim must be >= 0 (0 = d_model / n_heads)", where);
    in_range(vocab_size, 1, kMaxVocab, where, "model.vocab_size");
    in_range(d_model, 1, kMaxWidth, where, "model.d_model");
    in_range(n_layers, 1, kMaxCount, where, "model.n_layers");
    in_range(n_heads, 1, kMaxCount, where, "model.n_heads");
    in_range(n_kv_heads, 1, kMaxCount, where, "model.n_kv_heads");
    in_range(ffn_dim, 1, kMaxWidth, where, "model.ffn_dim");
    in_range(head_dim, 0, kMaxWidth, where, "model.head_dim");
    if (has_layer_type("gqa")) {  // the head sizes of grouped-query attention layers
        TESSERA_CHECK(head_dim > 0 || d_model % n_heads == 0,
                      "{}: model.d_model {} is not divisible by model.n_heads {}; set model.head_dim", where, d_model,
                      n_heads);
        TESSERA_CHECK(n_heads % n_kv_heads == 0, "{}: model.n_heads {} must be a multiple of model.n_kv_heads {}",
                      where, n_heads, n_kv_heads);
        TESSERA_CHECK(head_dim_or_default() % 2 == 0 && head_dim_or_default() <= 1024,
                      "{}: the head dim {} must be even and at most 1024 (rotary pairs)", where, head_dim_or_default());
        TESSERA_CHECK(rope_dim >= 0 && rope_dim <= head_dim_or_default() && rope_dim % 2 == 0,
                      "{}: model.rope_dim {} must be even and at most the head dim {} (0 = all)", where, rope_dim,
                      head_dim_or_default());
    }
    // NOTES: fused q/k/v and gate/up weights are views over adjacent parameters, which needs every
    // weight to fill whole 64-byte lines: d_model a multiple of 16 makes that so.
    TESSERA_CHECK(d_model % 16 == 0, "{}: model.d_model {} must be a multiple of 16", where, d_model);
    TESSERA_CHECK(norm_eps > 0, "{}: model.norm_eps must be positive", where);
    TESSERA_CHECK(rope_theta > 1, "{}: model.rope_theta must be > 1", where);
    rope_scaling.validate(where + ": model");
    TESSERA_CHECK(!rope_scaling.enabled() || has_rotary_dims(),
                  "{}: model.rope_scaling is set but no layer rotates (a gqa layer, or mla/dsa with model.mla.rope)",
                  where);
    TESSERA_CHECK(init_std > 0, "{}: model.init_std must be positive", where);
    TESSERA_CHECK(attn_res_block_size >= 0, "{}: model.attn_res_block_size must be >= 0 (0 = plain residuals), not {}",
                  where, attn_res_block_size);
    in_range(attn_res_block_size, 0, kMaxCount, where, "model.attn_res_block_size");
    validate_moe(moe, n_layers, where);
    TESSERA_CHECK(attention.size() == 1 || int64_t(attention.size()) == n_layers,
                  "{}: model.attention lists {} layer types for model.n_layers = {} (give one type or one per layer)",
                  where, attention.size(), n_layers);
    if (has_layer_type("mla")) mla_layer(false).validate(where + ": model.mla");
    if (has_layer_type("dsa")) {
        TESSERA_CHECK(mla.dsa.topk > 0, "{}: \"dsa\" layers need model.mla.dsa.topk > 0", where);
        mla_layer(true).validate(where + ": model.mla");
    }
    if (has_layer_type("kda")) kda_layer(false).validate(where + ": model.kda");
    if (has_layer_type("gdn")) kda_layer(true).validate(where + ": model.kda");
    if (vision.enabled()) {
        vision.validate(where + ": model.vision");
        TESSERA_CHECK(vision.text_width == d_model, "{}: model.vision projects to {} columns, not model.d_model {}",
                      where, vision.text_width, d_model);
        in_range(vision.image_token, 0, vocab_size - 1, where, "model.vision.image_token");
    }
}

bool ModelConfig::has_layer_type(const std::string& type) const {
    return std::find(attention.begin(), attention.end(), type) != attention.end();
}

bool ModelConfig::has_rotary_dims() const {
    const bool latent = (has_layer_type("mla") || has_layer_type("dsa")) && mla.rope && mla.qk_rope_dim > 0;
    return has_layer_type("gqa") || latent || (has_layer_type("dsa") && mla.dsa.rope_dim > 0);
}

KdaConfig ModelConfig::kda_layer(bool gdn) const {
    KdaConfig k = kda;
    k.d_model = d_model;
    k.norm_eps = norm_eps;
    k.init_std = init_std;
    k.n_layers = n_layers;
    if (gdn) {  // Gated DeltaNet (Qwen3-Next): one decay per head, full-rank SiLU output gate
        k.scalar_gate = true;
        k.full_rank_output_gate = true;
        k.output_gate_activation = ops::GateActivation::silu;
    }
    return k;
}

MlaConfig ModelConfig::mla_layer(bool dsa) const {
    MlaConfig m = mla;
    if (!dsa) m.dsa.topk = 0;
    m.d_model = d_model;
    m.num_heads = n_heads;
    m.rope_theta = rope_theta;
    m.rope_scaling = rope_scaling;
    m.output_gate = output_gate;
    m.norm_eps = norm_eps;
    m.init_std = init_std;
    m.n_layers = n_layers;
    return m;
}

void KdaConfig::validate(const std::string& where) const {
    auto positive = [&](int64_t v, const char* key) {
        TESSERA_CHECK(v > 0, "{}: {} must be positive, not {}", where, key, v);
    };
    positive(d_model, "d_model");
    positive(num_heads, "num_heads");
    positive(head_dim, "head_dim");
    positive(conv_size, "conv_size");
    // 0 means "the default" for these three; a negative value silently meant the same
    TESSERA_CHECK(num_v_heads >= 0, "{}: num_v_heads must be >= 0 (0 = num_heads), not {}", where, num_v_heads);
    TESSERA_CHECK(head_v_dim >= 0, "{}: head_v_dim must be >= 0 (0 = head_dim), not {}", where, head_v_dim);
    TESSERA_CHECK(gate_rank >= 0, "{}: gate_rank must be >= 0 (0 = the value head dim), not {}", where, gate_rank);
    in_range(num_heads, 1, kMaxCount, where, "num_heads");
    in_range(num_v_heads, 0, kMaxCount, where, "num_v_heads");
    in_range(head_dim, 1, kMaxWidth, where, "head_dim");
    in_range(head_v_dim, 0, kMaxWidth, where, "head_v_dim");
    in_range(gate_rank, 0, kMaxWidth, where, "gate_rank");
    in_range(conv_size, 1, ops::kCausalConvMaxWidth, where, "conv_size");
    TESSERA_CHECK(o_norm_eps > 0, "{}: o_norm_eps must be positive", where);
    TESSERA_CHECK(hv() % num_heads == 0, "{}: num_v_heads {} must be a multiple of num_heads {}", where, hv(),
                  num_heads);
    TESSERA_CHECK(gate_lower_bound <= 0, "{}: gate_lower_bound must be <= 0 (0 = softplus form)", where);
    TESSERA_CHECK(chunk_size == 32 || chunk_size == 64, "{}: chunk_size must be 32 or 64", where);
    TESSERA_CHECK(d_model % 16 == 0 && (num_heads * head_dim) % 16 == 0 && (hv() * v_dim()) % 16 == 0,
                  "{}: d_model and the q/k and value widths must be multiples of 16", where);
}

void MlaConfig::validate(const std::string& where) const {
    auto positive = [&](int64_t v, const char* key) {
        TESSERA_CHECK(v > 0, "{}: {} must be positive, not {}", where, key, v);
    };
    positive(d_model, "d_model");
    positive(num_heads, "num_heads");
    positive(kv_lora_rank, "kv_lora_rank");
    positive(qk_nope_dim, "qk_nope_dim");
    positive(v_head_dim, "v_head_dim");
    TESSERA_CHECK(q_lora_rank >= 0 && qk_rope_dim >= 0, "{}: q_lora_rank and qk_rope_dim must be >= 0", where);
    in_range(num_heads, 1, kMaxCount, where, "num_heads");
    for (const auto& [v, key] : {std::pair{q_lora_rank, "q_lora_rank"}, std::pair{kv_lora_rank, "kv_lora_rank"},
                                 std::pair{qk_nope_dim, "qk_nope_dim"}, std::pair{qk_rope_dim, "qk_rope_dim"},
                                 std::pair{v_head_dim, "v_head_dim"}}) {
        in_range(v, 0, kMaxWidth, where, key);
    }
    TESSERA_CHECK(softmax_scale >= 0, "{}: softmax_scale must be >= 0 (0 = (d_n + d_r)^-1/2), not {}", where,
                  softmax_scale);
    TESSERA_CHECK(latent_eps > 0, "{}: latent_eps must be positive", where);
    TESSERA_CHECK(!rope || qk_rope_dim % 2 == 0, "{}: qk_rope_dim {} must be even with rope", where, qk_rope_dim);
    TESSERA_CHECK(output_gate == "none" || output_gate == "headwise" || output_gate == "elementwise",
                  "{}: output_gate must be \"none\", \"headwise\" or \"elementwise\", not \"{}\"", where, output_gate);
    TESSERA_CHECK(dsa.topk >= 0, "{}: dsa.topk must be >= 0 (0 = dense MLA)", where);
    if (!dsa.enabled()) return;
    positive(dsa.heads, "dsa.heads");
    positive(dsa.head_dim, "dsa.head_dim");
    positive(dsa.dk_slabs, "dsa.dk_slabs");
    in_range(dsa.topk, 1, kMaxSeqLen, where, "dsa.topk");
    in_range(dsa.heads, 1, kMaxCount, where, "dsa.heads");
    in_range(dsa.head_dim, 1, kMaxWidth, where, "dsa.head_dim");
    in_range(dsa.dk_slabs, 1, 1024, where, "dsa.dk_slabs");
    TESSERA_CHECK(dsa.rope_dim >= 0 && dsa.rope_dim <= dsa.head_dim && dsa.rope_dim % 2 == 0,
                  "{}: dsa.rope_dim {} must be even and at most dsa.head_dim {}", where, dsa.rope_dim, dsa.head_dim);
    TESSERA_CHECK(dsa.stage == "sparse" || dsa.stage == "dense_warmup",
                  "{}: dsa.stage must be \"sparse\" or \"dense_warmup\", not \"{}\"", where, dsa.stage);
    TESSERA_CHECK(dsa.kl_coeff >= 0, "{}: dsa.kl_coeff must be >= 0", where);
}

Json to_json(const ModelConfig& c) {
    Json j{{"vocab_size", c.vocab_size},
           {"d_model", c.d_model},
           {"n_layers", c.n_layers},
           {"n_heads", c.n_heads},
           {"n_kv_heads", c.n_kv_heads},
           {"head_dim", c.head_dim},
           {"ffn_dim", c.ffn_dim},
           {"mlp_activation", c.mlp_activation},
           {"norm_eps", c.norm_eps},
           {"rope_theta", c.rope_theta},
           {"tie_embeddings", c.tie_embeddings},
           {"init_std", c.init_std},
           {"attention", c.attention.size() == 1 ? Json(c.attention[0]) : Json(c.attention)},
           {"output_gate", c.output_gate},
           {"qk_norm", c.qk_norm},
           {"rope_dim", c.rope_dim},
           {"attn_res_block_size", c.attn_res_block_size},
           {"moe", to_json(c.moe)}};
    if (c.lora.enabled()) j["lora"] = to_json(c.lora);
    if (c.rope_scaling.enabled()) j["rope_scaling"] = to_json(c.rope_scaling);
    if (c.has_layer_type("mla") || c.has_layer_type("dsa")) {
        j["mla"] = to_json(c.mla);
        if (!c.has_layer_type("dsa")) j["mla"].erase("dsa");  // the indexer settings only matter to dsa layers
    }
    if (c.has_layer_type("kda") || c.has_layer_type("gdn")) j["kda"] = to_json(c.kda);
    if (c.vision.enabled()) j["vision"] = to_json(c.vision);
    return j;
}

int64_t VisionConfig::num_params() const {
    if (!enabled()) return 0;
    const int64_t block = 2 * width + 3 * qkv_width() * width + width * qkv_width() + 2 * ffn_dim * width;
    return width * patch_dim() + pos_height * pos_width * width + layers * block + width  // tower
           + merged_width() * merged_width() + text_width * merged_width() + text_width;  // projector
}

void VisionConfig::validate(const std::string& where) const {
    if (!enabled()) return;
    auto within = [&](int64_t v, int64_t hi, const char* key) {
        TESSERA_CHECK(v > 0 && v <= hi, "{}: vision {} = {} must be in [1, {}]", where, key, v, hi);
    };
    within(layers, kMaxCount, "layers");
    within(heads, kMaxCount, "heads");
    within(width, kMaxWidth, "width");
    within(head_dim, kMaxWidth, "head_dim");
    within(ffn_dim, kMaxWidth, "ffn_dim");
    within(text_width, kMaxWidth, "text_width");
    within(patch_size, 64, "patch_size");
    within(channels, 16, "channels");
    within(pos_height, 1024, "pos_height");
    within(pos_width, 1024, "pos_width");
    within(merge_h, 16, "merge_h");
    within(merge_w, 16, "merge_w");
    within(max_grid, 65536, "max_grid");
    within(max_patches, kMaxSeqLen, "max_patches");
    TESSERA_CHECK(head_dim % 4 == 0, "{}: vision head_dim {} must be a multiple of 4 (2-D RoPE)", where, head_dim);
    TESSERA_CHECK(norm_eps > 0 && projector_eps > 0 && rope_theta > 1,
                  "{}: vision norm_eps and projector_eps must be positive and rope_theta > 1", where);
}

Json to_json(const VisionConfig& v) {
    return Json{{"layers", v.layers},
                {"width", v.width},
                {"heads", v.heads},
                {"head_dim", v.head_dim},
                {"ffn_dim", v.ffn_dim},
                {"patch_size", v.patch_size},
                {"channels", v.channels},
                {"pos_height", v.pos_height},
                {"pos_width", v.pos_width},
                {"merge_h", v.merge_h},
                {"merge_w", v.merge_w},
                {"max_grid", v.max_grid},
                {"rope_theta", v.rope_theta},
                {"norm_eps", v.norm_eps},
                {"projector_eps", v.projector_eps},
                {"max_patches", v.max_patches},
                {"image_token", v.image_token}};
}

Json to_json(const LoraConfig& l) {
    return Json{{"rank", l.rank},
                {"alpha", l.alpha},
                {"rslora", l.rslora},
                {"dropout", l.dropout},
                {"target_modules", l.target_modules},
                {"modules_to_save", l.modules_to_save},
                {"base_dtype", l.base_dtype},
                {"expert_dtype", l.expert_dtype}};
}

bool LoraConfig::names(const std::vector<std::string>& list, const std::string& path) {
    for (const std::string& n : list) {
        if (path == n || (path.size() > n.size() && path.ends_with(n) && path[path.size() - n.size() - 1] == '.'))
            return true;
    }
    return false;
}

void LoraConfig::validate(const std::string& where) const {
    TESSERA_CHECK(rank >= 0 && rank <= 4096, "{}: lora.rank must be in [0, 4096] (0: no LoRA), not {}", where, rank);
    if (!enabled()) {
        TESSERA_CHECK(target_modules.empty() && modules_to_save.empty(),
                      "{}: lora.target_modules / modules_to_save are set but lora.rank is 0 (no LoRA); set a rank",
                      where);
        return;
    }
    TESSERA_CHECK(std::isfinite(alpha) && alpha > 0, "{}: lora.alpha must be positive, not {}", where, alpha);
    TESSERA_CHECK(dropout >= 0 && dropout < 1, "{}: lora.dropout must be in [0, 1), not {}", where, dropout);
    TESSERA_CHECK(!target_modules.empty() || !modules_to_save.empty(),
                  "{}: lora.target_modules and lora.modules_to_save are both empty: nothing would train", where);
}

Json to_json(const ops::RopeScaling& s) {
    return Json{{"type", s.enabled() ? "yarn" : "none"},
                {"factor", s.factor},
                {"original_max_position", s.original_max_position},
                {"beta_fast", s.beta_fast},
                {"beta_slow", s.beta_slow},
                {"mscale", s.mscale},
                {"mscale_all_dim", s.mscale_all_dim},
                {"attention_factor", s.attention_factor},
                {"truncate", s.truncate}};
}

Json to_json(const KdaConfig& k) {
    return Json{{"num_heads", k.num_heads},
                {"num_v_heads", k.num_v_heads},
                {"head_dim", k.head_dim},
                {"head_v_dim", k.head_v_dim},
                {"conv_size", k.conv_size},
                {"gate_rank", k.gate_rank},
                {"gate_lower_bound", k.gate_lower_bound},
                {"full_rank_output_gate", k.full_rank_output_gate},
                {"o_norm_eps", k.o_norm_eps},
                {"chunk_size", k.chunk_size}};
}

Json to_json(const MlaConfig& m) {
    return Json{{"q_lora_rank", m.q_lora_rank},
                {"kv_lora_rank", m.kv_lora_rank},
                {"qk_nope_dim", m.qk_nope_dim},
                {"qk_rope_dim", m.qk_rope_dim},
                {"v_head_dim", m.v_head_dim},
                {"rope", m.rope},
                {"softmax_scale", m.softmax_scale},
                {"latent_eps", m.latent_eps},
                {"dsa",
                 {{"topk", m.dsa.topk},
                  {"heads", m.dsa.heads},
                  {"head_dim", m.dsa.head_dim},
                  {"rope_dim", m.dsa.rope_dim},
                  {"stage", m.dsa.stage},
                  {"kl_coeff", m.dsa.kl_coeff},
                  {"dk_slabs", m.dsa.dk_slabs}}}};
}

bool MoeConfig::every_layer_moe(int64_t n_layers) const {
    for (int64_t i = 0; i < n_layers; ++i) {
        if (!is_moe_layer(i)) return false;
    }
    return experts > 0;
}

Json to_json(const MoeConfig& m) {
    Json j{{"experts", m.experts},
           {"topk", m.topk},
           {"ffn_dim", m.ffn_dim},
           {"latent_dim", m.latent_dim},
           {"latent_norm", m.latent_norm},
           {"shared_ffn_dim", m.shared_ffn_dim},
           {"shared_expert_gate", m.shared_expert_gate},
           {"score", m.score},
           {"normalize", m.normalize},
           {"scaling", m.scaling},
           {"groups", m.groups},
           {"topk_groups", m.topk_groups},
           {"capacity_factor", m.capacity_factor},
           {"overflow", m.overflow},
           {"activation", m.activation},
           {"balance", m.balance},
           {"bias_update_rate", m.bias_update_rate},
           {"seq_aux_coeff", m.seq_aux_coeff},
           {"global_aux_coeff", m.global_aux_coeff},
           {"z_loss_coeff", m.z_loss_coeff}};
    if (m.layers.empty()) {
        j["first_dense"] = m.first_dense;
    } else {
        j["layers"] = m.layers;
    }
    return j;
}

}  // namespace tessera::model
