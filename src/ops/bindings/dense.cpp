// Op-runner bindings of the dense ops: tensor names and parameters of `tessera op` (see docs/ops.md).
// Each binding runs forward, then backward when the file holds the output gradient d<output>.
#include <omp.h>

#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/attn_res.h"
#include "ops/bindings/bindings.h"
#include "ops/causal_conv1d.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/layernorm.h"
#include "ops/linear.h"
#include "ops/lora.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace tessera::ops {

namespace {
// a parameter and its accepted range [lo, hi]
OpParamSpec number(std::string name, std::string def, double lo, double hi, std::string doc = {}) {
    return {std::move(name), ParamKind::number, std::move(def), {}, std::move(doc), lo, hi};
}
OpParamSpec integer(std::string name, std::string def, double lo, double hi, std::string doc = {}) {
    return {std::move(name), ParamKind::integer, std::move(def), {}, std::move(doc), lo, hi};
}
constexpr double kInf = HUGE_VAL;

void run_linear(OpContext& c) {
    TensorView x = c.in("x"), w = c.in("w"), b = c.in_or_absent("b");
    TESSERA_CHECK(x.ndim() == 2 && w.ndim() == 2, "x must be [N, IN] and w [OUT, IN]");
    TensorView y = c.out("y", c.float_dtype(), Shape{x.size(0), w.size(0)});
    linear_forward({}, x, w, b, y);
    if (!c.has("dy")) return;
    TensorView db = b.defined() ? c.out_like("db", b) : TensorView();
    linear_backward(c.in("dy"), x, w, c.out_like("dx", x), c.out_like("dw", w), db);
}

void run_lora(OpContext& c) {
    TensorView x = c.in("x"), a = c.in("a"), b = c.in("b");
    TESSERA_CHECK(x.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "x must be [N, IN], a [r, IN] and b [OUT, r]");
    const LoraParams p{.scale = c.param_f64("scale"),
                       .dropout = c.param_f64("dropout"),
                       .seed = uint64_t(c.param_i64("seed")),
                       .stream = 1};
    const int64_t N = x.size(0), r = a.size(0);
    Tensor u(x.dtype, Shape{N, r}, x.device), du(x.dtype, Shape{N, r}, x.device), xd(x.dtype, x.shape, x.device);
    lora_forward(p, x, a, b, u.view(), c.out("y", x.dtype, Shape{N, b.size(0)}), xd.view());
    if (c.has("dy"))
        lora_backward(p, x, c.in("dy"), a, b, u.view(), du.view(), c.out_like("dx", x), c.out_like("da", a),
                      c.out_like("db", b), xd.view());
}

void run_lora_experts(OpContext& c) {
    TensorView x = c.in("x"), a = c.in("a"), b = c.in("b");
    TESSERA_CHECK(x.ndim() == 2 && a.ndim() == 3 && b.ndim() == 3, "x must be [R, IN], a [E, r, IN] and b [E, OUT, r]");
    const std::span<const int64_t> off = c.index_span("offsets");
    const int64_t E = a.size(0), R = x.size(0), r = a.size(1);
    TESSERA_CHECK(int64_t(off.size()) == E + 1 && off.front() == 0 && off.back() == R,
                  "offsets must be [E + 1] = [{}] from 0 to the {} rows", E + 1, R);
    std::vector<int32_t> offsets(off.begin(), off.end());
    for (int64_t e = 0; e < E; ++e) TESSERA_CHECK(off[e + 1] >= off[e], "offsets must not decrease (entry {})", e + 1);
    const ExpertRows g{offsets.data(), E};
    const LoraParams p{.scale = c.param_f64("scale")};
    Tensor u(x.dtype, Shape{R, r}, x.device), du(x.dtype, Shape{R, r}, x.device);
    lora_grouped_forward(p, g, x, a, b, u.view(), c.out("y", x.dtype, Shape{R, b.size(1)}));
    if (c.has("dy"))
        lora_grouped_backward(p, g, x, c.in("dy"), a, b, u.view(), du.view(), c.out_like("dx", x), c.out_like("da", a),
                              c.out_like("db", b));
}

void run_embedding(OpContext& c) {
    TensorView ids = c.in("ids"), table = c.in("table");
    TESSERA_CHECK(table.ndim() == 2, "table must be [V, D]");
    embedding_forward(ids, table, c.out("y", table.dtype, Shape{ids.numel(), table.size(1)}));
    if (c.has("dy")) embedding_backward(c.in("dy"), ids, c.out_like("dtable", table));
}

void run_rmsnorm(OpContext& c) {
    RmsNormParams p{.eps = c.param_f64("eps")};
    TensorView x = c.in("x"), w = c.in("weight");
    TESSERA_CHECK(x.ndim() == 2, "x must be [N, D]");
    TensorView rstd = c.out("rstd", x.dtype, Shape{x.size(0)});
    rmsnorm_forward(p, x, w, c.out_like("y", x), rstd);
    if (c.has("dy")) rmsnorm_backward(p, c.in("dy"), x, w, rstd, c.out_like("dx", x), c.out_like("dweight", w));
}

void run_layernorm(OpContext& c) {
    LayerNormParams p{.eps = c.param_f64("eps")};
    TensorView x = c.in("x"), w = c.in("weight"), b = c.in("bias");
    TESSERA_CHECK(x.ndim() == 2, "x must be [N, D]");
    TensorView mean = c.out("mean", x.dtype, Shape{x.size(0)}), rstd = c.out("rstd", x.dtype, Shape{x.size(0)});
    layernorm_forward(p, x, w, b, c.out_like("y", x), mean, rstd);
    if (c.has("dy"))
        layernorm_backward(p, c.in("dy"), x, w, mean, rstd, c.out_like("dx", x), c.out_like("dweight", w),
                           c.out_like("dbias", b));
}

void run_attn_res_mix(OpContext& c) {
    const AttnResParams p{.eps = c.param_f64("eps")};
    TensorView src = c.in("sources"), g = c.in("gamma"), w = c.in("w");
    TESSERA_CHECK(src.ndim() == 3, "sources must be [S, N, C]");
    TensorView out = c.out("out", src.dtype, Shape{src.size(1), src.size(2)});
    TensorView probs = c.out("probs", src.dtype, Shape{src.size(1), src.size(0)});
    const auto split = [](TensorView t) {  // [S, N, C] -> S views [N, C]
        std::vector<TensorView> v;
        for (int64_t i = 0; i < t.size(0); ++i) v.push_back(t.slice0(i, i + 1).reshape(Shape{t.size(1), t.size(2)}));
        return v;
    };
    const std::vector<TensorView> sources = split(src);
    Tensor scratch(src.dtype, Shape{attn_res_mix_scratch(src.size(1), src.size(0), src.size(2))}, src.device);
    attn_res_mix_forward(p, sources, g, w, out, probs, scratch);
    if (c.has("dout"))
        attn_res_mix_backward(p, c.in("dout"), sources, g, w, probs, split(c.out_like("dsources", src)),
                              c.out_like("dgamma", g), c.out_like("dw", w), scratch);
}

void run_swiglu(OpContext& c) {
    TensorView g = c.in("gate"), u = c.in("up");
    swiglu_forward(g, u, c.out_like("y", g));
    if (c.has("dy")) swiglu_backward(c.in("dy"), g, u, c.out_like("dgate", g), c.out_like("dup", u));
}

void run_cross_entropy(OpContext& c) {
    CrossEntropyParams p{.ignore_index = c.param_i64("ignore_index")};
    TensorView logits = c.in("logits"), targets = c.in("targets");
    TESSERA_CHECK(logits.ndim() == 2, "logits must be [N, V]");
    TensorView lse = c.out("lse", logits.dtype, Shape{logits.size(0)});
    CrossEntropyResult r = cross_entropy_forward(p, logits, targets, lse);
    c.set_value("loss", logits.dtype, Shape{}, r.loss);
    if (!c.has("dloss")) return;
    cross_entropy_backward(p, c.host_value("dloss"), logits, targets, lse, c.out_like("dlogits", logits));
}

void run_rope(OpContext& c) {
    RopeParams p{.theta = c.param_f64("theta"),
                 .offset = c.param_i64("offset"),
                 .interleaved = c.param_str("layout") == "interleaved"};
    if (c.param_str("scaling") == "yarn") {
        p.scaling = {.type = RopeScaling::Type::yarn,
                     .factor = c.param_f64("factor"),
                     .original_max_position = c.param_i64("original_max_position"),
                     .beta_fast = c.param_f64("beta_fast"),
                     .beta_slow = c.param_f64("beta_slow"),
                     .mscale = c.param_f64("mscale"),
                     .mscale_all_dim = c.param_f64("mscale_all_dim"),
                     .attention_factor = c.param_f64("attention_factor"),
                     .truncate = c.param_i64("truncate") != 0};
    }
    TensorView x = c.in("x");
    rope_forward(p, x, c.out_like("y", x));
    if (c.has("dy")) rope_backward(p, c.in("dy"), c.out_like("dx", x));
}

void run_causal_conv1d(OpContext& c) {
    CausalConv1dParams p{.activation = c.param_str("activation") == "silu" ? Activation::silu : Activation::none};
    TensorView x = c.in("x"), w = c.in("w");
    const auto cu = c.index_span("cu_seqlens");
    causal_conv1d_forward(p, x, w, c.out_like("y", x), cu);
    if (c.has("dy")) causal_conv1d_backward(p, c.in("dy"), x, w, c.out_like("dx", x), c.out_like("dw", w), cu);
}

void run_attention(OpContext& c) {
    AttentionParams p{.scale = c.param_f64("scale"), .causal = c.param_i64("causal") != 0};
    TensorView q = c.in("q"), k = c.in("k"), v = c.in("v");
    TESSERA_CHECK(q.ndim() == 4, "q must be [B, T, H, D]");
    auto ws = c.workspace(attention_workspace_bytes(q.dtype, q.size(1), q.size(3), omp_get_max_threads()));
    TensorView o = c.out_like("o", q);
    TensorView lse = c.out("lse", q.dtype, Shape{q.size(0), q.size(2), q.size(1)});
    const auto cu = c.index_span("cu_seqlens");
    attention_forward(p, q, k, v, o, lse, ws, cu);
    if (c.has("do")) {
        attention_backward(p, c.in("do"), q, k, v, o, lse, c.out_like("dq", q), c.out_like("dk", k),
                           c.out_like("dv", v), ws, cu);
    }
}

void run_adamw(OpContext& c) {
    AdamWParams p{.lr = c.param_f64("lr"),
                  .beta1 = c.param_f64("beta1"),
                  .beta2 = c.param_f64("beta2"),
                  .eps = c.param_f64("eps"),
                  .weight_decay = c.param_f64("weight_decay"),
                  .step = c.param_i64("step")};
    TensorView param = c.in("param"), grad = c.in("grad");
    adamw_update(p, c.out_like("param", param), grad, c.out_like("m", c.in("m")), c.out_like("v", c.in("v")));
}
}  // namespace

