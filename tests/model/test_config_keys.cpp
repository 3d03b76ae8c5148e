// Config keys: a key no layer reads is an error naming it unless it holds its default (issue 11 §6: qk_norm,
// rope_dim, head_dim and n_kv_heads without a gqa layer, the moe section without experts, ... were accepted and
// ignored); negative values no longer stand for "the default"; sizes have upper bounds.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/config_reader.h"
#include "model/config.h"
#include "train/config.h"
#include "util/test_util.h"

namespace tessera {
namespace {

// tiny.json's model with overrides applied
model::ModelConfig model_with(const std::vector<std::string>& sets) {
    Json doc = Json::parse(R"({"vocab_size": 258, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64})");
    Json run = {{"model", doc}};
    for (const auto& s : sets) apply_override(run, "model." + s);
    return model::parse_model_config(run["model"], "c.json: model");
}

TEST(ConfigKeys, KeysNoLayerReadsAreErrors) {
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"attention=kda", "qk_norm=true"}, "model.qk_norm is set but no layer is \"gqa\""},
        {{"attention=kda", "rope_dim=8"}, "model.rope_dim is set but no layer is \"gqa\""},
        {{"attention=kda", "head_dim=16"}, "model.head_dim is set but no layer is \"gqa\""},
        {{"attention=kda", "n_kv_heads=1"}, "model.n_kv_heads is set but no layer is \"gqa\""},
        {{"attention=kda", "output_gate=headwise"}, "model.output_gate is set but no layer is \"gqa\", \"mla\""},
        {{"attention=kda", "rope_theta=5e5"}, "model.rope_theta is set but no layer rotates"},
        {{"attention=mla", "mla.rope=false", "rope_theta=5e5"}, "model.rope_theta is set but no layer rotates"},
        {{"attention=kda", "n_heads=8", "kda.num_heads=2"}, "model.n_heads is set"},
        {{"moe.topk=4"}, "model.moe.topk is set but model.moe.experts = 0"},
        {{"moe.experts=0", "moe.balance=quantile"}, "model.moe.balance is set but model.moe.experts = 0"},
        {{"moe.experts=4", "moe.ffn_dim=8", "moe.first_dense=2"}, "model.moe.first_dense = 2 leaves no MoE layer"},
        {{"moe.experts=4", "moe.ffn_dim=8", "moe.overflow=drop"}, "model.moe.overflow is set but the experts are"},
        {{"moe.experts=4", "moe.ffn_dim=8", "moe.balance=frozen", "moe.bias_update_rate=0.1"},
         "model.moe.bias_update_rate is set but model.moe.balance is not \"sign\""},
        {{"moe.experts=4", "moe.ffn_dim=8", "moe.first_dense=0", "ffn_dim=96"},
         "model.ffn_dim is set but every layer is MoE"},
        {{"moe.experts=4", "moe.ffn_dim=8", "moe.first_dense=0", "ffn_dim=null", "mlp_activation=situ"},
         "model.mlp_activation is set but every layer is MoE"},
        {{"attention=mla", "mla.dsa.topk=4"}, "model.mla.dsa.topk is set but no layer is \"dsa\""},
        {{"attention=gdn", "kda.head_dim=16", "kda.gate_rank=8"}, "model.kda.gate_rank is set but \"gdn\" layers"},
        {{"attention=gdn", "kda.head_dim=16", "kda.full_rank_output_gate=true"}, "model.kda.full_rank_output_gate"},
    };
    for (const auto& [sets, needle] : cases) {
        SCOPED_TRACE(sets.back());
        test::expect_error([&] { model_with(sets); }, needle);
    }
    // their defaults are fine (configs written by to_json carry every key), and so is a key some layer reads
    EXPECT_NO_THROW(model_with({"attention=kda", "qk_norm=false", "n_kv_heads=2", "head_dim=0", "moe.topk=2"}));
    EXPECT_NO_THROW(model_with({"attention=[\"kda\",\"gqa\"]", "qk_norm=true", "n_kv_heads=1"}));
    EXPECT_NO_THROW(model_with({"attention=[\"gdn\",\"kda\"]", "kda.head_dim=16", "kda.gate_rank=8"}));
    EXPECT_NO_THROW(model_with({"moe.experts=4", "moe.ffn_dim=8", "moe.capacity_factor=1", "moe.overflow=drop"}));
}

