// Model summaries for `tessera inspect` (see inspect.h).
#include "model/inspect.h"

#include <fmt/format.h>

#include <cmath>
#include <map>

#include "model/model.h"

namespace tessera::model {

namespace {
std::string human(double v, const char* unit) {
    const char* prefixes[] = {"", "K", "M", "G", "T", "P"};
    int i = 0;
    while (v >= 1000.0 && i < 5) {
        v /= 1000.0;
        ++i;
    }
    return fmt::format("{:.3g} {}{}", v, prefixes[i], unit);
}

std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }
}  // namespace

ModelSummary summarize(const ModelConfig& c, int64_t seq) {
    ModelSummary s;
    s.seq = seq;
    for (int64_t i = 0; i < c.n_layers; ++i) {
        const std::string attn = c.layer_type(i), ffn = c.moe.is_moe_layer(i) ? "moe" : "mlp";
        if (!s.layers.empty() && s.layers.back().attention == attn && s.layers.back().ffn == ffn &&
            s.layers.back().last == i - 1) {
            s.layers.back().last = i;
        } else {
            s.layers.push_back({i, i, attn, ffn});
        }
    }
    const int64_t B = c.attn_res_block_size;
    s.residuals = B == 0 ? "plain residual stream"
                         : fmt::format("Attention Residuals, depth blocks of {} layers ({} sources at the output mix)",
                                       B, (c.n_layers + B - 1) / B + 1);
    s.positions = "none (no layer rotates)";
    if (c.has_rotary_dims()) {
        s.positions = fmt::format("RoPE, theta {:g}", c.rope_theta);
        const ops::RopeScaling& y = c.rope_scaling;
        if (y.enabled()) {
            s.positions += fmt::format(", YaRN x{:g} of {} positions (cos/sin x{:.4g}", y.factor,
                                       y.original_max_position, y.cos_sin_factor());
            const double mla = c.mla_layer(true).scale() * std::sqrt(double(c.mla.qk_head_dim()));
            const bool latent = c.has_layer_type("mla") || c.has_layer_type("dsa");
            s.positions += latent && c.mla.softmax_scale == 0 ? fmt::format(", MLA softmax scale x{:.4g})", mla) : ")";
        }
    }
    const Model m(c);  // declares parameter specs only; nothing is allocated
    s.lora = c.lora;
    s.vision = c.vision;
    for (const auto& spec : m.param_specs()) {
        const int64_t n = spec.shape.numel();
        (spec.trainable ? s.trained_params : s.frozen_params) += n;
        if (!spec.trainable) s.frozen_bytes += int64_t(spec.nbytes());
        if (spec.name.ends_with(".lora_A.weight")) ++s.adapted_modules;
        if (is_adapter(spec.name)) continue;  // base only
        s.params += n;
        if (spec.name == "model.embed_tokens.weight" || spec.name == "lm_head.weight") s.embedding_params += n;
        if (spec.name.find(".mlp.experts.") != std::string::npos) s.routed_expert_params += n;
        if (is_vision_param(spec.name)) s.vision_params += n;
    }
    const double routed_share = c.moe.experts > 0 ? double(c.moe.topk) / double(c.moe.experts) : 0.0;
    s.active_params =
        double(s.params - s.routed_expert_params - s.vision_params) + routed_share * double(s.routed_expert_params);
    s.forward_flops_per_token = m.forward_flops_per_token(seq);
    s.train_flops_per_token = m.train_flops_per_token(seq);
    return s;
}

std::string ModelSummary::str() const {
    std::map<std::string, int64_t> kinds;
    for (const auto& r : layers) {
        kinds[r.attention] += r.last - r.first + 1;
        kinds[r.ffn] += r.last - r.first + 1;
    }
    std::string out = "layers:";
    for (const auto& [k, n] : kinds) out += fmt::format(" {} {},", k, n);
    out.back() = '\n';
    for (const auto& r : layers) {
        const std::string span = r.first == r.last ? fmt::format("{}", r.first) : fmt::format("{}-{}", r.first, r.last);
        out += fmt::format("  {:>7}  {} + {}\n", span, r.attention, r.ffn);
    }
    out += fmt::format("residuals: {}\n", residuals);
    out += fmt::format("positions: {}\n", positions);
    out += fmt::format(
        "parameters: {} total ({} in embeddings and head, {} in routed experts{})\n", human(double(params), ""),
        human(double(embedding_params), ""), human(double(routed_expert_params), ""),
        vision_params ? fmt::format(", {} in the frozen image tower and projector", human(double(vision_params), ""))
                      : std::string());
    out += fmt::format("active parameters per token: {}\n", human(active_params, ""));
    if (vision_params) {
        out += fmt::format(
            "image input: {} patches of {}x{} px per image token; the tower's FLOPs are not in the "
            "per-token counts\n",
            vision.merge_h * vision.merge_w, vision.patch_size, vision.patch_size);
    }
    out += fmt::format("FLOPs per token at sequence {}: forward {}, training {} ({:.2g}x forward{})\n", seq,
                       human(forward_flops_per_token, "FLOP"), human(train_flops_per_token, "FLOP"),
                       train_flops_per_token / forward_flops_per_token,
                       lora.enabled() ? ": no weight gradients for the frozen base" : "");
    out += fmt::format("weights: {} in bf16, {} in f32\n", gib(2.0 * double(params)), gib(4.0 * double(params)));
    out += fmt::format(
        "full AdamW training state (f32 weights, gradients, two moments: 16 B per parameter{}): {} before "
        "activations\n",
        vision_params ? "; the frozen image tower its f32 weights, 4 B" : "",
        gib(16.0 * double(params - vision_params) + 4.0 * double(vision_params)));
    if (lora.enabled()) {
        out += fmt::format(
            "LoRA rank {} (alpha {}{}) on {} modules: {} parameters train ({:.3f}% of the base); training state "
            "(frozen base {:.2f} B per parameter with its GEMM weights in {}{}, 16 B per trained one): {} before "
            "activations\n",
            lora.rank, lora.alpha, lora.rslora ? ", rsLoRA" : "", adapted_modules, human(double(trained_params), ""),
            100.0 * double(trained_params) / double(params),
            frozen_params > 0 ? double(frozen_bytes) / double(frozen_params) : 0.0, lora.base_dtype,
            lora.expert_dtype != lora.base_dtype ? ", routed experts in " + lora.expert_dtype : std::string(),
            gib(double(frozen_bytes) + 16.0 * double(trained_params)));
    }
    return out;
}

}  // namespace tessera::model
