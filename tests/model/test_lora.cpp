// LoRA adapters (model/lora.h) against independent references: a zero B leaves the base model's logits
// bitwise; adapters equal the merged weights W' = W + s·B·A (logits); their gradients are the merged model's
// weight gradients G projected, dL/dB = s·G·Aᵀ and dL/dA = s·Bᵀ·G (the merged model's gradients are held to
// PyTorch by the model goldens).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>

#include "model/model_fixture.h"
#include "util/test_util.h"

namespace tessera {
namespace {

const std::vector<std::string> kTargets = {"q_proj", "k_proj",    "v_proj",  "g_proj",
                                           "o_proj", "gate_proj", "up_proj", "down_proj"};

Json lora(int64_t rank, double alpha, bool rslora = false, double dropout = 0.0) {
    return Json{
        {"rank", rank}, {"alpha", alpha}, {"rslora", rslora}, {"dropout", dropout}, {"target_modules", kTargets}};
}

void copy_base(const test::GoldenModel& from, const test::GoldenModel& to) {
    for (const auto& spec : from.model->param_specs()) {
        const TensorView a = from.rt->params().view(spec.name), b = to.rt->params().view(spec.name);
        std::memcpy(b.data, a.data, a.nbytes());
    }
}

// the adapted modules: name -> (A, B)
std::vector<std::string> adapted(const model::Model& m) {
    std::vector<std::string> out;
    for (const auto& s : m.param_specs()) {
        if (s.name.ends_with(".lora_A.weight")) out.push_back(s.name.substr(0, s.name.size() - 14));
    }
    return out;
}

// W' = W + s·B·A in double, for every adapted module, into `merged`'s parameters; routed experts [E, out, in]
// expert by expert
void merge(const test::GoldenModel& lo, const test::GoldenModel& merged, double s) {
    for (const std::string& mod : adapted(*lo.model)) {
        const TensorView a = lo.rt->params().view(mod + ".lora_A.weight"),
                         b = lo.rt->params().view(mod + ".lora_B.weight");
        const TensorView w = merged.rt->params().view(mod + ".weight");
        const int64_t E = w.ndim() == 3 ? w.size(0) : 1, out = w.size(-2), in = w.size(-1), r = a.size(-2);
        for (int64_t e = 0; e < E; ++e) {
            const float *A = a.ptr<float>() + e * r * in, *B = b.ptr<float>() + e * out * r;
            float* W = w.ptr<float>() + e * out * in;
            for (int64_t i = 0; i < out; ++i) {
                for (int64_t j = 0; j < in; ++j) {
                    double acc = 0;
                    for (int64_t k = 0; k < r; ++k) acc += double(B[i * r + k]) * double(A[k * in + j]);
                    W[i * in + j] += float(s * acc);
                }
            }
        }
    }
}

class Lora : public ::testing::TestWithParam<std::string> {};

TEST_P(Lora, ZeroBLeavesTheBaseLogitsBitwise) {
    test::GoldenModel base(GetParam());
    test::GoldenModel lo(GetParam(), {}, [](Json& doc) { doc["model"]["lora"] = lora(4, 8); });
    copy_base(base, lo);
    ASSERT_FALSE(adapted(*lo.model).empty());
    const int64_t N = base.shape.tokens(), V = base.cfg.model.vocab_size;
    Tensor want(DType::f32, Shape{N, V}), got(DType::f32, Shape{N, V});
    base.model->forward_logits(base.shape, base.ids("ids"), want);
    lo.model->forward_logits(lo.shape, lo.ids("ids"), got);
    EXPECT_TRUE(test::bitwise_equal(got, want));
}

// B drawn so the adapters matter
void randomize_b(const test::GoldenModel& lo, uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.f, 0.05f);
    for (const std::string& mod : adapted(*lo.model)) {
        const TensorView b = lo.rt->params().view(mod + ".lora_B.weight");
        for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = normal(gen);
    }
}

TEST_P(Lora, IncrementalDecodingWithAdaptersMatchesTheFullForward) {
    test::GoldenModel lo(GetParam(), {}, [](Json& doc) { doc["model"]["lora"] = lora(4, 8); });
    randomize_b(lo, 3);
    test::GoldenModel::Decoder d = lo.decoder();
    lo.expect_decoding_matches_forward(d, 1e-5);  // as the models' own decoding
}

TEST_P(Lora, RecomputeIsBitwiseIdentical) {
    // with dropout: a recomputed forward draws the masks the first forward drew
    auto with = [](Json& doc) { doc["model"]["lora"] = lora(4, 8, false, 0.25); };
    test::GoldenModel plain(GetParam(), {}, with), recompute(GetParam(), model::Recompute::every(), with);
    EXPECT_EQ(plain.run_trajectory(), recompute.run_trajectory());
    for (const std::string& mod : adapted(*plain.model)) {
        for (const char* w : {".lora_A.weight", ".lora_B.weight"})
            EXPECT_TRUE(test::bitwise_equal(plain.rt->params().view(mod + w), recompute.rt->params().view(mod + w)))
                << mod << w;
    }
}

// Dropout (model.lora.dropout) masks the adapters' input in training passes only, as a pure function of the pass's
// seed: evaluation is the dropout-free model's, bit for bit; a seed gives the same loss and gradients every time,
// another seed other ones
TEST_P(Lora, DropoutMasksTrainingPassesByTheirSeedOnly) {
    test::GoldenModel plain(GetParam(), {}, [](Json& doc) { doc["model"]["lora"] = lora(4, 8); });
    test::GoldenModel drop(GetParam(), {}, [](Json& doc) { doc["model"]["lora"] = lora(4, 8, false, 0.3); });
    copy_base(plain, drop);  // every parameter, adapters included
    randomize_b(plain, 5);
    randomize_b(drop, 5);
    const int64_t N = plain.shape.tokens(), V = plain.cfg.model.vocab_size;
    Tensor a(DType::f32, Shape{N, V}), b(DType::f32, Shape{N, V});
    plain.model->forward_logits(plain.shape, plain.ids("ids"), a);
    drop.model->forward_logits(drop.shape, drop.ids("ids"), b);
    EXPECT_TRUE(test::bitwise_equal(a, b)) << "evaluation must not drop";
    auto train = [&](test::GoldenModel& g, uint64_t seed) {
        g.model->set_lora_seed(seed);
        g.rt->grads().zero();
        const double loss = g.model->forward_backward(g.shape, g.ids("ids"), g.ids("targets"), 1.0).loss;
        return std::pair(loss, Tensor::copy_of(g.rt->grads().view(size_t(0))));
    };
    const auto none = train(plain, 0), once = train(drop, 11), again = train(drop, 11), other = train(drop, 12);
    EXPECT_NE(once.first, none.first) << "dropout changed nothing";
    EXPECT_EQ(once.first, again.first);
    EXPECT_TRUE(test::bitwise_equal(once.second, again.second));
    EXPECT_NE(once.first, other.first);
    EXPECT_EQ(train(drop, 0).first, none.first) << "seed 0: no dropout";
}

TEST_P(Lora, EveryTargetedProjectionGetsAnAdapter) {
    test::GoldenModel lo(GetParam(), {}, [](Json& doc) { doc["model"]["lora"] = lora(4, 8); });
    std::set<std::string> names;
    for (const auto& spec : lo.model->param_specs()) names.insert(spec.name);
    int64_t adapted_count = 0;
    for (const auto& spec : lo.model->param_specs()) {
        if (!spec.name.ends_with(".weight") || spec.name.find(".lora_") != std::string::npos) continue;
        const std::string mod = spec.name.substr(0, spec.name.size() - 7);
        // the DSA indexer learns from its KL alone: no adapters
        if (!model::LoraConfig::names(kTargets, mod) || mod.find(".indexer.") != std::string::npos) continue;
        EXPECT_TRUE(names.count(mod + ".lora_A.weight") && names.count(mod + ".lora_B.weight")) << mod;
        EXPECT_FALSE(spec.trainable) << spec.name;
        ++adapted_count;
    }
    EXPECT_EQ(2 * adapted_count, int64_t(lo.opt->param_specs().size())) << "only the adapters train";
}

TEST_P(Lora, AdaptersEqualTheMergedWeightsAndTheirGradientsAreItsGradientsProjected) {
    for (const bool rslora : {false, true}) {
        SCOPED_TRACE(rslora ? "rslora" : "lora");
        test::GoldenModel base(GetParam()), merged(GetParam());
        test::GoldenModel lo(GetParam(), {}, [&](Json& doc) { doc["model"]["lora"] = lora(4, 8, rslora); });
        copy_base(base, lo);
        randomize_b(lo, 7);
        const double s = rslora ? 8.0 / 2.0 : 8.0 / 4.0;
        merge(lo, merged, s);
        const int64_t N = base.shape.tokens(), V = base.cfg.model.vocab_size;
        Tensor want(DType::f32, Shape{N, V}), got(DType::f32, Shape{N, V}), plain(DType::f32, Shape{N, V});
        merged.model->forward_logits(merged.shape, merged.ids("ids"), want);
        lo.model->forward_logits(lo.shape, lo.ids("ids"), got);
        base.model->forward_logits(base.shape, base.ids("ids"), plain);
        EXPECT_TRUE(test::rel_rms_close(got, want, 1e-5));
        EXPECT_FALSE(test::rel_rms_close(plain, want, 1e-3)) << "the adapters changed nothing";
        merged.rt->grads().zero();
        lo.rt->grads().zero();
        const auto lm = merged.model->forward_backward(merged.shape, merged.ids("ids"), merged.ids("targets"), 1.0);
        const auto ll = lo.model->forward_backward(lo.shape, lo.ids("ids"), lo.ids("targets"), 1.0);
        EXPECT_NEAR(ll.loss, lm.loss, 1e-5 * lm.loss);
        for (const std::string& mod : adapted(*lo.model)) {
            SCOPED_TRACE(mod);
            const TensorView a = lo.rt->params().view(mod + ".lora_A.weight"),
                             b = lo.rt->params().view(mod + ".lora_B.weight");
            const TensorView g = merged.rt->grads().view(mod + ".weight");
            const int64_t E = g.ndim() == 3 ? g.size(0) : 1, out = g.size(-2), in = g.size(-1), r = a.size(-2);
            Tensor da(DType::f32, a.shape), db(DType::f32, b.shape);
            for (int64_t e = 0; e < E; ++e) {
                const float *G = g.ptr<float>() + e * out * in, *A = a.ptr<float>() + e * r * in,
                            *B = b.ptr<float>() + e * out * r;
                for (int64_t i = 0; i < out; ++i) {
                    for (int64_t k = 0; k < r; ++k) {
                        double acc = 0;  // dB = s·G·Aᵀ
                        for (int64_t j = 0; j < in; ++j) acc += double(G[i * in + j]) * double(A[k * in + j]);
                        db.ptr<float>()[e * out * r + i * r + k] = float(s * acc);
                    }
                }
                for (int64_t k = 0; k < r; ++k) {
                    for (int64_t j = 0; j < in; ++j) {
                        double acc = 0;  // dA = s·Bᵀ·G
                        for (int64_t i = 0; i < out; ++i) acc += double(B[i * r + k]) * double(G[i * in + j]);
                        da.ptr<float>()[e * r * in + k * in + j] = float(s * acc);
                    }
                }
            }
            // fp32 gradients through every layer above (the model goldens hold step-0 gradients to 1e-5 - 3e-5)
            EXPECT_TRUE(test::rel_rms_close(lo.rt->grads().view(mod + ".lora_A.weight"), da, 3e-5));
            EXPECT_TRUE(test::rel_rms_close(lo.rt->grads().view(mod + ".lora_B.weight"), db, 3e-5));
        }
        // only the adapters train: one gradient per adapter tensor, nothing for the base
        EXPECT_EQ(lo.rt->grads().size(), 2 * adapted(*lo.model).size());
    }
}

// model.lora.base_dtype = bf16: the frozen GEMM weights are held in bf16 and widened per GEMM block, so a model
// with a bf16 base computes, bit for bit, what the f32 model computes on the same (bf16-representable) values:
// logits, ten training steps, the adapters they train, decoding; and the bf16 weights take half the bytes
TEST_P(Lora, BaseKeptInBf16ComputesAsTheF32BaseOfTheSameValues) {
    Json l = lora(4, 8);
    test::GoldenModel f32(GetParam(), {}, [&](Json& doc) { doc["model"]["lora"] = l; });
    l["base_dtype"] = "bf16";
    test::GoldenModel b16(GetParam(), {}, [&](Json& doc) { doc["model"]["lora"] = l; });
    randomize_b(f32, 5);
    size_t narrow = 0, bytes32 = 0, bytes16 = 0;
    for (const auto& spec : b16.model->param_specs()) {
        const TensorView a = f32.rt->params().view(spec.name), b = b16.rt->params().view(spec.name);
        if (b.dtype == DType::bf16) {  // the f32 model's values rounded to bf16, then held as such by both
            ++narrow;
            EXPECT_FALSE(spec.trainable) << spec.name;
            convert(a, b);
            convert(b, a);
            bytes32 += a.nbytes();
            bytes16 += b.nbytes();
        } else {
            ASSERT_EQ(b.dtype, DType::f32) << spec.name;
            std::memcpy(b.data, a.data, a.nbytes());
        }
    }
    ASSERT_GT(narrow, 0u);
    EXPECT_EQ(bytes16 * 2, bytes32);
    EXPECT_LT(b16.rt->params().nbytes(), f32.rt->params().nbytes());
    const int64_t N = f32.shape.tokens(), V = f32.cfg.model.vocab_size;
    Tensor want(DType::f32, Shape{N, V}), got(DType::f32, Shape{N, V});
    f32.model->forward_logits(f32.shape, f32.ids("ids"), want);
    b16.model->forward_logits(b16.shape, b16.ids("ids"), got);
    EXPECT_TRUE(test::bitwise_equal(got, want));
    test::GoldenModel::Decoder d = b16.decoder();
    b16.expect_decoding_matches_forward(d, 1e-5);
    EXPECT_EQ(b16.run_trajectory(), f32.run_trajectory());
    for (const std::string& mod : adapted(*f32.model)) {
        for (const char* w : {".lora_A.weight", ".lora_B.weight"})
            EXPECT_TRUE(test::bitwise_equal(b16.rt->params().view(mod + w), f32.rt->params().view(mod + w)))
                << mod << w;
    }
}

// model.lora.expert_dtype = mxfp4: the frozen routed experts are held in MXFP4 blocks (17 bytes per 32 values) and
// widened per GEMM block, so the model computes, bit for bit, what the f32 model computes on the dequantised values:
// logits, ten training steps with adapters on every routed expert, the adapters they train, decoding. (The MoE golden
// models with expert dimensions widened to whole blocks of 32.)
TEST(LoraMxfp4, ExpertsHeldInMxfp4ComputeAsTheF32ExpertsOfTheSameValues) {
    for (const char* name : {"moe_latent_situ", "mla_nope_moe", "attn_res_mla_moe"}) {
        SCOPED_TRACE(name);
        Json l = lora(4, 8);
        auto edit = [&](Json& doc) {
            doc["model"]["lora"] = l;
            doc["model"]["moe"]["ffn_dim"] = 32;
            if (doc["model"]["moe"].value("latent_dim", 0) > 0) doc["model"]["moe"]["latent_dim"] = 32;
        };
        test::GoldenModel f32(name, {}, edit);
        l["expert_dtype"] = "mxfp4";
        test::GoldenModel mx(name, {}, edit);
        randomize_b(f32, 5);
        size_t held = 0, bytes32 = 0, bytes4 = 0;
        for (const auto& spec : mx.model->param_specs()) {
            const TensorView a = f32.rt->params().view(spec.name), b = mx.rt->params().view(spec.name);
            if (b.dtype == DType::mxfp4) {  // quantised from the same initial values; the f32 model takes them widened
                ++held;
                EXPECT_FALSE(spec.trainable) << spec.name;
                EXPECT_EQ(spec.sharding, Sharding::expert) << spec.name;
                convert(b, a);
                bytes32 += a.nbytes();
                bytes4 += b.nbytes();
            } else {
                ASSERT_EQ(b.dtype, DType::f32) << spec.name;
                std::memcpy(b.data, a.data, a.nbytes());
            }
        }
        ASSERT_GT(held, 0u);
        EXPECT_EQ(bytes4 * 128, bytes32 * 17);  // 4.25 bits a value
        const int64_t N = f32.shape.tokens(), V = f32.cfg.model.vocab_size;
        Tensor want(DType::f32, Shape{N, V}), got(DType::f32, Shape{N, V});
        f32.model->forward_logits(f32.shape, f32.ids("ids"), want);
        mx.model->forward_logits(mx.shape, mx.ids("ids"), got);
        EXPECT_TRUE(test::bitwise_equal(got, want));
        test::GoldenModel::Decoder d = mx.decoder();
        mx.expect_decoding_matches_forward(d, 1e-5);
        EXPECT_EQ(mx.run_trajectory(), f32.run_trajectory());
        size_t expert_adapters = 0;
        for (const std::string& mod : adapted(*f32.model)) {
            expert_adapters += mod.find("experts") != std::string::npos;
            for (const char* w : {".lora_A.weight", ".lora_B.weight"})
                EXPECT_TRUE(test::bitwise_equal(mx.rt->params().view(mod + w), f32.rt->params().view(mod + w)))
                    << mod << w;
        }
        EXPECT_GT(expert_adapters, 0u);
    }
}

TEST(LoraMxfp4, ExpertRowsMustBeWholeBlocks) {
    test::expect_error(
        [] {
            test::GoldenModel g("moe_latent_situ", {}, [](Json& doc) {
                Json l = lora(4, 8);
                l["expert_dtype"] = "mxfp4";
                doc["model"]["lora"] = l;
            });
        },
        "model.lora.expert_dtype = \"mxfp4\": the routed experts' ");
    test::expect_error(
        [] {
            test::GoldenModel g("moe_latent_situ", {}, [](Json& doc) {
                Json l = lora(4, 8);
                l["expert_dtype"] = "fp4";
                doc["model"]["lora"] = l;
            });
        },
        "expert_dtype = \"fp4\" must be one of: bf16, f32, mxfp4");
}

// every layer kind: GQA (gated: g_proj, the fused q/k/v/g GEMM's last part), the dense MLP, MLA with and without
// q_lora (kv_b_proj merged), DSA, KDA and GDN, MoE with latent projections, shared and routed experts
INSTANTIATE_TEST_SUITE_P(Models,
                         Lora,
                         ::testing::Values("dense_gqa",
                                           "gated_gqa",
                                           "moe_latent_situ",
                                           "dsa_sparse",
                                           "mla_nope_moe",
                                           "hybrid_kda_dsa",
                                           "hybrid_gdn_gqa",
                                           "attn_res_mla_moe"),
                         [](const auto& info) { return info.param; });

// The step's FLOPs (the MFU of the progress line): a frozen base's weight gradients are not computed, so its matmul
// weights count 2 FLOPs per token less each (routed experts: top-k per token), counted here from the configs' shapes.
TEST(LoraFlops, AFrozenBaseSkipsItsWeightGradients) {
    const int64_t seq = 16;
    auto flops = [&](const std::string& name, bool adapters) {
        test::GoldenModel g(name, {}, [&](Json& doc) {
            if (adapters) doc["model"]["lora"] = lora(4, 8.0);
        });
        return std::pair(g.model->forward_flops_per_token(seq), g.model->train_flops_per_token(seq));
    };
    {
        const auto [fwd, train] = flops("dense_gqa", false);
        EXPECT_EQ(train, 3.0 * fwd);  // everything trains
    }
    {
        // d 32, 4 heads of 8 (2 kv heads), ffn 48, vocab 64 (untied head), 2 layers: q, k, v, o, gate, up, down, head
        const double base = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48) + 64 * 32;
        const auto [fwd, train] = flops("dense_gqa", true);
        EXPECT_DOUBLE_EQ(train, 3.0 * fwd - 2.0 * base);
    }
    {
        // the same attention; layer 0 a dense MLP (ffn 48), layer 1 an MoE: router 8 × 32, latent 32 -> 16 -> 32,
        // shared expert ffn 24, 8 experts (gate, up, down of 16 × 16) of which 3 per token
        const double attention = 32 * 32 + 2 * 32 * 16 + 32 * 32;
        const double moe = 8 * 32 + 2 * 32 * 16 + 3 * 32 * 24 + 3 * (3 * 16 * 16);
        const double base = 2 * attention + 3 * 32 * 48 + moe + 64 * 32;
        const auto [fwd, train] = flops("moe_latent_situ", true);
        EXPECT_DOUBLE_EQ(train, 3.0 * fwd - 2.0 * base);
    }
}

