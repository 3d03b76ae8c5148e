// Op-runner bindings of the KDA family: kda, kda_gate, l2norm, gated_rmsnorm (docs/ops.md).
#include <omp.h>

#include "ops/bindings/bindings.h"
#include "ops/gated_rmsnorm.h"
#include "ops/kda.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"

namespace tessera::ops {

namespace {
void run_kda(OpContext& c) {
    const KdaParams p{.scale = c.param_f64("scale"),
                      .chunk_size = c.param_i64("chunk_size"),
                      .mode = c.param_str("mode") == "recurrent" ? KdaMode::recurrent : KdaMode::chunk};
    const KdaInputs in{
        c.in("q"), c.in("k"), c.in("v"), c.in("g"), c.in("beta"), c.in_or_absent("h0"), c.index_span("cu_seqlens")};
    TESSERA_CHECK(in.q.ndim() == 4 && in.v.ndim() == 4, "q must be [B, T, H, K] and v [B, T, HV, V]");
    const int64_t N = in.cu_seqlens.empty() ? in.q.size(0) : int64_t(in.cu_seqlens.size()) - 1;
    const bool backward = c.has("do") || c.has("dht");
    auto ws = c.workspace(kda_workspace_bytes(p, in, backward, omp_get_max_threads()));
    TensorView o = c.out_like("o", in.v);
    TensorView ht = c.out("ht", in.q.dtype, Shape{N, in.v.size(2), in.q.size(3), in.v.size(3)});
    kda_forward(p, in, o, ht, ws);
    if (!backward) return;
    const KdaGrads g{c.out_like("dq", in.q),       c.out_like("dk", in.k),
                     c.out_like("dv", in.v),       c.out_like("dg", in.g),
                     c.out_like("dbeta", in.beta), in.h0.defined() ? c.out_like("dh0", in.h0) : TensorView()};
    kda_backward(p, in, c.in_or_absent("do"), c.in_or_absent("dht"), g, ws);
}

void run_kda_gate(OpContext& c) {
    const KdaGateParams p{.lower_bound = c.param_f64("lower_bound")};
    TensorView f = c.in("f"), A = c.in("A_log"), b = c.in("dt_bias");
    kda_gate_forward(p, f, A, b, c.out_like("g", f));
    if (c.has("dg")) {
        kda_gate_backward(p, c.in("dg"), f, A, b, c.out_like("df", f), c.out_like("dA_log", A),
                          c.out_like("ddt_bias", b));
    }
}

void run_l2norm(OpContext& c) {
    const L2NormParams p{.eps = c.param_f64("eps")};
    TensorView x = c.in("x");
    l2norm_forward(p, x, c.out_like("y", x));
    if (c.has("dy")) l2norm_backward(p, c.in("dy"), x, c.out_like("dx", x));
}

void run_gated_rmsnorm(OpContext& c) {
    const GatedRmsNormParams p{
        .eps = c.param_f64("eps"),
        .activation = c.param_str("activation") == "silu" ? GateActivation::silu : GateActivation::sigmoid};
    TensorView x = c.in("x"), z = c.in("gate"), w = c.in("weight");
    gated_rmsnorm_forward(p, x, z, w, c.out_like("y", x));
    if (c.has("dy")) {
        gated_rmsnorm_backward(p, c.in("dy"), x, z, w, c.out_like("dx", x), c.out_like("dgate", z),
                               c.out_like("dweight", w));
    }
}
}  // namespace

void register_kda_ops(OpRegistry& r) {
    r.add({"kda",
           "Kimi Delta Attention: gated delta rule with per-channel decay (fla naive_recurrent_kda semantics)",
           {{"q", "[B, T, H, K]"},
            {"k", "[B, T, H, K]"},
            {"v", "[B, T, HV, V]"},
            {"g", "[B, T, HV, K]"},
            {"beta", "[B, T, HV]"},
            {"h0", "[N, HV, K, V]", true},
            {"cu_seqlens", "[N+1] i64, B = 1", true},
            {"do", "[B, T, HV, V]", true},
            {"dht", "[N, HV, K, V]", true}},
           {{"scale", ParamKind::number, "0", {}, "0 = K^-0.5", 0, HUGE_VAL},
            {"chunk_size", ParamKind::integer, "64", {}, "32 or 64", 32, 64},
            {"mode", ParamKind::choice, "chunk", {"chunk", "recurrent"}, ""}},
           {"o", "ht"},
           {"given do and/or dht: dq, dk, dv, dg, dbeta, dh0 (dh0 when h0 is given)"},
           run_kda,
           /*cuda=*/true});
    r.add({"kda_gate",
           "KDA forget gate: -exp(A_log)·softplus(f + dt_bias), or lower_bound·σ(exp(A_log)·(f + dt_bias))",
           {{"f", "[..., HV, K]"}, {"A_log", "[HV]"}, {"dt_bias", "[HV, K]"}, {"dg", "[..., HV, K]", true}},
           {{"lower_bound", ParamKind::number, "0", {}, "0 = softplus form; < 0 = safe form", -HUGE_VAL, 0}},
           {"g"},
           {"given dg: df, dA_log, ddt_bias"},
           run_kda_gate,
           /*cuda=*/true});
    r.add({"l2norm",
           "y = x / sqrt(Σx² + eps)",
           {{"x", "[N, D]"}, {"dy", "[N, D]", true}},
           {{"eps", ParamKind::number, "1e-6", {}, "inside the sqrt", 0, HUGE_VAL}},
           {"y"},
           {"given dy: dx"},
           run_l2norm,
           /*cuda=*/true});
    r.add({"gated_rmsnorm",
           "y = rmsnorm(x)·weight·act(gate), act = sigmoid (KDA) or silu (GDN)",
           {{"x", "[N, D]"}, {"gate", "[N, D]"}, {"weight", "[D]"}, {"dy", "[N, D]", true}},
           {{"eps", ParamKind::number, "1e-5", {}, "", 0, HUGE_VAL},
            {"activation", ParamKind::choice, "sigmoid", {"sigmoid", "silu"}, ""}},
           {"y"},
           {"given dy: dx, dgate, dweight"},
           run_gated_rmsnorm,
           /*cuda=*/true});
}

}  // namespace tessera::ops
