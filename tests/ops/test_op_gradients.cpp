// Finite-difference checks of every gradient of every op, in float64, through the op registry.
// L = Σ_out <y, r> for random r; the analytic d<input> from backward must match central differences
// of L on a sample of elements of every float input.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "ops/registry.h"
#include "util/test_util.h"

namespace tessera {
namespace {

struct GradCase {
    std::string name, op;
    std::map<std::string, std::string> params;
    std::function<std::map<std::string, Tensor>()> make_inputs;
    std::map<std::string, std::string> grad_of;  // output -> its gradient's input name
    std::set<std::string> constants = {};        // float inputs without a gradient (e.g. a router bias)
    friend void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }
};

Tensor ids_i64(std::vector<int64_t> v) {
    Tensor t(DType::i64, Shape{int64_t(v.size())});
    std::copy(v.begin(), v.end(), t.ptr<int64_t>());
    return t;
}

std::map<std::string, Tensor> make(std::initializer_list<std::pair<std::string, Shape>> specs, uint64_t seed) {
    std::map<std::string, Tensor> m;
    for (auto& [name, shape] : specs) m.emplace(name, test::randn(DType::f64, shape, seed++));
    return m;
}

std::vector<GradCase> grad_cases() {
    std::vector<GradCase> cs;
    cs.push_back({"linear",
                  "linear",
                  {},
                  [] {
                      return make({{"x", {5, 7}}, {"w", {4, 7}}, {"b", {4}}}, 1);
                  },
                  {{"y", "dy"}}});
    // LoRA, and with dropout: the same masks in forward and backward, so a fixed function of x
    for (const auto& [name, dropout] : {std::pair{"lora", "0"}, std::pair{"lora_dropout", "0.3"}}) {
        cs.push_back({name,
                      "lora",
                      {{"scale", "1.5"}, {"dropout", dropout}, {"seed", "7"}},
                      [] {
                          return make({{"x", {6, 9}}, {"a", {3, 9}}, {"b", {5, 3}}}, 41);
                      },
                      {{"y", "dy"}}});
    }
    cs.push_back({"embedding",
                  "embedding",
                  {},
                  [] {
                      auto m = make({{"table", {6, 5}}}, 2);
                      m.emplace("ids", ids_i64({1, 4, 1, 0, 5}));
                      return m;
                  },
                  {{"y", "dy"}}});
    cs.push_back({"rmsnorm",
                  "rmsnorm",
                  {{"eps", "1e-5"}},
                  [] {
                      return make({{"x", {4, 9}}, {"weight", {9}}}, 3);
                  },
                  {{"y", "dy"}}});
    cs.push_back({"layernorm",
                  "layernorm",
                  {{"eps", "1e-5"}},
                  [] {
                      return make({{"x", {4, 9}}, {"weight", {9}}, {"bias", {9}}}, 31);
                  },
                  {{"y", "dy"}}});
    cs.push_back({"attn_res_mix",
                  "attn_res_mix",
                  {{"eps", "1e-5"}},
                  [] {
                      return make({{"sources", {3, 4, 10}}, {"gamma", {10}}, {"w", {10}}}, 71);
                  },
                  {{"out", "dout"}}});
    cs.push_back({"swiglu", "swiglu", {}, [] { return make({{"gate", {3, 8}}, {"up", {3, 8}}}, 4); }, {{"y", "dy"}}});
    cs.push_back({"cross_entropy",
                  "cross_entropy",
                  {},
                  [] {
                      auto m = make({{"logits", {6, 11}}}, 5);
                      m.emplace("targets", ids_i64({3, -100, 0, 10, 7, 7}));
                      return m;
                  },
                  {{"loss", "dloss"}}});
    cs.push_back({"rope",
                  "rope",
                  {{"theta", "500"}, {"offset", "3"}},
                  [] {
                      return make({{"x", {2, 5, 3, 8}}}, 6);
                  },
                  {{"y", "dy"}}});
    cs.push_back({"rope_yarn",
                  "rope",
                  {{"theta", "500"},
                   {"offset", "40"},
                   {"scaling", "yarn"},
                   {"factor", "4"},
                   {"original_max_position", "16"},
                   {"mscale", "2"},
                   {"mscale_all_dim", "1"}},
                  [] {
                      return make({{"x", {1, 4, 2, 16}}}, 62);
                  },
                  {{"y", "dy"}}});
    cs.push_back({"rope_interleaved",
                  "rope",
                  {{"theta", "50"}, {"layout", "interleaved"}},
                  [] {
                      return make({{"x", {1, 6, 2, 8}}}, 61);
                  },
                  {{"y", "dy"}}});
    for (std::string act : {"silu", "none"}) {
        cs.push_back({"causal_conv1d_" + act,
                      "causal_conv1d",
                      {{"activation", act}},
                      [] {
                          return make({{"x", {2, 7, 5}}, {"w", {5, 4}}}, 7);
                      },
                      {{"y", "dy"}}});
    }
    cs.push_back({"attention_gqa",
                  "attention",
                  {},
                  [] {
                      return make({{"q", {2, 9, 4, 8}}, {"k", {2, 9, 2, 8}}, {"v", {2, 9, 2, 8}}}, 8);
                  },
                  {{"o", "do"}}});
    cs.push_back({"attention_noncausal",
                  "attention",
                  {{"causal", "0"}},
                  [] {
                      return make({{"q", {1, 6, 2, 4}}, {"k", {1, 6, 1, 4}}, {"v", {1, 6, 1, 4}}}, 9);
                  },
                  {{"o", "do"}}});
    cs.push_back({"attention_tiles",
                  "attention",
                  {{"scale", "0.2"}},
                  [] {
                      return make({{"q", {1, 270, 1, 4}}, {"k", {1, 270, 1, 4}}, {"v", {1, 270, 1, 4}}}, 10);
                  },
                  {{"o", "do"}}});
    // KDA family: every input of kda (incl. g, beta, h0) in chunk and recurrent mode, partial chunks,
    // GVA (HV = 2·H) and packed sequences; gate forms; norms
    for (std::string mode : {"chunk", "recurrent"}) {
        cs.push_back(
            {"kda_" + mode,
             "kda",
             {{"mode", mode}, {"chunk_size", "32"}},
             [] {
                 auto m =
                     make({{"q", {2, 37, 1, 6}}, {"k", {2, 37, 1, 6}}, {"v", {2, 37, 2, 5}}, {"h0", {2, 2, 6, 5}}}, 12);
                 m.emplace("g", test::uniform(DType::f64, Shape{2, 37, 2, 6}, 13, -0.6, 0.0));
                 m.emplace("beta", test::uniform(DType::f64, Shape{2, 37, 2}, 14, 0.1, 0.9));
                 return m;
             },
             {{"o", "do"}, {"ht", "dht"}}});
    }
    cs.push_back({"kda_varlen",
                  "kda",
                  {{"chunk_size", "32"}},
                  [] {
                      auto m = make(
                          {{"q", {1, 50, 1, 4}}, {"k", {1, 50, 1, 4}}, {"v", {1, 50, 1, 3}}, {"h0", {3, 1, 4, 3}}}, 15);
                      m.emplace("g", test::uniform(DType::f64, Shape{1, 50, 1, 4}, 16, -1.0, 0.0));
                      m.emplace("beta", test::uniform(DType::f64, Shape{1, 50, 1}, 17, 0.1, 0.9));
                      Tensor cu(DType::i64, Shape{4});
                      const int64_t v[4] = {0, 7, 40, 50};
                      std::copy(v, v + 4, cu.ptr<int64_t>());
                      m.emplace("cu_seqlens", std::move(cu));
                      return m;
                  },
                  {{"o", "do"}, {"ht", "dht"}}});
    for (std::string lb : {"0", "-5"}) {
        cs.push_back({"kda_gate_lb" + std::string(lb == "0" ? "0" : "5"),
                      "kda_gate",
                      {{"lower_bound", lb}},
                      [] {
                          return make({{"f", {3, 2, 4}}, {"A_log", {2}}, {"dt_bias", {2, 4}}}, 18);
                      },
                      {{"g", "dg"}}});
    }
    cs.push_back({"l2norm", "l2norm", {}, [] { return make({{"x", {4, 7}}}, 19); }, {{"y", "dy"}}});
    for (std::string act : {"sigmoid", "silu"}) {
        cs.push_back({"gated_rmsnorm_" + act,
                      "gated_rmsnorm",
                      {{"activation", act}},
                      [] {
                          return make({{"x", {5, 8}}, {"gate", {5, 8}}, {"weight", {8}}}, 20);
                      },
                      {{"y", "dy"}}});
    }
    // MoE family: routing held fixed (random scores have gaps far above the 1e-6 steps); the
    // selection-only router bias gets no gradient
    cs.push_back({"situ_glu",
                  "situ_glu",
                  {},
                  [] {
                      return make({{"gate", {3, 9}}, {"up", {3, 9}}}, 21);
                  },
                  {{"y", "dy"}}});
    cs.push_back({"router_groups",
                  "router",
                  {{"topk", "3"}, {"score", "sigmoid"}, {"scaling", "2"}, {"groups", "4"}, {"topk_groups", "2"}},
                  [] {
                      return make({{"x", {6, 5}}, {"w", {8, 5}}, {"bias", {8}}}, 22);
                  },
                  {{"weights", "dweights"}},
                  {"bias"}});
    cs.push_back({"router_softmax_plain",
                  "router",
                  {{"topk", "2"}, {"normalize", "0"}},
                  [] {
                      return make({{"x", {6, 5}}, {"w", {7, 5}}}, 23);
                  },
                  {{"weights", "dweights"}}});
    cs.push_back({"moe_latent_shared_situ",
                  "moe",
                  {{"topk", "3"}, {"score", "sigmoid"}, {"groups", "2"}, {"activation", "situ"}},
                  [] {
                      return make({{"x", {9, 6}},
                                   {"router_w", {8, 6}},
                                   {"router_bias", {8}},
                                   {"w_gate", {8, 5, 4}},
                                   {"w_up", {8, 5, 4}},
                                   {"w_down", {8, 4, 5}},
                                   {"latent_down", {4, 6}},
                                   {"latent_up", {6, 4}},
                                   {"latent_norm", {4}},
                                   {"shared_gate", {7, 6}},
                                   {"shared_up", {7, 6}},
                                   {"shared_down", {6, 7}}},
                                  24);
                  },
                  {{"y", "dy"}},
                  {"router_bias"}});
    cs.push_back({"moe_capacity_aux",
                  "moe",
                  {{"topk", "2"}, {"capacity_factor", "1"}, {"seq_aux_coeff", "0.1"}, {"z_loss_coeff", "0.01"}},
                  [] {
                      auto m = make({{"x", {12, 5}},
                                     {"router_w", {4, 5}},
                                     {"w_gate", {4, 3, 5}},
                                     {"w_up", {4, 3, 5}},
                                     {"w_down", {4, 5, 3}}},
                                    25);
                      Tensor cu(DType::i64, Shape{3});
                      const int64_t v[3] = {0, 5, 12};
                      std::copy(v, v + 3, cu.ptr<int64_t>());
                      m.emplace("cu_seqlens", std::move(cu));
                      return m;
                  },
                  {{"y", "dy"}, {"aux_loss", "daux_loss"}}});
    for (const char* score : {"softmax", "sigmoid"}) {  // the global balance loss (Qwen3-Next's, pooled over N)
        cs.push_back({std::string("moe_global_aux_") + score,
                      "moe",
                      {{"topk", "2"}, {"score", score}, {"global_aux_coeff", "0.5"}},
                      [] {
                          return make({{"x", {10, 5}},
                                       {"router_w", {4, 5}},
                                       {"w_gate", {4, 3, 5}},
                                       {"w_up", {4, 3, 5}},
                                       {"w_down", {4, 5, 3}}},
                                      29);
                      },
                      {{"y", "dy"}, {"aux_loss", "daux_loss"}}});
    }
    // DSA family: indices fixed (an i32 input); the KL's target p gets no gradient
    auto dsa_indices = [](int64_t T, int64_t K) {
        Tensor idx(DType::i32, Shape{1, T, K});
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t i = 0; i < K; ++i)
                idx.ptr<int32_t>()[t * K + i] = i <= t ? int32_t((t * 7 + i * 3) % (t + 1)) : -1;
        }
        return idx;
    };
    cs.push_back({"sparse_attention",
                  "sparse_attention",
                  {{"dv", "5"}, {"dkv_slabs", "3"}},
                  [dsa_indices] {
                      auto m = make({{"q", {1, 9, 2, 7}}, {"kv", {1, 9, 7}}}, 26);
                      m.emplace("indices", dsa_indices(9, 4));
                      return m;
                  },
                  {{"o", "do"}}});
    cs.push_back({"indexer_kl_sparse",
                  "indexer_kl",
                  {},
                  [dsa_indices] {
                      auto m = make({{"q", {1, 8, 2, 5}}, {"k", {1, 8, 5}}, {"w", {1, 8, 2}}}, 27);
                      Tensor idx = dsa_indices(8, 3);
                      Tensor p = test::uniform(DType::f64, Shape{1, 8, 3}, 28, 0.1, 1.0);
                      for (int64_t i = 0; i < 24; ++i) {
                          if (idx.ptr<int32_t>()[i] < 0) p.ptr<double>()[i] = 0.0;
                      }
                      m.emplace("indices", std::move(idx));
                      m.emplace("p", std::move(p));
                      return m;
                  },
                  {{"loss", "dloss"}},
                  {"p"}});
    cs.push_back({"indexer_kl_dense",
                  "indexer_kl",
                  {},
                  [] {
                      auto m = make({{"q", {1, 7, 2, 4}}, {"k", {1, 7, 4}}, {"w", {1, 7, 2}}}, 29);
                      m.emplace("p", test::uniform(DType::f64, Shape{1, 7, 7}, 30, 0.0, 1.0));
                      return m;
                  },
                  {{"loss", "dloss"}},
                  {"p"}});
    return cs;
}

