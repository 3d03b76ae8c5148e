// RoPE's frequencies (plain or YaRN) and the scaling's checks: backend-neutral math that model configs
// reach without the kernels (the config reader validates rope_scaling; the fuzz build links this file).
#include <algorithm>
#include <cmath>
#include <numbers>

#include "ops/rope.h"

namespace tessera::ops {

double yarn_mscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

double RopeScaling::cos_sin_factor() const {
    if (type == Type::none) return 1.0;
    if (attention_factor > 0) return attention_factor;
    if (mscale != 0 && mscale_all_dim != 0) return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim);
    return yarn_mscale(factor, 1.0);
}

void RopeScaling::validate(const std::string& where) const {
    if (type == Type::none) return;
    TESSERA_CHECK(std::isfinite(factor) && factor > 0, "{}: rope_scaling.factor must be positive, not {}", where,
                  factor);
    TESSERA_CHECK(original_max_position > 0, "{}: rope_scaling.original_max_position must be positive, not {}", where,
                  original_max_position);
    TESSERA_CHECK(std::isfinite(beta_fast) && std::isfinite(beta_slow) && beta_fast > 0 && beta_slow > 0,
                  "{}: rope_scaling.beta_fast and beta_slow must be positive, not {} and {}", where, beta_fast,
                  beta_slow);
    TESSERA_CHECK(std::isfinite(mscale) && std::isfinite(mscale_all_dim) && std::isfinite(attention_factor) &&
                      mscale >= 0 && mscale_all_dim >= 0 && attention_factor >= 0,
                  "{}: rope_scaling.mscale, mscale_all_dim and attention_factor must be >= 0 (0 = unset)", where);
}

void rope_inv_freq(const RopeParams& p, int64_t D, std::span<double> out) {
    const int64_t half = D / 2;
    TESSERA_CHECK(int64_t(out.size()) == half, "rope_inv_freq: {} slots for {} pairs", out.size(), half);
    for (int64_t i = 0; i < half; ++i) out[size_t(i)] = std::pow(p.theta, -2.0 * double(i) / double(D));
    const RopeScaling& y = p.scaling;
    if (y.type == RopeScaling::Type::none) return;
    // the pair index where a wavelength fits n rotations into the original context
    const double d = double(D), base = p.theta, L0 = double(y.original_max_position);
    auto correction = [&](double n) {
        return d * std::log(L0 / (n * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
    };
    double lo = correction(y.beta_fast), hi = correction(y.beta_slow);
    if (y.truncate) {
        lo = std::floor(lo);
        hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, d - 1.0);
    if (lo == hi) hi += 0.001;  // transformers' guard against a zero-width ramp
    for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((double(i) - lo) / (hi - lo), 0.0, 1.0);  // 1: interpolated
        out[size_t(i)] *= (1.0 - ramp) + ramp / y.factor;
    }
}

}  // namespace tessera::ops
