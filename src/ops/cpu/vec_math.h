// Elementwise math that GCC vectorizes inside `#pragma omp simd` loops (libm's expf does not
// vectorize without -ffast-math, which we do not use). f64 overloads call libm: the double paths are
// references, not hot paths.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace tessera::ops::cpu {

// expf with the Cephes range reduction and polynomial (max error about 2 ulp on [-87, 88]);
// exp(x) = 0 for x < -87.3 (and for -inf), +inf above 88.3, NaN stays NaN.
inline float vexp(float x) {
    const float hi = 88.3f, lo = -87.33f;  // keeps 2^fx within the f32 exponent range
    // NOTES: NaN clamps to lo (x >= lo is false), so int32_t(fx) below is defined; the NaN comes back at the end
    const float xc = x > hi ? hi : (x >= lo ? x : lo);
    const float fx = std::floor(xc * 1.44269504088896341f + 0.5f);
    float r = xc - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const float scale = std::bit_cast<float>(uint32_t(int32_t(fx) + 127) << 23);
    float e = y * scale;
    e = x < lo ? 0.0f : e;
    e = x == x ? e : x;  // NaN stays NaN
    return x > hi ? INFINITY : e;
}
inline double vexp(double x) { return std::exp(x); }

template <class T>
inline T vsigmoid(T x) {
    return T(1) / (T(1) + vexp(-x));
}

// tanhf as in Cephes: an odd polynomial below |x| = 0.625 (where 1 − 2/(e^2x + 1) would cancel),
// that formula above; both computed and blended so the loop vectorizes (max error ~2 ulp).
inline float vtanh(float x) {
    const float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const float small = p * z * x + x;
    const float ax = x < 0 ? -x : x;
    float large = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
    large = x < 0 ? -large : large;
    return ax < 0.625f ? small : large;
}
inline double vtanh(double x) { return std::tanh(x); }

// Σ_{c < n} term(c) in Acc, in one order on every ISA and thread count: kSumLanes partial sums (lane j takes c ≡ j mod
// kSumLanes, in increasing c), then the lanes in order. The lane loop vectorizes (a sequential sum does not: its
// order is the dependence chain), so a row's sum of squares runs at the row's load rate.
inline constexpr int kSumLanes = 16;
template <class Acc, class Term>
inline Acc lane_sum(int64_t n, Term&& term) {
    Acc acc[kSumLanes] = {};
    int64_t c = 0;
    for (; c + kSumLanes <= n; c += kSumLanes) {
#pragma omp simd
        for (int j = 0; j < kSumLanes; ++j) acc[j] += term(c + j);
    }
    for (int j = 0; c + j < n; ++j) acc[j] += term(c + j);
    Acc s = 0;
    for (int j = 0; j < kSumLanes; ++j) s += acc[j];
    return s;
}

}  // namespace tessera::ops::cpu