TEST(LoraConfig, MistakesAreOneLineErrors) {
    auto build = [](Json l) { test::GoldenModel g("dense_gqa", {}, [&](Json& doc) { doc["model"]["lora"] = l; }); };
    test::expect_error(
        [&] {
            build(Json{{"rank", 4}, {"target_modules", {"q_prj"}}});
        },
        "model.lora.target_modules: no name in [\"q_prj\"] names a projection");
    test::expect_error(
        [&] {
            build(Json{{"rank", 4}, {"modules_to_save", {"lm_heads"}}});
        },
        "\"lm_heads\" names no module");
    test::expect_error([&] { build(Json{{"rank", 4}}); }, "nothing would train");
    test::expect_error([&] { build(Json{{"target_modules", {"q_proj"}}}); }, "lora.rank is 0");
    test::expect_error([&] { build(Json{{"rank", -1}, {"target_modules", {"q_proj"}}}); }, "lora.rank must be in");
    test::expect_error(
        [&] {
            build(Json{{"rank", 4}, {"alpha", 0}, {"target_modules", {"q_proj"}}});
        },
        "lora.alpha must be positive");
    test::expect_error([&] { build(Json{{"rank", 4}, {"target_modules", "q_proj"}}); }, "must be a list of strings");
    test::expect_error(
        [&] {
            build(Json{{"rank", 4}, {"dropout", 1.0}, {"target_modules", {"q_proj"}}});
        },
        "lora.dropout must be in [0, 1)");
    test::expect_error(
        [&] {
            build(Json{{"rank", 4}, {"base_dtype", "fp16"}, {"target_modules", {"q_proj"}}});
        },
        "base_dtype");
}

}  // namespace
}  // namespace tessera
