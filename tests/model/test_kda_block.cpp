// The KDA and GDN blocks against the PyTorch reference (tools/ref/kda_block.py, float64): output,
// input gradient and every parameter gradient, for the low-rank KDA layer (Kimi-Linear), the
// lower-bound / full-rank-gate layer (Kimi K3), GDN (scalar gate, SiLU output gate), and packed
// documents (the convolutions and the recurrence restart at each document).
#include <gtest/gtest.h>

#include "core/config_reader.h"
#include "core/safetensors.h"
#include "model/layers/block_rig.h"
#include "model/layers/kda_block.h"
#include "util/test_util.h"

namespace tessera {
namespace {

model::KdaConfig config_of(const Json& j) {
    model::KdaConfig c;
    c.d_model = j["d_model"];
    c.num_heads = j["num_heads"];
    c.num_v_heads = j["num_v_heads"];
    c.head_dim = j["head_dim"];
    c.head_v_dim = j["head_v_dim"];
    c.conv_size = j["conv_size"];
    c.scalar_gate = j["scalar_gate"];
    c.gate_rank = j["gate_rank"];
    c.gate_lower_bound = j["gate_lower_bound"];
    c.full_rank_output_gate = j["full_rank_output_gate"];
    c.output_gate_activation =
        j["output_gate_activation"] == "silu" ? ops::GateActivation::silu : ops::GateActivation::sigmoid;
    c.norm_eps = j["norm_eps"];
    c.o_norm_eps = j["o_norm_eps"];
    c.chunk_size = j["chunk_size"];
    return c;
}

class KdaBlockGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(KdaBlockGolden, OutputAndEveryGradientMatchPyTorch) {
    SafetensorsFile f(test::golden_path("layers/" + GetParam() + ".safetensors"));
    const model::KdaConfig cfg = config_of(Json::parse(f.metadata().at("config")));
    const int64_t B = std::stoll(f.metadata().at("batch")), T = std::stoll(f.metadata().at("seq"));
    std::vector<int64_t> cu;
    if (f.contains("cu_seqlens")) {
        Tensor t = f.load("cu_seqlens");
        cu.assign(t.ptr<int64_t>(), t.ptr<int64_t>() + t.numel());
    }
    const model::StepShape shape{B, T, cu};
    model::KdaBlock block(cfg, "");
    model::BlockRig rig(block, {B, T});
    for (auto& s : rig.specs) f.load_into("param." + s.name, rig.params.view(s.name));
    Tensor x = f.load("x"), out(DType::f32, x.shape()), dres = f.load("dy");
    block.forward(shape, x, out, rig.ws);
    EXPECT_TRUE(test::rel_rms_close(out, f.load("expected.out"), 1e-6)) << "out";
    block.backward(shape, x, dres, rig.ws);
    EXPECT_TRUE(test::rel_rms_close(dres, f.load("expected.dx"), 1e-5)) << "dx";
    // parameter gradients are f32 sums over every token: 3e-5 (measured up to 1.1e-5, on the lower-bound
    // gate's A_log and dt_bias, whose per-token terms are large and cancel)
    for (auto& s : rig.specs) {
        EXPECT_TRUE(test::rel_rms_close(rig.grads.view(s.name), f.load("expected.grad." + s.name), 3e-5)) << s.name;
    }
}

INSTANTIATE_TEST_SUITE_P(Layers,
                         KdaBlockGolden,
                         ::testing::Values("kda_low_rank", "kda_k3_style", "gdn", "kda_packed"));

TEST(KdaBlock, InitialisationFollowsTheSpec) {
    model::KdaConfig c;
    c.d_model = 64;
    c.num_heads = 2;
    c.head_dim = 32;
    model::KdaBlock softplus(c, "l."), lower(
                                           [&] {
                                               model::KdaConfig k = c;
                                               k.gate_lower_bound = -5.0;
                                               return k;
                                           }(),
                                           "l.");
    std::vector<BufferSpec> specs;
    std::vector<model::ParamInit> inits;
    softplus.declare_params(specs, inits);
    for (size_t i = 0; i < specs.size(); ++i) {
        if (specs[i].name == "l.self_attn.A_log") {
            EXPECT_EQ(inits[i].kind, model::ParamInit::Kind::log_uniform);
            EXPECT_FALSE(specs[i].weight_decay);
            EXPECT_NEAR(inits[i].value(0.0, 0.0), 0.0, 1e-12);             // ln 1
            EXPECT_NEAR(inits[i].value(1.0, 0.0), std::log(16.0), 1e-12);  // ln 16
        }
        if (specs[i].name == "l.self_attn.dt_bias") {
            EXPECT_FALSE(specs[i].weight_decay);
            // softplus(dt_bias) = dt, with dt in [1e-3, 1e-1]
            for (double u : {0.0, 0.5, 1.0}) {
                const double b = inits[i].value(u, 0.0), dt = std::log1p(std::exp(b));
                EXPECT_GE(dt, 1e-3 * (1 - 1e-9));
                EXPECT_LE(dt, 1e-1 * (1 + 1e-9));
            }
        }
    }
    specs.clear();
    inits.clear();
    lower.declare_params(specs, inits);
    for (size_t i = 0; i < specs.size(); ++i) {
        if (specs[i].name == "l.self_attn.A_log") {
            EXPECT_EQ(inits[i].value(0.3, 0.0), 0.0);  // 0 with the bound
        }
    }
}

}  // namespace
}  // namespace tessera
