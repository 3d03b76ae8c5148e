// Helpers shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace tessera::bench {

// f32 values uniform in [lo, hi) from Philox (seed, stream): the same inputs every run
inline Tensor random_tensor(Shape s, uint64_t seed, double lo, double hi, uint64_t stream) {
    Tensor t(DType::f32, s);
    RandomStream rs{seed, stream};
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = float(lo + (hi - lo) * rs.uniform(uint64_t(i)));
    return t;
}

// MoE routing set directly: k distinct experts per token into expert [N, K], uniform or Zipf (p(e) ∝ 1/(e+1))
inline void route_experts(bool zipf, int64_t N, int64_t E, int64_t K, int32_t* expert) {
    std::vector<double> cdf(static_cast<size_t>(E));
    double z = 0;
    for (int64_t e = 0; e < E; ++e) cdf[size_t(e)] = (z += zipf ? 1.0 / double(e + 1) : 1.0);
    RandomStream rs{zipf ? 11u : 12u, 3};
    uint64_t draw = 0;
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < K;) {
            const double u = rs.uniform(draw++) * z;
            const int32_t e = int32_t(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
            if (e >= E || std::find(expert + n * K, expert + n * K + j, e) != expert + n * K + j) continue;
            expert[n * K + j++] = e;
        }
    }
}

}  // namespace tessera::bench
