// The f32 vector register of the ISA a file is compiled for, as a GCC vector extension: 16 floats
// with AVX-512, 8 with AVX2, 4 otherwise; unaligned loads and stores, and horizontal sums as
// shuffle trees. For kernels whose `#pragma omp simd reduction` would end in a chain of scalar adds
// (GCC reduces the vector lane by lane through memory): short dot products repeated many times.
#pragma once

#include <cstring>

namespace tessera::ops::cpu::simd {

#if defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX__)
constexpr int kW = 8;
#else
constexpr int kW = 4;
#endif

typedef float vf __attribute__((vector_size(kW * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

// lanes 4i..4i+3 of a summed into one 4-lane vector
inline vf4 fold4(vf a) {
#if defined(__AVX512F__)
    typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
    const vf8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif defined(__AVX__)
    return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    return a;
#endif
}

// x = Σ lanes of a, y = Σ lanes of b (the two trees share their last steps)
inline void hsum2(vf a, vf b, float& x, float& y) {
    const vf4 p = fold4(a), q = fold4(b);
    const vf4 s = __builtin_shufflevector(p, q, 0, 1, 4, 5) + __builtin_shufflevector(p, q, 2, 3, 6, 7);
    x = s[0] + s[1];
    y = s[2] + s[3];
}

}  // namespace tessera::ops::cpu::simd
