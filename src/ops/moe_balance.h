// Expert load balancing and load metrics for the MoE router (spec/moe.md §3.1, §9; spec/kimi_k3.md §2.4).
// The selection bias b (router_bias) gets no gradient; the training loop moves it once per optimizer
// step from the whole step's routing:
//   sign rule (aux-loss-free, DeepSeek-V3):  b_i += γ·sign(mean_j c_j − c_i), c = router choices per expert
//   Quantile Balancing (Kimi K3):            b_j += −quantile_{1−k/E}(s̃_{t,j} − α_t) over the step's tokens,
//                                            s̃ = s + b, α_t = token t's (k+1)-th largest s̃; then b −= mean(b)
// Quantiles come from per-expert histograms of the margins (4096 bins over [−2, 2]: scores lie in [0, 1]),
// so micro-batches (and, later, ranks) add counts; the value is interpolated inside its bin.
// [uncertain] whether K3's margins include the old bias. We include it: the update is then a fixed-point
// step (a balanced router has zero margin quantiles and keeps its bias), which converges where the
// absolute form from unbiased scores overshoots on strongly skewed routers (docs/moe.md).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tessera::ops {

enum class BalanceRule : uint8_t { sign, quantile, frozen };
BalanceRule parse_balance_rule(const std::string& s, const std::string& where);  // "sign" | "quantile" | "frozen"
std::string balance_rule_name(BalanceRule r);

void balance_sign_update(std::span<const int64_t> load, double gamma, std::span<float> bias);

class QuantileBalancer {
  public:
    QuantileBalancer(int64_t experts, int64_t topk, int64_t bins = 4096);
    // [N, E] unbiased router scores of one micro-batch and the bias it was routed with
    void add(TensorView scores, std::span<const float> bias);
    void update(std::span<float> bias);  // moves the bias by the histograms' quantiles, then clears them
    void clear();                        // clears the histograms (a frozen bias: no update)
    int64_t tokens() const { return hist_.back(); }
    // The histograms and the token count (integers): several ranks add theirs element-wise before update, and
    // all then move the bias as one process seeing every token would.
    std::span<int64_t> counts() { return hist_; }

  private:
    int64_t E_, K_, bins_;
    std::vector<int64_t> hist_;          // [E, bins], then the token count
    std::vector<double> sel_, top_, b_;  // [E], [K + 1], [E]: scratch of add and update, sized once
};

// Per-layer load metrics of one step (spec/moe.md §9).
struct MoeLoad {
    std::vector<int64_t> load;     // router choices per expert (demand) over the step
    double overload = 0.0;         // max / mean of load
    int64_t dead = 0;              // experts with zero load
    double load_entropy = 0.0;     // −Σ λ log λ / log E, λ = load / Σ load (1 = uniform)
    double routing_entropy = 0.0;  // mean over tokens of −Σ_e p log p (p: scores normalised over E)
};
MoeLoad moe_load(std::span<const int64_t> load, double routing_entropy);
// The same into `out`, reusing its load vector (no allocation once it has held as many experts).
void moe_load(std::span<const int64_t> load, double routing_entropy, MoeLoad& out);
// Σ over tokens of the routing entropy of scores [N, E] (normalised per token over E).
double routing_entropy_sum(TensorView scores);

}  // namespace tessera::ops
