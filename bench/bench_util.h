// Helpers shared by the benchmark programs.
#pragma once

#include <cstdint>

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

}  // namespace tessera::bench