class OpGradient : public ::testing::TestWithParam<GradCase> {};

double objective(const ops::OpDef& op,
                 const std::map<std::string, Tensor>& inputs,
                 const GradCase& c,
                 const std::map<std::string, Tensor>& r) {
    std::map<std::string, Tensor> in;
    for (auto& [k, v] : inputs) in.emplace(k, Tensor::copy_of(v));
    auto out = ops::run_op(op, std::move(in), c.params);
    double L = 0;
    for (auto& [y, g] : c.grad_of) {
        const Tensor& yt = out.at(y);
        for (int64_t i = 0; i < yt.numel(); ++i) L += yt.ptr<double>()[i] * r.at(g).ptr<double>()[i];
    }
    return L;
}

TEST_P(OpGradient, MatchesCentralDifferences) {
    const GradCase& c = GetParam();
    const ops::OpDef* op = ops::op_registry().find(c.op);
    ASSERT_NE(op, nullptr);
    std::map<std::string, Tensor> inputs = c.make_inputs();
    // output gradients r, shaped like the outputs
    auto probe = ops::run_op(
        *op,
        [&] {
            std::map<std::string, Tensor> in;
            for (auto& [k, v] : inputs) in.emplace(k, Tensor::copy_of(v));
            return in;
        }(),
        c.params);
    std::map<std::string, Tensor> r;
    uint64_t seed = 100;
    for (auto& [y, g] : c.grad_of) r.emplace(g, test::randn(DType::f64, probe.at(y).shape(), seed++));
    std::map<std::string, Tensor> with_grads;
    for (auto& [k, v] : inputs) with_grads.emplace(k, Tensor::copy_of(v));
    for (auto& [k, v] : r) with_grads.emplace(k, Tensor::copy_of(v));
    auto analytic = ops::run_op(*op, std::move(with_grads), c.params);

    int checked = 0;
    for (auto& [name, x] : inputs) {
        if (x.dtype() != DType::f64 || c.constants.count(name)) continue;
        ASSERT_TRUE(analytic.count("d" + name)) << "backward did not write d" << name;
        const Tensor& g = analytic.at("d" + name);
        const int64_t n = x.numel();
        const int64_t stride = std::max<int64_t>(1, n / 24);
        for (int64_t i = 0; i < n; i += stride) {
            const double h = 1e-6;
            double* p = x.ptr<double>() + i;
            const double x0 = *p;
            *p = x0 + h;
            double lp = objective(*op, inputs, c, r);
            *p = x0 - h;
            double lm = objective(*op, inputs, c, r);
            *p = x0;
            const double fd = (lp - lm) / (2 * h);
            const double an = g.ptr<double>()[i];
            EXPECT_NEAR(an, fd, 1e-6 * std::max(1.0, std::abs(fd)))
                << c.name << ": d" << name << "[" << i << "] analytic " << an << " vs finite difference " << fd;
            ++checked;
        }
    }
    EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Ops, OpGradient, ::testing::ValuesIn(grad_cases()), [](const auto& info) {
    return info.param.name;
});

}  // namespace
}  // namespace tessera