TEST(ConfigKeys, NegativeValuesAreNotTheDefault) {
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"attention=kda", "kda.head_dim=16", "kda.gate_rank=-5"}, "gate_rank must be >= 0"},
        {{"attention=kda", "kda.head_dim=16", "kda.head_v_dim=-1"}, "head_v_dim must be >= 0"},
        {{"attention=kda", "kda.head_dim=16", "kda.num_v_heads=-2"}, "num_v_heads must be >= 0"},
        {{"attention=mla", "mla.softmax_scale=-1"}, "softmax_scale must be >= 0"},
        {{"attention=mla", "mla.latent_eps=0"}, "latent_eps must be positive"},
        {{"attention=kda", "kda.head_dim=16", "kda.o_norm_eps=-1e-5"}, "o_norm_eps must be positive"},
    };
    for (const auto& [sets, needle] : cases) {
        SCOPED_TRACE(sets.back());
        test::expect_error([&] { model_with(sets); }, needle);
    }
}

TEST(ConfigKeys, SizesHaveUpperBounds) {
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"vocab_size=4611686018427387904"}, "model.vocab_size = 4611686018427387904 must be in [1, 16777216]"},
        {{"d_model=1048576"}, "model.d_model = 1048576 must be in [1, 131072]"},
        {{"n_layers=100000"}, "model.n_layers = 100000 must be in [1, 4096]"},
        {{"ffn_dim=1099511627776"}, "model.ffn_dim"},
        {{"moe.experts=1000000", "moe.ffn_dim=8"}, "model.moe.experts = 1000000 must be in [0, 65536]"},
        {{"attention=dsa", "mla.dsa.topk=1099511627776"}, "dsa.topk = 1099511627776 must be in [1, 16777216]"},
        {{"attention=kda", "kda.conv_size=1000000"}, "conv_size = 1000000 must be in [1, 16]"},
    };
    for (const auto& [sets, needle] : cases) {
        SCOPED_TRACE(sets.back());
        test::expect_error([&] { model_with(sets); }, needle);
    }
}

TEST(ConfigKeys, SetNullRemovesAKeySoADerivedRunCanDropIt) {
    EXPECT_NO_THROW(model_with({"n_kv_heads=1", "attention=kda", "n_kv_heads=null"}));
}

