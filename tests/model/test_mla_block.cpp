// The MLA / gated DSA block against the PyTorch reference (tools/ref/mla_ref.py, float64, MHA mode over a
// dense mask, no absorption): output, input gradient, every parameter gradient (LM loss for the trunk,
// kl_coeff × KL for the indexer) and the KL value; then the invariants of spec/dsa.md §5.3: top-k >= T is
// dense MLA, the detach rules, and thread-count independence.
#include <gtest/gtest.h>
#include <omp.h>

#include "core/config_reader.h"
#include "core/safetensors.h"
#include "model/layers/block_rig.h"
#include "model/layers/mla_block.h"
#include "util/test_util.h"

namespace tessera {
namespace {

model::MlaConfig config_of(const Json& j) {
    model::MlaConfig c;
    c.d_model = j["d_model"];
    c.num_heads = j["num_heads"];
    c.q_lora_rank = j["q_lora_rank"];
    c.kv_lora_rank = j["kv_lora_rank"];
    c.qk_nope_dim = j["qk_nope_dim"];
    c.qk_rope_dim = j["qk_rope_dim"];
    c.v_head_dim = j["v_head_dim"];
    c.rope = j["rope"];
    c.rope_theta = j["rope_theta"];
    c.softmax_scale = j["softmax_scale"];
    c.output_gate = j["output_gate"].get<std::string>();
    c.norm_eps = j["norm_eps"];
    c.latent_eps = j["latent_eps"];
    const Json& d = j["dsa"];
    c.dsa.topk = d["topk"];
    c.dsa.heads = d["heads"];
    c.dsa.head_dim = d["head_dim"];
    c.dsa.rope_dim = d["rope_dim"];
    c.dsa.stage = d["stage"].get<std::string>();
    c.dsa.kl_coeff = d["kl_coeff"];
    return c;
}

struct Golden {
    explicit Golden(const std::string& name)
        : f(test::golden_path("layers/" + name + ".safetensors")),
          cfg(config_of(Json::parse(f.metadata().at("config")))),
          B(std::stoll(f.metadata().at("batch"))),
          T(std::stoll(f.metadata().at("seq"))) {
        if (f.contains("cu_seqlens")) {
            Tensor t = f.load("cu_seqlens");
            cu.assign(t.ptr<int64_t>(), t.ptr<int64_t>() + t.numel());
        }
    }
    model::StepShape shape() const { return {B, T, cu}; }
    SafetensorsFile f;
    model::MlaConfig cfg;
    int64_t B, T;
    std::vector<int64_t> cu;
};

class MlaBlockGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(MlaBlockGolden, OutputGradientsAndKlMatchPyTorch) {
    Golden g(GetParam());
    model::MlaBlock block(g.cfg, "");
    model::BlockRig rig(block, {g.B, g.T});
    for (auto& s : rig.specs) g.f.load_into("param." + s.name, rig.params.view(s.name));
    Tensor x = g.f.load("x"), out(DType::f32, x.shape()), dres = g.f.load("dy");
    block.forward(g.shape(), x, out, rig.ws);
    EXPECT_TRUE(test::rel_rms_close(out, g.f.load("expected.out"), 1e-5)) << "out";
    block.backward(g.shape(), x, dres, rig.ws);
    EXPECT_TRUE(test::rel_rms_close(dres, g.f.load("expected.dx"), 1e-4)) << "dx";
    for (auto& s : rig.specs) {
        EXPECT_TRUE(test::rel_rms_close(rig.grads.view(s.name), g.f.load("expected.grad." + s.name), 1e-4)) << s.name;
    }
    if (g.f.contains("expected.kl")) {
        const model::DsaLayerStats st = block.take_stats();
        EXPECT_EQ(st.passes, 1);
        EXPECT_NEAR(st.kl, g.f.load("expected.kl").ptr<double>()[0], 1e-5 * (1 + st.kl));
        EXPECT_GT(st.kl, 0.0);
    }
}

INSTANTIATE_TEST_SUITE_P(Layers,
                         MlaBlockGolden,
                         ::testing::Values("mla_kimi_linear",
                                           "mla_k3_gated_nope",
                                           "mla_packed",
                                           "dsa_sparse",
                                           "dsa_sparse_no_qlora",
                                           "dsa_packed",
                                           "dsa_warmup"));

// Runs forward + backward of `cfg` with parameters initialised from `seed` (indexer weights only if present).
struct BlockRun {
    BlockRun(const model::MlaConfig& cfg, model::StepShape s, uint64_t seed, double dres_scale = 1.0)
        : block(cfg, "l."), rig(block, s) {
        for (auto& sp : rig.specs) {
            Tensor t = test::randn(DType::f32, sp.shape, seed + std::hash<std::string>{}(sp.name) % 1000);
            TensorView v = rig.params.view(sp.name);
            for (int64_t i = 0; i < v.numel(); ++i) {
                const bool norm = sp.name.find("norm.weight") != std::string::npos;
                v.ptr<float>()[i] = norm ? 1.f + 0.1f * t.ptr<float>()[i]
                                         : t.ptr<float>()[i] / std::sqrt(float(sp.shape[sp.shape.ndim - 1]));
            }
        }
        x = test::randn(DType::f32, Shape{s.tokens(), cfg.d_model}, seed + 7);
        out = Tensor(DType::f32, x.shape());
        dres = test::randn(DType::f32, x.shape(), seed + 8);
        for (int64_t i = 0; i < dres.numel(); ++i) dres.ptr<float>()[i] *= float(dres_scale);
        block.forward(s, x, out, rig.ws);
        block.backward(s, x, dres, rig.ws);
    }
    model::MlaBlock block;
    model::BlockRig rig;
    Tensor x, out, dres;
};

model::MlaConfig small(int64_t topk) {
    model::MlaConfig c;
    c.d_model = 32;
    c.num_heads = 4;
    c.q_lora_rank = 24;
    c.kv_lora_rank = 16;
    c.qk_nope_dim = 8;
    c.qk_rope_dim = 8;
    c.v_head_dim = 8;
    c.output_gate = "headwise";
    c.dsa.topk = topk;
    c.dsa.heads = 4;
    c.dsa.head_dim = 16;
    c.dsa.rope_dim = 8;
    return c;
}

TEST(MlaBlock, TopkAtLeastTheLengthIsDenseMla) {
    const model::StepShape s{2, 19};
    BlockRun dense(small(0), s, 5), dsa(small(19), s, 5);
    EXPECT_TRUE(test::rel_rms_close(dsa.out, dense.out, 1e-6)) << "out";
    EXPECT_TRUE(test::rel_rms_close(dsa.dres, dense.dres, 1e-5)) << "dx";
    for (auto& sp : dense.rig.specs) {
        EXPECT_TRUE(test::rel_rms_close(dsa.rig.grads.view(sp.name), dense.rig.grads.view(sp.name), 1e-5)) << sp.name;
    }
}

TEST(MlaBlock, LmLossNeverReachesTheIndexerAndKlNeverReachesTheTrunk) {
    const model::StepShape s{1, 40};
    model::MlaConfig c = small(6);
    c.dsa.kl_coeff = 0.0;
    BlockRun lm_only(c, s, 9);
    int indexer = 0;
    for (auto& sp : lm_only.rig.specs) {
        if (!lm_only.block.is_indexer_param(sp.name)) continue;
        ++indexer;
        TensorView g = lm_only.rig.grads.view(sp.name);
        for (int64_t i = 0; i < g.numel(); ++i) ASSERT_EQ(g.ptr<float>()[i], 0.f) << sp.name;
    }
    EXPECT_EQ(indexer, 5);
    c.dsa.kl_coeff = 1.0;
    BlockRun kl_only(c, s, 9, 0.0);  // zero LM gradient: only the KL acts
    for (auto& sp : kl_only.rig.specs) {
        TensorView g = kl_only.rig.grads.view(sp.name);
        double norm = 0;
        for (int64_t i = 0; i < g.numel(); ++i) norm += std::abs(g.ptr<float>()[i]);
        if (kl_only.block.is_indexer_param(sp.name)) {
            EXPECT_GT(norm, 0.0) << sp.name;
        } else {
            EXPECT_EQ(norm, 0.0) << sp.name;
        }
    }
    for (int64_t i = 0; i < kl_only.dres.numel(); ++i) ASSERT_EQ(kl_only.dres.ptr<float>()[i], 0.f);
}

TEST(MlaBlock, SparseBlockIsBitwiseIndependentOfTheThreadCount) {
    const model::StepShape s{2, 50};
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    BlockRun one(small(8), s, 3);
    omp_set_num_threads(std::max(2, threads));
    BlockRun many(small(8), s, 3);
    omp_set_num_threads(threads);
    EXPECT_TRUE(test::bitwise_equal(one.out, many.out));
    EXPECT_TRUE(test::bitwise_equal(one.dres, many.dres));
    for (auto& sp : one.rig.specs) {
        EXPECT_TRUE(test::bitwise_equal(one.rig.grads.view(sp.name), many.rig.grads.view(sp.name))) << sp.name;
    }
}

TEST(MlaBlock, BadConfigsSayWhatIsWrong) {
    model::MlaConfig c = small(8);
    c.output_gate = "vector";
    EXPECT_THROW(
        {
            try {
                model::MlaBlock b(c, "model.layers.3.");
            } catch (const Error& e) {
                EXPECT_NE(std::string(e.what()).find("model.layers.3.self_attn: output_gate"), std::string::npos)
                    << e.what();
                throw;
            }
        },
        Error);
    c = small(8);
    c.dsa.stage = "warmup";
    EXPECT_THROW(model::MlaBlock(c, ""), Error);
    c = small(8);
    c.dsa.rope_dim = 7;
    EXPECT_THROW(model::MlaBlock(c, ""), Error);
}

}  // namespace
}  // namespace tessera
