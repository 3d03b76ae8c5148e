// The model config sections this issue added: model.rope_scaling (YaRN) and model.moe.layers (dense MLP
// layers between MoE layers): parsed, validated with the key in the message, and serialised back.
#include <gtest/gtest.h>

#include "model/config.h"
#include "util/test_util.h"

namespace tessera {
namespace {

model::ModelConfig parse(const std::string& text) { return model::parse_model_config(Json::parse(text), "m.json"); }

TEST(ModelConfig, RopeScalingParsesValidatesAndRoundTrips) {
    const model::ModelConfig c = parse(R"({"n_layers": 2, "rope_scaling": {"factor": 4, "original_max_position": 64,
        "beta_fast": 16, "mscale": 0.5, "mscale_all_dim": 0.25, "truncate": false}})");
    EXPECT_TRUE(c.rope_scaling.enabled());
    EXPECT_EQ(c.rope_scaling.factor, 4.0);
    EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
    EXPECT_FALSE(c.rope_scaling.truncate);
    EXPECT_EQ(model::to_json(parse(model::to_json(c).dump())), model::to_json(c));
    EXPECT_FALSE(model::to_json(parse(R"({"n_layers": 2})")).contains("rope_scaling"));
    EXPECT_FALSE(parse(R"({"rope_scaling": {"type": "none"}})").rope_scaling.enabled());
    test::expect_error([] { parse(R"({"rope_scaling": {"factor": 4}})"); },
                       "rope_scaling.original_max_position must be positive");
    test::expect_error([] { parse(R"({"rope_scaling": {"factor": -1, "original_max_position": 8}})"); },
                       "rope_scaling.factor must be positive");
    test::expect_error([] { parse(R"({"rope_scaling": {"factr": 4}})"); }, "rope_scaling: unknown key \"factr\"");
    test::expect_error([] { parse(R"({"rope_scaling": {"type": "ntk"}})"); },
                       "rope_scaling: type = \"ntk\" must be one of: none, yarn");
    test::expect_error(
        [] { parse(R"({"attention": "kda", "rope_scaling": {"factor": 2, "original_max_position": 8}})"); },
        "model.rope_scaling is set but no layer rotates");
    // MLA: YaRN's mscale_all_dim scales the default softmax scale by g(s, mscale_all_dim)² (DeepSeek-V3)
    const model::ModelConfig mla = parse(R"({"attention": "mla", "rope_scaling": {"factor": 40,
        "original_max_position": 4096, "mscale": 1, "mscale_all_dim": 1}, "mla": {"qk_nope_dim": 128, "qk_rope_dim": 64}})");
    EXPECT_NEAR(mla.mla_layer(false).scale(), 0.1352, 5e-5);
}

TEST(ModelConfig, MoeLayerMapPicksTheMoeLayers) {
    const std::string moe = R"("experts": 4, "ffn_dim": 16)";
    const model::ModelConfig c =
        parse(R"({"n_layers": 3, "moe": {)" + moe + R"(, "layers": ["moe", "dense", "moe"]}})");
    EXPECT_TRUE(c.moe.is_moe_layer(0));
    EXPECT_FALSE(c.moe.is_moe_layer(1));
    EXPECT_TRUE(c.moe.is_moe_layer(2));
    EXPECT_FALSE(c.moe.every_layer_moe(3));
    EXPECT_EQ(model::to_json(parse(model::to_json(c).dump())), model::to_json(c));
    EXPECT_FALSE(model::to_json(c)["moe"].contains("first_dense"));
    EXPECT_TRUE(parse(R"({"n_layers": 2, "moe": {)" + moe + R"(, "first_dense": 0}})").moe.every_layer_moe(2));
    test::expect_error([&] { parse(R"({"n_layers": 3, "moe": {)" + moe + R"(, "layers": ["moe", "dense"]}})"); },
                       "model.moe.layers lists 2 layers for model.n_layers = 3");
    test::expect_error([&] { parse(R"({"n_layers": 1, "moe": {)" + moe + R"(, "layers": ["sparse"]}})"); },
                       "layers[0] = \"sparse\" must be one of: dense, moe");
    test::expect_error(
        [&] { parse(R"({"n_layers": 1, "moe": {)" + moe + R"(, "layers": ["moe"], "first_dense": 0}})"); },
        "give model.moe.first_dense or model.moe.layers, not both");
}

}  // namespace
}  // namespace tessera