TEST(ConfigKeys, TrainKeys) {
    auto run_with = [](const std::vector<std::string>& sets) {
        Json doc = Json::object();
        for (const auto& s : sets) apply_override(doc, s);
        return train::parse_run_config(doc, "c.json");
    };
    test::expect_error([&] { run_with({"train.seed=-1"}); }, "train.seed must be >= 0");
    test::expect_error([&] { run_with({"train.steps=1000000000001"}); }, "train.steps = 1000000000001 must be at most");
    test::expect_error([&] { run_with({"train.seq_len=100000000"}); }, "train.seq_len = 100000000 must be at most");
    test::expect_error([&] { run_with({"train.decay_fraction=0.5"}); }, "train.decay_fraction is set but");
    test::expect_error(
        [&] {
            run_with({"train.schedule=constant", "train.min_lr_ratio=0.5"});
        },
        "train.min_lr_ratio is set but");
    test::expect_error([&] { run_with({"data.val_fraction=0", "train.eval_batches=4"}); }, "train.eval_batches is set");
    EXPECT_NO_THROW(run_with({"train.schedule=wsd", "train.decay_fraction=0.5"}));
    // the GEMMs' precision (ops/gemm.h): f32 or bf16; a saved config keeps the choice
    test::expect_error([&] { run_with({"train.precision=fp16"}); }, "precision");
    EXPECT_EQ(train::parse_run_config(train::to_json(run_with({"train.precision=bf16"})), "saved").train.precision,
              "bf16");
    // the saved activations' dtype (model/model.h): f32 (default) or bf16, kept by a saved config
    EXPECT_EQ(run_with({}).train.activation_dtype, DType::f32);
    test::expect_error([&] { run_with({"train.activation_dtype=f16"}); }, "train.activation_dtype");
    EXPECT_EQ(train::parse_run_config(train::to_json(run_with({"train.activation_dtype=bf16"})), "saved")
                  .train.activation_dtype,
              DType::bf16);
    for (const char* window : {"memory.offload_window_mib=0", "memory.offload_window_mib=100000"})
        test::expect_error([&] { run_with({window}); }, "memory.offload_window_mib must be in [1/256, 65536]");
    EXPECT_NO_THROW(run_with({"memory.optimizer_offload=true", "memory.offload_window_mib=0.0625"}));
    // bf16 weight copies (train/weight_copies.h): on by default, a boolean, kept by a saved config
    EXPECT_TRUE(run_with({}).memory.weight_copies);
    test::expect_error([&] { run_with({"memory.weight_copies=3"}); }, "weight_copies must be true or false, not 3");
    EXPECT_FALSE(train::parse_run_config(train::to_json(run_with({"memory.weight_copies=false"})), "saved")
                     .memory.weight_copies);
    // pipeline stages: at most one per layer; a split names each later stage's first layer, increasing
    test::expect_error(
        [&] {
            run_with({"model.n_layers=4", "parallel.pipeline=5"});
        },
        "parallel.pipeline must be in [1, 4]");
    test::expect_error(
        [&] {
            run_with({"model.n_layers=4", "parallel.pipeline=3", "parallel.pipeline_split=[2]"});
        },
        "parallel.pipeline_split names 1 stage starts; 3 stages need 2");
    for (const char* split :
         {"parallel.pipeline_split=[2,2]", "parallel.pipeline_split=[0,2]", "parallel.pipeline_split=[1,4]"})
        test::expect_error(
            [&] {
                run_with({"model.n_layers=4", "parallel.pipeline=3", split});
            },
            "parallel.pipeline_split must be increasing layers in [1, 4)");
    test::expect_error([&] { run_with({"parallel.pipeline_split=[\"a\"]"}); }, "must be a list of layer indices");
    const train::RunConfig even = run_with({"model.n_layers=4", "parallel.pipeline=3"});
    const train::RunConfig split =
        run_with({"model.n_layers=4", "parallel.pipeline=3", "parallel.pipeline_split=[1,3]"});
    const std::vector<std::pair<int64_t, int64_t>> want_even{{0, 1}, {1, 2}, {2, 4}},
        want_split{{0, 1}, {1, 3}, {3, 4}};
    for (int64_t s = 0; s < 3; ++s) {
        const model::LayerRange a = even.parallel.stage_layers(s, 4), b = split.parallel.stage_layers(s, 4);
        EXPECT_EQ(std::pair(a.first, a.last), want_even[size_t(s)]) << s;
        EXPECT_EQ(std::pair(b.first, b.last), want_split[size_t(s)]) << s;
    }
    EXPECT_EQ(train::parse_run_config(train::to_json(split), "saved").parallel.pipeline_split,
              (std::vector<int64_t>{1, 3}));
}

// Every shipped config, and what to_json writes of it (a checkpoint's config.json), parses.
TEST(ConfigKeys, ShippedConfigsAndTheirSavedFormParse) {
    for (const auto& e : std::filesystem::directory_iterator(std::string(TESSERA_SOURCE_DIR) + "/configs")) {
        if (e.path().extension() != ".json") continue;
        SCOPED_TRACE(e.path().string());
        const train::RunConfig c = train::parse_run_config(train::load_config_json(e.path().string(), {}), "cfg");
        const train::RunConfig back = train::parse_run_config(train::to_json(c), "saved");
        EXPECT_EQ(train::to_json(back), train::to_json(c));
    }
}

}  // namespace
}  // namespace tessera
