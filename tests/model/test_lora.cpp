// LoRA adapters (model/lora.h) against independent references: a zero B leaves the base model's logits
// bitwise; adapters equal the merged weights W' = W + s·B·A (logits); their gradients are the merged model's
// weight gradients G projected, dL/dB = s·G·Aᵀ and dL/dA = s·Bᵀ·G (the merged model's gradients are held to
// PyTorch by the model goldens).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "model/model_fixture.h"
#include "util/test_util.h"

namespace tessera {
namespace {

const std::vector<std::string> kTargets = {"q_proj", "k_proj",    "v_proj",  "g_proj",
                                           "o_proj", "gate_proj", "up_proj", "down_proj"};

Json lora(int64_t rank, double alpha, bool rslora = false) {
    return Json{{"rank", rank}, {"alpha", alpha}, {"rslora", rslora}, {"target_modules", kTargets}};
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

// W' = W + s·B·A in double, for every adapted module, into `merged`'s parameters
void merge(const test::GoldenModel& lo, const test::GoldenModel& merged, double s) {
    for (const std::string& mod : adapted(*lo.model)) {
        const TensorView a = lo.rt->params().view(mod + ".lora_A.weight"),
                         b = lo.rt->params().view(mod + ".lora_B.weight");
        const TensorView w = merged.rt->params().view(mod + ".weight");
        const int64_t out = w.size(0), in = w.size(1), r = a.size(0);
        for (int64_t i = 0; i < out; ++i) {
            for (int64_t j = 0; j < in; ++j) {
                double acc = 0;
                for (int64_t k = 0; k < r; ++k)
                    acc += double(b.ptr<float>()[i * r + k]) * double(a.ptr<float>()[k * in + j]);
                w.ptr<float>()[i * in + j] += float(s * acc);
            }
        }
    }
}

class Lora : public ::testing::TestWithParam<std::string> {};

TEST_P(Lora, ZeroBLeavesTheBaseLogitsBitwise) {
    test::GoldenModel base(GetParam());
    test::GoldenModel lo(GetParam(), false, [](Json& doc) { doc["model"]["lora"] = lora(4, 8); });
    copy_base(base, lo);
    ASSERT_FALSE(adapted(*lo.model).empty());
    const int64_t N = base.shape.tokens(), V = base.cfg.model.vocab_size;
    Tensor want(DType::f32, Shape{N, V}), got(DType::f32, Shape{N, V});
    base.model->forward_logits(base.shape, base.ids("ids"), want);
    lo.model->forward_logits(lo.shape, lo.ids("ids"), got);
    EXPECT_TRUE(test::bitwise_equal(got, want));
}

TEST_P(Lora, AdaptersEqualTheMergedWeightsAndTheirGradientsAreItsGradientsProjected) {
    for (const bool rslora : {false, true}) {
        SCOPED_TRACE(rslora ? "rslora" : "lora");
        test::GoldenModel base(GetParam()), merged(GetParam());
        test::GoldenModel lo(GetParam(), false, [&](Json& doc) { doc["model"]["lora"] = lora(4, 8, rslora); });
        copy_base(base, lo);
        std::mt19937 gen(7);
        std::normal_distribution<float> normal(0.f, 0.05f);
        for (const std::string& mod : adapted(*lo.model)) {  // B non-zero, so the adapters matter
            const TensorView b = lo.rt->params().view(mod + ".lora_B.weight");
            for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = normal(gen);
        }
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
            const int64_t out = g.size(0), in = g.size(1), r = a.size(0);
            Tensor da(DType::f32, a.shape), db(DType::f32, b.shape);
            for (int64_t i = 0; i < out; ++i) {
                for (int64_t k = 0; k < r; ++k) {
                    double acc = 0;  // dB = s·G·Aᵀ
                    for (int64_t j = 0; j < in; ++j)
                        acc += double(g.ptr<float>()[i * in + j]) * double(a.ptr<float>()[k * in + j]);
                    db.ptr<float>()[i * r + k] = float(s * acc);
                }
            }
            for (int64_t k = 0; k < r; ++k) {
                for (int64_t j = 0; j < in; ++j) {
                    double acc = 0;  // dA = s·Bᵀ·G
                    for (int64_t i = 0; i < out; ++i)
                        acc += double(b.ptr<float>()[i * r + k]) * double(g.ptr<float>()[i * in + j]);
                    da.ptr<float>()[k * in + j] = float(s * acc);
                }
            }
            EXPECT_TRUE(test::rel_rms_close(lo.rt->grads().view(mod + ".lora_A.weight"), da, 1e-5));
            EXPECT_TRUE(test::rel_rms_close(lo.rt->grads().view(mod + ".lora_B.weight"), db, 1e-5));
        }
        // only the adapters train: one gradient per adapter tensor, nothing for the base
        EXPECT_EQ(lo.rt->grads().size(), 2 * adapted(*lo.model).size());
    }
}

// dense_gqa: q/k/v/o and the MLP; gated_gqa adds g_proj (the fused q/k/v/g GEMM's last part)
INSTANTIATE_TEST_SUITE_P(Models, Lora, ::testing::Values("dense_gqa", "gated_gqa"));

TEST(LoraConfig, MistakesAreOneLineErrors) {
    auto build = [](Json l) { test::GoldenModel g("dense_gqa", false, [&](Json& doc) { doc["model"]["lora"] = l; }); };
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
}

}  // namespace
}  // namespace tessera
