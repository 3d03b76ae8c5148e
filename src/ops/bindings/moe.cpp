// Op-runner bindings of the MoE family: router, moe, situ_glu (docs/ops.md, docs/moe.md).
#include <memory>

#include "core/device.h"
#include "ops/bindings/bindings.h"
#include "ops/linear.h"
#include "ops/moe.h"

namespace tessera::ops {

namespace {
RouterParams router_params(const OpContext& c) {
    return {.topk = c.param_i64("topk"),
            .score = c.param_str("score") == "sigmoid" ? RouterScore::sigmoid : RouterScore::softmax,
            .normalize = c.param_i64("normalize") != 0,
            .scaling = c.param_f64("scaling"),
            .groups = c.param_i64("groups"),
            .topk_groups = c.param_i64("topk_groups")};
}

std::vector<OpParamSpec> router_param_specs() {
    return {{"topk", ParamKind::integer, "2", {}, "experts per token", 1, 1 << 16},
            {"score", ParamKind::choice, "softmax", {"softmax", "sigmoid"}, ""},
            {"normalize", ParamKind::integer, "1", {}, "1 = gates renormalised over the chosen set", 0, 1},
            {"scaling", ParamKind::number, "1", {}, "routed scaling factor"},
            {"groups", ParamKind::integer, "1", {}, "expert groups (1 = no group limit)", 1, 1 << 16},
            {"topk_groups", ParamKind::integer, "1", {}, "groups kept per token", 1, 1 << 16}};
}

void run_router(OpContext& c) {
    const RouterParams p = router_params(c);
    TensorView x = c.in("x"), w = c.in("w"), bias = c.in_or_absent("bias");
    TESSERA_CHECK(x.ndim() == 2 && w.ndim() == 2, "x must be [N, D] and w [E, D]");
    const int64_t N = x.size(0), E = w.size(0);
    TensorView logits = c.out("logits", x.dtype, Shape{N, E}), scores = c.out("scores", x.dtype, Shape{N, E});
    TensorView indices = c.out("indices", DType::i32, Shape{N, p.topk});
    TensorView weights = c.out("weights", x.dtype, Shape{N, p.topk});
    router_scores(p, x, w, logits, scores);
    router_select(p, scores, bias, indices, weights, c.out("counts", DType::i32, Shape{E}));
    if (!c.has("dweights")) return;
    Tensor ds(x.dtype, Shape{N, E}, x.device), du(x.dtype, Shape{N, E}, x.device);
    router_weights_backward(p, c.in("dweights"), scores, indices, ds.view());
    router_score_backward(p, scores, ds.view(), du.view());
    linear_backward(du.view(), x, w, c.out_like("dx", x), c.out_like("dw", w), {});
}

void run_moe(OpContext& c) {
    MoeParams p{.router = router_params(c),
                .capacity_factor = c.param_f64("capacity_factor"),
                .overflow = c.param_str("overflow") == "drop" ? MoeOverflow::drop : MoeOverflow::reroute,
                .activation = c.param_str("activation") == "situ" ? ExpertActivation::situ : ExpertActivation::swiglu,
                .situ = {.beta = c.param_f64("situ_beta"), .linear_beta = c.param_f64("situ_linear_beta")},
                .norm_eps = c.param_f64("norm_eps"),
                .seq_aux_coeff = c.param_f64("seq_aux_coeff"),
                .z_loss_coeff = c.param_f64("z_loss_coeff")};
    const MoeWeights w{c.in("router_w"),
                       c.in_or_absent("router_bias"),
                       c.in("w_gate"),
                       c.in("w_up"),
                       c.in("w_down"),
                       c.in_or_absent("latent_down"),
                       c.in_or_absent("latent_up"),
                       c.in_or_absent("latent_norm"),
                       c.in_or_absent("shared_gate"),
                       c.in_or_absent("shared_up"),
                       c.in_or_absent("shared_down")};
    TensorView x = c.in("x");
    TESSERA_CHECK(x.ndim() == 2, "x must be [N, D], not {}", x.shape.str());
    const int64_t N = x.size(0);
    const MoeDims d = moe_dims(p, w, N);
    const MoeBuffers buffers = moe_buffers(d, x.dtype, x.device);
    const MoeSaved& s = buffers.saved;
    const MoeScratch& t = buffers.scratch;
    const auto starts = c.index_span("cu_seqlens");
    const MoeStats st = moe_forward(p, w, x, c.out_like("y", x), false, s, t, starts);
    auto copy_out = [&](const std::string& name, TensorView v) {
        copy_bytes(c.out(name, v.dtype, v.shape).data, x.device, v.data, v.device, v.nbytes());
    };
    copy_out("counts", s.counts);
    copy_out("demand", s.demand);
    copy_out("indices", s.expert);
    copy_out("weights", s.gates);
    c.set_value("rerouted", DType::i64, Shape{1}, double(st.rerouted));
    c.set_value("dropped", DType::i64, Shape{1}, double(st.dropped));
    // the global balance loss of this one layer: its choices and scores pooled over the N tokens (ops/router.h)
    const double global_coeff = c.param_f64("global_aux_coeff");
    std::vector<double> choices(size_t(d.experts)), prob_sums(size_t(d.experts)), balance_grad(size_t(d.experts));
    double global = 0;
    if (global_coeff != 0) {
        router_balance_stats(s.scores.slice0(0, N), s.choice.slice0(0, N), choices, prob_sums);
        global = router_global_aux_loss(global_coeff, choices, prob_sums, double(N), balance_grad);
    }
    c.set_value("aux_loss", x.dtype, Shape{1}, st.seq_aux_loss + st.z_loss + global);
    if (!c.has("dy") && !c.has("daux_loss")) return;
    // The aux losses' gradients are linear in their weights: scale them by the loss's output gradient.
    double aux_scale = 0.0;
    if (c.has("daux_loss")) {  // a scalar: a [0]-shaped one was read out of bounds
        const TensorView d = c.in("daux_loss");
        TESSERA_CHECK(d.numel() == 1 && d.dtype == x.dtype, "daux_loss must be one {} value, not {} {}",
                      dtype_name(x.dtype), dtype_name(d.dtype), d.shape.str());
        aux_scale = c.host_value("daux_loss");
    }
    p.seq_aux_coeff *= aux_scale;
    p.z_loss_coeff *= aux_scale;
    for (double& g : balance_grad) g *= aux_scale;
    if (global_coeff != 0) p.balance_grad = balance_grad;
    Tensor zero_dy(x.dtype, x.shape, x.device);
    TensorView dy = c.has("dy") ? c.in("dy") : zero_dy.view();
    auto grad = [&](const char* name, const TensorView& v) {
        return v.defined() ? c.out_like(std::string("d") + name, v) : TensorView();
    };
    const MoeWeights g{grad("router_w", w.router_w),       {},
                       grad("w_gate", w.w_gate),           grad("w_up", w.w_up),
                       grad("w_down", w.w_down),           grad("latent_down", w.latent_down),
                       grad("latent_up", w.latent_up),     grad("latent_norm", w.latent_norm),
                       grad("shared_gate", w.shared_gate), grad("shared_up", w.shared_up),
                       grad("shared_down", w.shared_down)};
    moe_backward(p, w, x, dy, c.out_like("dx", x), g, s, t, starts);
}

void run_situ_glu(OpContext& c) {
    const SituParams p{.beta = c.param_f64("beta"), .linear_beta = c.param_f64("linear_beta")};
    TensorView g = c.in("gate"), u = c.in("up");
    situ_glu_forward(p, g, u, c.out_like("y", g));
    if (c.has("dy")) situ_glu_backward(p, c.in("dy"), g, u, c.out_like("dgate", g), c.out_like("dup", u));
}
}  // namespace

void register_moe_ops(OpRegistry& r) {
    r.add({"router",
           "MoE router: scores, selection-only bias, group-limited top-k, gate weights",
           {{"x", "[N, D]"}, {"w", "[E, D]"}, {"bias", "[E]", true}, {"dweights", "[N, TOPK]", true}},
           router_param_specs(),
           {"indices", "weights", "counts", "logits", "scores"},
           {"given dweights: dx, dw"},
           run_router,
           /*cuda=*/true});
    std::vector<OpParamSpec> moe_params = router_param_specs();
    moe_params.push_back({"capacity_factor", ParamKind::number, "0", {}, "0 = dropless", 0, 1e6});
    moe_params.push_back({"overflow", ParamKind::choice, "reroute", {"reroute", "drop"}, ""});
    moe_params.push_back({"activation", ParamKind::choice, "swiglu", {"swiglu", "situ"}, ""});
    moe_params.push_back({"situ_beta", ParamKind::number, "4", {}, "", 1e-6, HUGE_VAL});
    moe_params.push_back({"situ_linear_beta", ParamKind::number, "25", {}, "", 1e-6, HUGE_VAL});
    moe_params.push_back({"norm_eps", ParamKind::number, "1e-6", {}, "latent_norm", 0, HUGE_VAL});
    moe_params.push_back(
        {"seq_aux_coeff", ParamKind::number, "0", {}, "sequence-wise balance loss weight", 0, HUGE_VAL});
    moe_params.push_back({"global_aux_coeff",
                          ParamKind::number,
                          "0",
                          {},
                          "global balance loss weight (pooled over the N tokens)",
                          0,
                          HUGE_VAL});
    moe_params.push_back({"z_loss_coeff", ParamKind::number, "0", {}, "router z-loss weight", 0, HUGE_VAL});
    r.add({"moe",
           "(Latent)MoE layer: router, capacity/re-routing, grouped SwiGLU or SiTU experts, latent projections, "
           "shared expert",
           {{"x", "[N, D]"},
            {"router_w", "[E, D]"},
            {"router_bias", "[E]", true},
            {"w_gate", "[E, F, L]"},
            {"w_up", "[E, F, L]"},
            {"w_down", "[E, L, F]"},
            {"latent_down", "[L, D]", true},
            {"latent_up", "[D, L]", true},
            {"latent_norm", "[L]", true},
            {"shared_gate", "[FS, D]", true},
            {"shared_up", "[FS, D]", true},
            {"shared_down", "[D, FS]", true},
            {"cu_seqlens", "[S+1] i64: sequences for the balance loss", true},
            {"dy", "[N, D]", true},
            {"daux_loss", "[1]", true}},
           moe_params,
           {"y", "counts", "demand", "indices", "weights", "rerouted", "dropped", "aux_loss"},
           {"given dy and/or daux_loss: dx and d<weight> for every weight but router_bias"},
           run_moe,
           /*cuda=*/true});
    r.add({"situ_glu",
           "Kimi K3 SiTU-GLU: y = [β·tanh(gate/β)·σ(gate)] · [β_lin·tanh(up/β_lin)]",
           {{"gate", "[N, F]"}, {"up", "[N, F]"}, {"dy", "[N, F]", true}},
           {{"beta", ParamKind::number, "4", {}, "", 1e-6, HUGE_VAL},
            {"linear_beta", ParamKind::number, "25", {}, "", 1e-6, HUGE_VAL}},
           {"y"},
           {"given dy: dgate, dup"},
           run_situ_glu,
           /*cuda=*/true});
}

}  // namespace tessera::ops