void register_dense_ops(OpRegistry& r) {
    r.add({"linear",
           "y = x·wᵀ + b",
           {{"x", "[N, IN]"}, {"w", "[OUT, IN]"}, {"b", "[OUT]", true}, {"dy", "[N, OUT]", true}},
           {},
           {"y"},
           {"given dy: dx, dw, db (db when b is given)"},
           run_linear,
           /*cuda=*/true});
    r.add({"lora",
           "LoRA's update of a linear: y = scale·(x·aᵀ)·bᵀ",
           {{"x", "[N, IN]"}, {"a", "[r, IN]"}, {"b", "[OUT, r]"}, {"dy", "[N, OUT]", true}},
           {number("scale", "1", -kInf, kInf, "alpha / r (rsLoRA: alpha / sqrt(r))"),
            number("dropout", "0", 0, 0.999, "PEFT's lora_dropout on x (with a seed)"),
            integer("seed", "0", 0, 9007199254740992.0, "the masks' counter seed; 0 = no dropout")},
           {"y"},
           {"given dy: dx, da, db"},
           run_lora,
           /*cuda=*/true});
    r.add({"lora_experts",
           "LoRA of routed experts: rows [offsets[e], offsets[e+1]) use a[e], b[e]",
           {{"x", "[R, IN]"},
            {"offsets", "[E + 1] i64"},
            {"a", "[E, r, IN]"},
            {"b", "[E, OUT, r]"},
            {"dy", "[R, OUT]", true}},
           {number("scale", "1", -kInf, kInf, "alpha / r (rsLoRA: alpha / sqrt(r))")},
           {"y"},
           {"given dy: dx, da, db"},
           run_lora_experts,
           /*cuda=*/true});
    r.add({"embedding",
           "y[n] = table[ids[n]]",
           {{"ids", "[N] i32|i64"}, {"table", "[V, D]"}, {"dy", "[N, D]", true}},
           {},
           {"y"},
           {"given dy: dtable"},
           run_embedding,
           /*cuda=*/true});
    r.add({"rmsnorm",
           "y = x / sqrt(mean(x²) + eps) · weight",
           {{"x", "[N, D]"}, {"weight", "[D]"}, {"dy", "[N, D]", true}},
           {number("eps", "1e-6", 0, kInf)},
           {"y", "rstd"},
           {"given dy: dx, dweight"},
           run_rmsnorm,
           /*cuda=*/true});
    r.add({"layernorm",
           "y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias",
           {{"x", "[N, D]"}, {"weight", "[D]"}, {"bias", "[D]"}, {"dy", "[N, D]", true}},
           {number("eps", "1e-6", 0, kInf)},
           {"y", "mean", "rstd"},
           {"given dy: dx, dweight, dbias"},
           run_layernorm,
           /*cuda=*/true});
    r.add({"attn_res_mix",
           "Attention Residuals: out = Σ_i softmax_i(w·rmsnorm_γ(v_i))·v_i over S sources per token",
           {{"sources", "[S, N, C]"}, {"gamma", "[C]"}, {"w", "[C]"}, {"dout", "[N, C]", true}},
           {number("eps", "1e-6", 0, kInf)},
           {"out", "probs"},
           {"given dout: dsources, dgamma, dw"},
           run_attn_res_mix,
           /*cuda=*/true});
    r.add({"swiglu",
           "y = silu(gate)·up",
           {{"gate", "[N, F]"}, {"up", "[N, F]"}, {"dy", "[N, F]", true}},
           {},
           {"y"},
           {"given dy: dgate, dup"},
           run_swiglu,
           /*cuda=*/true});
    r.add({"cross_entropy",
           "mean cross-entropy over targets != ignore_index",
           {{"logits", "[N, V]"}, {"targets", "[N] i32|i64"}, {"dloss", "[]", true}},
           {integer("ignore_index", "-100", -kInf, kInf)},
           {"loss", "lse"},
           {"given dloss: dlogits"},
           run_cross_entropy,
           /*cuda=*/true});
    r.add({"rope",
           "rotary embedding, rotate-half (Llama) or interleaved (MLA) pairs",
           {{"x", "[B, T, H, D]"}, {"dy", "[B, T, H, D]", true}},
           {number("theta", "10000", 1, kInf),
            integer("offset", "0", 0, 1 << 30, "position of the first token"),
            {"layout", ParamKind::choice, "half", {"half", "interleaved"}, "pairs (i, i+D/2) or (2i, 2i+1)"},
            {"scaling", ParamKind::choice, "none", {"none", "yarn"}, "frequency scaling (YaRN: docs/ops.md)"},
            number("factor", "1", 1e-6, kInf, "yarn: context extension s"),
            integer("original_max_position", "4096", 1, 1 << 30, "yarn: pre-training context L0"),
            number("beta_fast", "32", 1e-6, kInf, "yarn"),
            number("beta_slow", "1", 1e-6, kInf, "yarn"),
            number("mscale", "0", 0, kInf, "yarn: 0 = unset"),
            number("mscale_all_dim", "0", 0, kInf, "yarn: 0 = unset"),
            number("attention_factor", "0", 0, kInf, "yarn: cos/sin factor; 0 = derived"),
            integer("truncate", "1", 0, 1, "yarn: 1 = whole-pair correction range")},
           {"y"},
           {"given dy: dx"},
           run_rope,
           /*cuda=*/true});
    r.add({"causal_conv1d",
           "depthwise causal conv1d, left-padded, optional SiLU",
           {{"x", "[B, T, C]"}, {"w", "[C, W]"}, {"cu_seqlens", "[N+1] i64, B = 1", true}, {"dy", "[B, T, C]", true}},
           {{"activation", ParamKind::choice, "silu", {"silu", "none"}, ""}},
           {"y"},
           {"given dy: dx, dw"},
           run_causal_conv1d,
           /*cuda=*/true});
    r.add({"attention",
           "softmax(scale·q·kᵀ)·v, causal, GQA when HKV < H (flash-style tiles)",
           {{"q", "[B, T, H, D]"},
            {"k", "[B, T, HKV, D]"},
            {"v", "[B, T, HKV, D]"},
            {"cu_seqlens", "[N+1] i64, B = 1", true},
            {"do", "[B, T, H, D]", true}},
           {number("scale", "0", 0, kInf, "0 = D^-0.5"), integer("causal", "1", 0, 1)},
           {"o", "lse"},
           {"given do: dq, dk, dv"},
           run_attention,
           /*cuda=*/true});
    r.add({"adamw",
           "one AdamW step, in the operation order of torch.optim.AdamW",
           {{"param", "[...]"}, {"grad", "[...]"}, {"m", "[...]"}, {"v", "[...]"}},
           {number("lr", "1e-3", 0, kInf), number("beta1", "0.9", 0, 0.999999), number("beta2", "0.999", 0, 0.999999),
            number("eps", "1e-8", 1e-30, kInf), number("weight_decay", "0.01", 0, kInf),
            integer("step", "1", 1, 1e15, "1-based")},
           {"param", "m", "v"},
           {},
           run_adamw,
           /*cuda=*/true});
}

}  // namespace tessera::ops
