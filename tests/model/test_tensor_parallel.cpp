// Tensor parallelism (parallel.tensor, model/layers/tensor_slice.h) on in-process ranks: T ranks passing the same
// micro-batch give one rank's loss, and their gradients summed give one rank's, up to the order of the sum over heads
// (1e-5 relative); each rank's gradient of a head-sliced parameter is zero outside its slice (it ran only its heads),
// a rank holds 1/T of the residual stream, and what tensor parallelism does not cover yet is a one-line error.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "core/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "model/runtime.h"
#include "parallel/comm_local.h"
#include "util/test_util.h"

namespace tessera {
namespace {

constexpr int64_t kBatch = 2, kSeq = 16;

// KDA, gated GQA with q/k norms, GDN, gated DSA and gated MLA layers, MLP and MoE feed-forwards (KDA's q/k width per
// rank: a multiple of 16)
model::ModelConfig hybrid(int64_t kv_heads, int64_t kda_head_dim = 8) {
    model::ModelConfig c;
    c.vocab_size = 64;
    c.d_model = 32;
    c.n_layers = 5;
    c.n_heads = 4;
    c.n_kv_heads = kv_heads;
    c.ffn_dim = 48;
    c.attention = {"kda", "gqa", "gdn", "dsa", "mla"};
    c.output_gate = "elementwise";
    c.qk_norm = true;
    c.kda.head_dim = kda_head_dim;
    c.mla.q_lora_rank = 16;
    c.mla.kv_lora_rank = 16;
    c.mla.qk_nope_dim = 8;
    c.mla.qk_rope_dim = 8;
    c.mla.v_head_dim = 8;
    c.mla.dsa.topk = 8;  // of up to 16 tokens
    c.mla.dsa.heads = 2;
    c.mla.dsa.head_dim = 16;
    c.mla.dsa.rope_dim = 8;
    c.moe.experts = 4;
    c.moe.topk = 2;
    c.moe.ffn_dim = 16;
    c.moe.shared_ffn_dim = 16;
    c.moe.first_dense = 1;
    return c;
}

struct Pass {
    double loss = 0;
    std::map<std::string, std::vector<float>> grads;
    size_t x_bytes = 0;  // one residual-stream buffer
};

// One forward_backward over a fixed micro-batch from parameters of seed 7; tensor: the tensor group (null: none).
Pass run(const model::ModelConfig& c, parallel::Comm* tensor, const model::Recompute& recompute = {}) {
    model::Model m(c, nullptr, 1, {}, tensor);
    const model::StepShape s{kBatch, kSeq};
    model::ModelRuntime rt(m, s, /*with_grads=*/true, recompute);
    m.init_params(rt.params(), 7);
    // LoRA's B starts at zero: give the adapters an effect (a small one: stronger adapters make this tiny model's
    // gradients sensitive enough that the order of the head sum shows above 1e-5, 5e-5 at 12× this scale)
    for (const BufferSpec& spec : rt.params().specs()) {
        if (!spec.name.ends_with(".lora_B.weight")) continue;
        const TensorView b = rt.params().view(spec.name);
        for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = 0.004f * float((i * 29 + 3) % 17 - 8);
    }
    std::vector<int32_t> ids(size_t(s.tokens())), targets(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = int32_t((i * 37 + 11) % 64);
        targets[i] = int32_t((i * 53 + 5) % 64);
    }
    Pass p;
    p.loss = m.forward_backward(s, ids, targets, 1.0).loss;
    for (const BufferSpec& spec : rt.grads().specs()) {
        const TensorView g = rt.grads().view(spec.name);
        p.grads[spec.name].assign(g.ptr<float>(), g.ptr<float>() + g.numel());
    }
    p.x_bytes = rt.activations().view("x.0").nbytes();
    return p;
}

// every rank's pass, in rank order
std::vector<Pass> run_ranks(int T, const model::ModelConfig& c, const model::Recompute& recompute = {}) {
    std::vector<Pass> out(static_cast<size_t>(T));
    parallel::run_local(T, [&](parallel::Comm& world) { out[size_t(world.rank())] = run(c, &world, recompute); });
    return out;
}

double rel_rms(const std::vector<float>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(a[i]) * double(a[i]);
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

void expect_matches_one_rank(int T, const model::ModelConfig& c, const model::Recompute& recompute = {}) {
    const Pass one = run(c, nullptr, recompute);
    const std::vector<Pass> ranks = run_ranks(T, c, recompute);
    for (int t = 0; t < T; ++t) {
        EXPECT_NEAR(ranks[size_t(t)].loss, one.loss, 1e-6 * one.loss) << "rank " << t;
        EXPECT_EQ(ranks[size_t(t)].x_bytes * size_t(T), one.x_bytes) << "rank " << t << ": 1/T of the tokens";
    }
    for (const auto& [name, g] : one.grads) {
        std::vector<double> sum(g.size(), 0.0);
        for (const Pass& p : ranks)
            for (size_t i = 0; i < g.size(); ++i) sum[i] += double(p.grads.at(name)[i]);
        EXPECT_LT(rel_rms(g, sum), 1e-5) << name;
    }
}

TEST(TensorParallel, TwoRanksEqualOneUpToTheOrderOfTheHeadSum) { expect_matches_one_rank(2, hybrid(2)); }

TEST(TensorParallel, FourRanksEqualOne) { expect_matches_one_rank(4, hybrid(4, 16)); }

TEST(TensorParallel, RecomputedBlocksEqualOneRank) { expect_matches_one_rank(2, hybrid(2), model::Recompute::every()); }

// model.lora over every projection, the frozen base held in bf16; the input norms train whole (modules_to_save)
TEST(TensorParallel, LoraAdaptersOnABf16BaseEqualOneRank) {
    model::ModelConfig c = hybrid(2);
    c.lora.rank = 4;
    c.lora.base_dtype = "bf16";
    c.lora.target_modules = {"q_proj",   "k_proj",    "v_proj",
                             "o_proj",   "g_proj",    "q_a_proj",
                             "q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa",
                             "f_b_proj", "g_b_proj",  "gate_proj",
                             "up_proj",  "down_proj"};
    c.lora.modules_to_save = {"input_layernorm"};
    const Pass one = run(c, nullptr);
    EXPECT_TRUE(one.grads.contains("model.layers.1.self_attn.o_proj.lora_A.weight"));
    EXPECT_TRUE(one.grads.contains("model.layers.4.self_attn.kv_b_proj.lora_B.weight"));
    EXPECT_FALSE(one.grads.contains("model.layers.1.self_attn.q_proj.weight")) << "the base is frozen";
    expect_matches_one_rank(2, c);
    // q_proj's B [H·D, r] is sliced by rows, o_proj's A [r, H·D] by columns
    const std::vector<Pass> ranks = run_ranks(2, c);
    const std::vector<float>& b = ranks[1].grads.at("model.layers.1.self_attn.q_proj.lora_B.weight");
    double first = 0, second = 0;
    for (size_t i = 0; i < b.size(); ++i) (i < b.size() / 2 ? first : second) += std::abs(b[i]);
    EXPECT_EQ(first, 0) << "rank 1 wrote q_proj's B rows of rank 0's heads";
    EXPECT_GT(second, 0);
}

// The image tower (Kimi K3's, model/vision.h) in a tensor group of 2: every rank runs the frozen tower whole and keeps
// the image rows of its tokens. Against the float64 reference of tests/golden/model/vision_lm.safetensors (two
// sequences: one per rank) the loss within 1e-5 and the summed gradients within 1e-4; and on one sequence of 48 whose
// last image straddles the ranks' halves (tokens 18-29), the loss and gradients of one rank.
TEST(TensorParallel, ImageRowsGoToTheRanksThatHoldTheirTokens) {
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    const model::ModelConfig cfg =
        model::parse_model_config(Json::parse(f.metadata().at("config"))["model"], "vision_lm golden");
    const Tensor g = f.load("grids"), patches = f.load("patches");
    std::vector<ops::PatchGrid> grids;
    for (int64_t i = 0; i < g.shape()[0]; ++i) grids.push_back({g.ptr<int64_t>()[2 * i], g.ptr<int64_t>()[2 * i + 1]});
    // one pass: the loss and every trained gradient
    auto pass = [&](parallel::Comm* group, model::StepShape shape, std::span<const int32_t> ids,
                    std::span<const int32_t> targets) {
        model::Model m(cfg, nullptr, 1, {}, group);
        model::ModelRuntime rt(m, shape, true, {});
        for (const BufferSpec& s : m.param_specs()) f.load_into("param." + s.name, rt.params().view(s.name));
        m.set_images(grids, patches);
        rt.grads().zero();
        Pass p;
        p.loss = m.forward_backward(shape, ids, targets, 1.0).loss;
        for (const BufferSpec& spec : m.trained_specs()) {
            const TensorView v = rt.grads().view(spec.name);
            p.grads[spec.name].assign(v.ptr<float>(), v.ptr<float>() + v.numel());
        }
        return p;
    };
    auto ranks = [&](model::StepShape shape, std::span<const int32_t> ids, std::span<const int32_t> targets) {
        std::vector<Pass> out(2);
        parallel::run_local(2, [&](parallel::Comm& w) { out[size_t(w.rank())] = pass(&w, shape, ids, targets); });
        std::map<std::string, std::vector<double>> sum;
        for (const auto& [name, v] : out[0].grads) {
            sum[name].assign(v.size(), 0.0);
            for (const Pass& p : out)
                for (size_t i = 0; i < v.size(); ++i) sum[name][i] += double(p.grads.at(name)[i]);
        }
        EXPECT_EQ(out[0].loss, out[1].loss);
        return std::pair(out[0].loss, sum);
    };
    const Tensor ids_t = f.load("ids"), targets_t = f.load("targets");
    const std::span<const int32_t> ids(ids_t.ptr<int32_t>(), size_t(ids_t.numel())),
        targets(targets_t.ptr<int32_t>(), size_t(targets_t.numel()));
    const auto [loss, grads] = ranks({2, 24}, ids, targets);
    EXPECT_NEAR(loss, f.load("expected.loss").ptr<double>()[0], 1e-5);
    for (const auto& [name, sum] : grads) {
        const Tensor want = f.load("expected.grad." + name);
        std::vector<float> w(size_t(want.numel()));
        for (size_t i = 0; i < w.size(); ++i) w[i] = float(want.ptr<double>()[i]);
        EXPECT_LT(rel_rms(w, sum), 1e-4) << name;
    }
    // images of 6, 2 and 12 tokens at 2-7, 15-16 and 18-29 of one sequence: rank 0 holds 18-23 of the last, rank 1
    // 24-29
    std::vector<int32_t> one(48), next(48);
    for (size_t i = 0; i < one.size(); ++i) {
        const bool image = (i >= 2 && i <= 7) || i == 15 || i == 16 || (i >= 18 && i <= 29);
        one[i] = image ? int32_t(cfg.vision.image_token) : int32_t(8 + (i * 7) % 30);  // (text: not token 7)
        next[i] = int32_t(1 + (i * 11) % 30);
    }
    const Pass whole = pass(nullptr, {1, 48}, one, next);
    const auto [split_loss, split] = ranks({1, 48}, one, next);
    EXPECT_NEAR(split_loss, whole.loss, 1e-6 * whole.loss);
    for (const auto& [name, sum] : split) EXPECT_LT(rel_rms(whole.grads.at(name), sum), 1e-5) << name;
}

TEST(TensorParallel, EachRankComputesOnlyItsHeads) {
    const model::ModelConfig c = hybrid(2);
    const std::vector<Pass> ranks = run_ranks(2, c);
    // gqa layer 1: q_proj [H·D, C] (head-major rows), o_proj [C, H·D] (columns), the input norm [C] (every head's)
    const int64_t C = c.d_model, Q = c.n_heads * (c.d_model / c.n_heads);
    for (int t = 0; t < 2; ++t) {
        const Pass& p = ranks[size_t(t)];
        const std::vector<float>& q = p.grads.at("model.layers.1.self_attn.q_proj.weight");
        const std::vector<float>& o = p.grads.at("model.layers.1.self_attn.o_proj.weight");
        const std::vector<float>& norm = p.grads.at("model.layers.1.input_layernorm.weight");
        double inside = 0, outside = 0;
        for (int64_t r = 0; r < Q; ++r)
            for (int64_t k = 0; k < C; ++k) (r / (Q / 2) == t ? inside : outside) += std::abs(q[size_t(r * C + k)]);
        EXPECT_GT(inside, 0) << "rank " << t;
        EXPECT_EQ(outside, 0) << "rank " << t << ": q_proj rows of the other rank's heads";
        inside = outside = 0;
        for (int64_t r = 0; r < C; ++r)
            for (int64_t k = 0; k < Q; ++k) (k / (Q / 2) == t ? inside : outside) += std::abs(o[size_t(r * Q + k)]);
        EXPECT_GT(inside, 0) << "rank " << t;
        EXPECT_EQ(outside, 0) << "rank " << t << ": o_proj columns of the other rank's heads";
        double n = 0;
        for (float v : norm) n += std::abs(v);
        EXPECT_GT(n, 0) << "rank " << t << ": the input norm is every head's";
        // a KDA per-head vector: A_log [HV], the other half zero
        const std::vector<float>& a = p.grads.at("model.layers.0.self_attn.A_log");
        for (size_t h = 0; h < a.size(); ++h)
            if (int64_t(h) / int64_t(a.size() / 2) != t) {
                EXPECT_EQ(a[h], 0.0f) << "rank " << t << " head " << h;
            }
    }
}

TEST(TensorParallel, WhatItDoesNotCoverIsAOneLineError) {
    auto refused = [](model::ModelConfig c, const std::string& needle) {
        std::mutex mu;
        std::string message;
        parallel::run_local(2, [&](parallel::Comm& world) {
            try {
                model::Model m(c, nullptr, 1, {}, &world);
            } catch (const Error& e) {
                std::lock_guard lock(mu);
                message = e.what();
            }
        });
        EXPECT_NE(message.find(needle), std::string::npos) << message;
        EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    };
    model::ModelConfig warmup = hybrid(2);
    warmup.mla.dsa.stage = "dense_warmup";
    refused(warmup, "does not cover model.mla.dsa.stage = \"dense_warmup\"");
    model::ModelConfig odd = hybrid(2);
    odd.n_kv_heads = 1;
    refused(odd, "parallel.tensor = 2 does not divide model.n_kv_heads = 1");
    model::ModelConfig dropout = hybrid(2);
    dropout.lora.rank = 4;
    dropout.lora.target_modules = {"q_proj"};
    dropout.lora.dropout = 0.1;
    refused(dropout, "model.lora.dropout");
    model::ModelConfig seq_aux = hybrid(2);
    seq_aux.moe.seq_aux_coeff = 1e-3;
    refused(seq_aux, "model.moe.seq_aux_coeff");
}

}  // namespace
}  // namespace tessera
