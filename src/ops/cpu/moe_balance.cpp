// Expert load balancing rules and load metrics (see moe_balance.h).
#include "ops/moe_balance.h"

#include <algorithm>
#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"

namespace tessera::ops {

namespace {
constexpr double kRange = 2.0;  // margin histograms cover [−kRange, kRange]
}  // namespace

BalanceRule parse_balance_rule(const std::string& s, const std::string& where) {
    if (s == "sign") return BalanceRule::sign;
    if (s == "quantile") return BalanceRule::quantile;
    if (s == "frozen") return BalanceRule::frozen;
    TESSERA_FAIL("{}: balance must be \"sign\", \"quantile\" or \"frozen\", not \"{}\"", where, s);
}

std::string balance_rule_name(BalanceRule r) {
    return r == BalanceRule::sign ? "sign" : r == BalanceRule::quantile ? "quantile" : "frozen";
}

void balance_sign_update(std::span<const int64_t> load, double gamma, std::span<float> bias) {
    TESSERA_CHECK(load.size() == bias.size(), "balance: {} loads for {} biases", load.size(), bias.size());
    int64_t total = 0;
    for (int64_t c : load) total += c;
    // compare c_i·E with Σc (integers): sign(mean − c_i) without rounding
    const int64_t E = int64_t(load.size());
    for (size_t i = 0; i < load.size(); ++i) {
        const int64_t d = total - load[i] * E;
        bias[i] += float(gamma * double((d > 0) - (d < 0)));
    }
}

QuantileBalancer::QuantileBalancer(int64_t experts, int64_t topk, int64_t bins)
    : E_(experts),
      K_(topk),
      bins_(bins),
      hist_(size_t(experts * bins + 1), 0),
      sel_(size_t(experts)),
      top_(size_t(topk + 1)),
      b_(size_t(experts)) {
    TESSERA_CHECK(topk < experts, "quantile balancing needs topk < experts (topk = {}, experts = {})", topk, experts);
}

void QuantileBalancer::add(TensorView scores, std::span<const float> bias) {
    cpu_only("QuantileBalancer::add", {scores});
    TESSERA_CHECK(scores.ndim() == 2 && scores.size(1) == E_, "quantile balancing: scores must be [N, {}]", E_);
    cpu::dispatch_float(scores.dtype, "quantile balancing", [&]<class T>(T) {
        cpu::Rows<T> S = cpu::rows_of<T>(scores, "quantile balancing: scores");
        std::vector<double>&sel = sel_, &top = top_;
        for (int64_t n = 0; n < S.rows; ++n) {
            const T* s = S.row(n);
            for (int64_t e = 0; e < E_; ++e) sel[size_t(e)] = double(s[e]) + double(bias[size_t(e)]);
            std::partial_sort_copy(sel.begin(), sel.end(), top.begin(), top.end(), std::greater<double>());
            const double alpha = top[size_t(K_)];  // the (k+1)-th largest selection score
            for (int64_t e = 0; e < E_; ++e) {
                const double m = std::clamp(sel[size_t(e)] - alpha, -kRange, kRange);
                const int64_t b = std::min(bins_ - 1, int64_t((m + kRange) / (2.0 * kRange) * double(bins_)));
                ++hist_[size_t(e * bins_ + b)];
            }
        }
        hist_.back() += S.rows;
    });
}

void QuantileBalancer::update(std::span<float> bias) {
    TESSERA_CHECK(int64_t(bias.size()) == E_, "quantile balancing: {} biases for {} experts", bias.size(), E_);
    if (tokens() == 0) return;
    const double q = 1.0 - double(K_) / double(E_), width = 2.0 * kRange / double(bins_);
    const double rank = q * double(tokens());  // margins below the quantile
    std::vector<double>& b = b_;
    for (int64_t e = 0; e < E_; ++e) {
        const int64_t* h = hist_.data() + e * bins_;
        double below = 0;
        int64_t i = 0;
        for (; i < bins_ - 1 && below + double(h[i]) < rank; ++i) below += double(h[i]);
        const double frac = h[i] > 0 ? (rank - below) / double(h[i]) : 0.5;
        b[size_t(e)] = double(bias[size_t(e)]) + kRange - (double(i) + std::clamp(frac, 0.0, 1.0)) * width;
    }
    double mean = 0;
    for (int64_t e = 0; e < E_; ++e) mean += b[size_t(e)] / double(E_);
    for (int64_t e = 0; e < E_; ++e) bias[size_t(e)] = float(b[size_t(e)] - mean);
    std::fill(hist_.begin(), hist_.end(), 0);
}

void QuantileBalancer::clear() { std::fill(hist_.begin(), hist_.end(), 0); }

MoeLoad moe_load(std::span<const int64_t> load, double routing_entropy) {
    MoeLoad m;
    moe_load(load, routing_entropy, m);
    return m;
}

void moe_load(std::span<const int64_t> load, double routing_entropy, MoeLoad& m) {
    m.load.assign(load.begin(), load.end());
    m.overload = m.load_entropy = 0.0;
    m.dead = 0;
    m.routing_entropy = routing_entropy;
    const double E = double(load.size());
    int64_t total = 0, mx = 0;
    for (int64_t c : load) {
        total += c;
        mx = std::max(mx, c);
        m.dead += c == 0;
    }
    if (total == 0) return;
    m.overload = double(mx) * E / double(total);
    double h = 0;
    for (int64_t c : load) {
        if (c > 0) h -= double(c) / double(total) * std::log(double(c) / double(total));
    }
    m.load_entropy = E > 1 ? h / std::log(E) : 1.0;
}

double routing_entropy_sum(TensorView scores) {
    if (op_device("routing_entropy_sum", {scores}) == Device::cuda) return TESSERA_ON_CUDA(routing_entropy_sum(scores));
    double sum = 0;
    cpu::dispatch_float(scores.dtype, "routing entropy", [&]<class T>(T) {
        cpu::Rows<T> S = cpu::rows_of<T>(scores, "routing entropy: scores");
        for (int64_t n = 0; n < S.rows; ++n) {
            const T* s = S.row(n);
            double z = 0, h = 0;
            for (int64_t e = 0; e < S.cols; ++e) z += double(s[e]);
            for (int64_t e = 0; e < S.cols; ++e) {
                const double p = double(s[e]) / z;
                if (p > 0) h -= p * std::log(p);
            }
            sum += h;
        }
    });
    return sum;
}

}  // namespace tessera::ops
