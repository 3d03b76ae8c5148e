// Model config parsing, validation and serialisation.
#include "model/config.h"

#include "core/check.h"

namespace tessera::model {

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
    c.norm_eps = r.number("norm_eps", d.norm_eps);
    c.rope_theta = r.number("rope_theta", d.rope_theta);
    c.tie_embeddings = r.boolean("tie_embeddings", d.tie_embeddings);
    c.init_std = r.number("init_std", d.init_std);
    r.finish();
    c.validate(where);
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
    TESSERA_CHECK(head_dim > 0 || d_model % n_heads == 0,
                  "{}: model.d_model {} is not divisible by model.n_heads {}; set model.head_dim", where, d_model,
                  n_heads);
    TESSERA_CHECK(n_heads % n_kv_heads == 0, "{}: model.n_heads {} must be a multiple of model.n_kv_heads {}", where,
                  n_heads, n_kv_heads);
    TESSERA_CHECK(head_dim_or_default() % 2 == 0 && head_dim_or_default() <= 1024,
                  "{}: the head dim {} must be even and at most 1024 (rotary pairs)", where, head_dim_or_default());
    // NOTES: fused q/k/v and gate/up weights are views over adjacent parameters, which needs every
    // weight to fill whole 64-byte lines: d_model a multiple of 16 makes that so.
    TESSERA_CHECK(d_model % 16 == 0, "{}: model.d_model {} must be a multiple of 16", where, d_model);
    TESSERA_CHECK(norm_eps > 0, "{}: model.norm_eps must be positive", where);
    TESSERA_CHECK(rope_theta > 1, "{}: model.rope_theta must be > 1", where);
    TESSERA_CHECK(init_std > 0, "{}: model.init_std must be positive", where);
}

Json to_json(const ModelConfig& c) {
    return Json{{"vocab_size", c.vocab_size}, {"d_model", c.d_model},
                {"n_layers", c.n_layers},     {"n_heads", c.n_heads},
                {"n_kv_heads", c.n_kv_heads}, {"head_dim", c.head_dim},
                {"ffn_dim", c.ffn_dim},       {"norm_eps", c.norm_eps},
                {"rope_theta", c.rope_theta}, {"tie_embeddings", c.tie_embeddings},
                {"init_std", c.init_std}};
}

}  // namespace tessera::model
