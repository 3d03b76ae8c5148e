// Register-blocked small GEMM micro-kernels (see small_gemm.h).
#include "ops/cpu/small_gemm.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace tessera::ops::cpu {

namespace {
// W floats in one vector register (or a part of one): 16, 8 or 4
template <int W>
struct Vec;
template <>
struct Vec<16> {
    typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vec<8> {
    typedef float type __attribute__((vector_size(32)));
};
template <>
struct Vec<4> {
    typedef float type __attribute__((vector_size(16)));
};

// The register tile of the ISA the file is compiled for: MR rows × NV vectors of W floats.
// NOTES: AVX-512 has 32 zmm registers: 8 × 2 zmm = 16 accumulators + 2 for B (measured ~245 GFLOP/s
// per core on 64-128-sized operands, where 4 × 64 tiles reached 105-190). AVX2 has 16 ymm: the same
// tile would need 32 and spill (73% of a dense step's cycles on an AVX2 machine), so 6 × 2 ymm = 12
// accumulators + 2 for B + 1 broadcast. Each element still sums k in order, so the tile shape never
// changes a result.
#if defined(__AVX512F__)
constexpr int kW = 16, kMR = 8, kNV = 2;
#else
constexpr int kW = 8, kMR = 6, kNV = 2;
#endif

template <class V>
inline V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <class V>
inline void store(float* p, V v) {
    std::memcpy(p, &v, sizeof v);
}

// Operand sources (template arguments, so the inner loops have no branches):
// A element (i, k) of op(A): A[i·lda + k] (plain), A[k·lda + i] (transposed), rows[i][k] (gathered rows);
// B row k: B + k·ldb (strided) or rows[k] (gathered rows).
template <class T>
struct APlain {
    const T* a;
    int64_t ld;
    T get(int64_t i, int64_t k) const { return a[i * ld + k]; }
};
template <class T>
struct ATrans {
    const T* a;
    int64_t ld;
    T get(int64_t i, int64_t k) const { return a[k * ld + i]; }
};
template <class T>
struct ARows {
    const T* const* rows;
    T get(int64_t i, int64_t k) const { return rows[i][k]; }
};
template <class T>
struct BStrided {
    const T* b;
    int64_t ld;
    const T* row(int64_t k) const { return b + k * ld; }
};
template <class T>
struct BRows {
    const T* const* rows;
    const T* row(int64_t k) const { return rows[k]; }
};

// MR rows × NV vectors of W columns
template <int MR, int NV, int W, class A, class B>
inline void tile(
    const A& a, const B& b, int64_t i0, int64_t j0, int64_t K, float alpha, float beta, float* C, int64_t ldc) {
    using V = typename Vec<W>::type;
    V acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < NV; ++q) acc[r][q] = V{};
    for (int64_t k = 0; k < K; ++k) {
        const float* br = b.row(k) + j0;
        V bv[NV];
        for (int q = 0; q < NV; ++q) bv[q] = load<V>(br + W * q);
        for (int r = 0; r < MR; ++r) {
            const float x = a.get(i0 + r, k);
            for (int q = 0; q < NV; ++q) acc[r][q] += x * bv[q];
        }
    }
    for (int r = 0; r < MR; ++r) {
        float* c = C + (i0 + r) * ldc + j0;
        for (int q = 0; q < NV; ++q) {
            V out = alpha * acc[r][q];
            if (beta != 0.0f) out += beta * load<V>(c + W * q);
            store<V>(c + W * q, out);
        }
    }
}

// Rows i0 + i of an A source, as rows i (a row block's tile computed into scratch)
template <class A>
struct AFrom {
    const A& a;
    int64_t i0;
    float get(int64_t i, int64_t k) const { return a.get(i0 + i, k); }
};

// The last columns [j0, N), fewer than 4 (e.g. the score products of attention over 1–3 heads), from `bt`: those
// columns of B packed 4 wide with zeros beyond N ([K, 4]); a 4-wide tile into scratch, its valid columns copied out.
template <int MR, class A>
inline void narrow_tail(const A& a,
                        const float* bt,
                        int64_t i0,
                        int64_t j0,
                        int64_t N,
                        int64_t K,
                        float alpha,
                        float beta,
                        float* C,
                        int64_t ldc) {
    float out[MR * 4];
    tile<MR, 1, 4>(AFrom<A>{a, i0}, BStrided<float>{bt, 4}, 0, 0, K, alpha, 0.0f, out, 4);
    for (int r = 0; r < MR; ++r)
        for (int64_t j = j0; j < N; ++j) {
            float& c = C[(i0 + r) * ldc + j];
            c = out[r * 4 + (j - j0)] + (beta != 0.0f ? beta * c : 0.0f);
        }
}

template <int MR, class A, class B>
inline void row_block(
    const A& a, const B& b, int64_t i0, int64_t N, int64_t K, float alpha, float beta, float* C, int64_t ldc) {
    int64_t j = 0;
    for (; j + kW * kNV <= N; j += kW * kNV) tile<MR, kNV, kW>(a, b, i0, j, K, alpha, beta, C, ldc);
    for (; j + kW <= N; j += kW) tile<MR, 1, kW>(a, b, i0, j, K, alpha, beta, C, ldc);
    // narrow products (e.g. the score products of attention over few heads)
    if constexpr (kW > 8) {
        for (; j + 8 <= N; j += 8) tile<MR, 1, 8>(a, b, i0, j, K, alpha, beta, C, ldc);
    }
    for (; j + 4 <= N; j += 4) tile<MR, 1, 4>(a, b, i0, j, K, alpha, beta, C, ldc);
    for (; j < N; ++j) {  // column tail (K too long for the packed tail)
        for (int r = 0; r < MR; ++r) {
            float s = 0;
            for (int64_t k = 0; k < K; ++k) s += a.get(i0 + r, k) * b.row(k)[j];
            float& c = C[(i0 + r) * ldc + j];
            c = alpha * s + (beta != 0.0f ? beta * c : 0.0f);
        }
    }
}

// the longest K whose narrow column tail is packed (on the stack: 16 KiB)
constexpr int64_t kTailK = 1024;

// Columns [j0, N) of C, fewer than 4, for every row: B's packed 4 wide, then narrow_tail per row block (out of line:
// its stack buffer would otherwise slow the wide tiles' loop, measured)
template <class A, class B>
__attribute__((noinline)) void narrow_columns(int64_t M,
                                              int64_t j0,
                                              int64_t N,
                                              int64_t K,
                                              float alpha,
                                              const A& a,
                                              const B& b,
                                              float beta,
                                              float* C,
                                              int64_t ldc) {
    float packed[kTailK * 4];
    for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < 4; ++c) packed[k * 4 + c] = j0 + c < N ? b.row(k)[j0 + c] : 0.0f;
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR) narrow_tail<kMR>(a, packed, i, j0, N, K, alpha, beta, C, ldc);
    for (; i + 4 <= M; i += 4) narrow_tail<4>(a, packed, i, j0, N, K, alpha, beta, C, ldc);
    for (; i < M; ++i) narrow_tail<1>(a, packed, i, j0, N, K, alpha, beta, C, ldc);
}

template <class A, class B>
void gemm_f32(int64_t M, int64_t N, int64_t K, float alpha, const A& a, const B& b, float beta, float* C, int64_t ldc) {
    const int64_t j0 = N / 4 * 4;
    const bool narrow = j0 < N && K <= kTailK;  // the last N − j0 < 4 columns packed, apart
    const int64_t wide = narrow ? j0 : N;
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR) row_block<kMR>(a, b, i, wide, K, alpha, beta, C, ldc);
    for (; i + 4 <= M; i += 4) row_block<4>(a, b, i, wide, K, alpha, beta, C, ldc);
    for (; i < M; ++i) row_block<1>(a, b, i, wide, K, alpha, beta, C, ldc);
    if (narrow) narrow_columns(M, j0, N, K, alpha, a, b, beta, C, ldc);
}

template <class T, class A, class B>
void gemm_ref(int64_t M, int64_t N, int64_t K, T alpha, const A& a, const B& b, T beta, T* C, int64_t ldc) {
    for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
            T s = 0;
            for (int64_t k = 0; k < K; ++k) s += a.get(i, k) * b.row(k)[j];
            C[i * ldc + j] = alpha * s + (beta != T(0) ? beta * C[i * ldc + j] : T(0));
        }
    }
}

template <class T, class A, class B>
void gemm_any(int64_t M, int64_t N, int64_t K, T alpha, const A& a, const B& b, T beta, T* C, int64_t ldc) {
    if constexpr (std::is_same_v<T, float>) {
        gemm_f32(M, N, K, alpha, a, b, beta, C, ldc);
    } else {
        gemm_ref(M, N, K, alpha, a, b, beta, C, ldc);
    }
}
}  // namespace

template <class T>
void small_gemm_nn(int64_t M,
                   int64_t N,
                   int64_t K,
                   T alpha,
                   const T* A,
                   int64_t lda,
                   const T* B,
                   int64_t ldb,
                   T beta,
                   T* C,
                   int64_t ldc) {
    gemm_any(M, N, K, alpha, APlain<T>{A, lda}, BStrided<T>{B, ldb}, beta, C, ldc);
}
template <class T>
void small_gemm_tn(int64_t M,
                   int64_t N,
                   int64_t K,
                   T alpha,
                   const T* A,
                   int64_t lda,
                   const T* B,
                   int64_t ldb,
                   T beta,
                   T* C,
                   int64_t ldc) {
    gemm_any(M, N, K, alpha, ATrans<T>{A, lda}, BStrided<T>{B, ldb}, beta, C, ldc);
}
template <class T>
void small_gemm_rows_nn(int64_t M,
                        int64_t N,
                        int64_t K,
                        T alpha,
                        const T* const* a_rows,
                        const T* B,
                        int64_t ldb,
                        T beta,
                        T* C,
                        int64_t ldc) {
    gemm_any(M, N, K, alpha, ARows<T>{a_rows}, BStrided<T>{B, ldb}, beta, C, ldc);
}
template <class T>
void small_gemm_tn_rows(int64_t M,
                        int64_t N,
                        int64_t K,
                        T alpha,
                        const T* A,
                        int64_t lda,
                        const T* const* b_rows,
                        T beta,
                        T* C,
                        int64_t ldc) {
    gemm_any(M, N, K, alpha, ATrans<T>{A, lda}, BRows<T>{b_rows}, beta, C, ldc);
}

#define TESSERA_SMALL_GEMM(T)                                                                                    \
    template void small_gemm_nn<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*,    \
                                   int64_t);                                                                     \
    template void small_gemm_tn<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, T, T*,    \
                                   int64_t);                                                                     \
    template void small_gemm_rows_nn<T>(int64_t, int64_t, int64_t, T, const T* const*, const T*, int64_t, T, T*, \
                                        int64_t);                                                                \
    template void small_gemm_tn_rows<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T* const*, T, T*, \
                                        int64_t);
TESSERA_SMALL_GEMM(float)
TESSERA_SMALL_GEMM(double)
#undef TESSERA_SMALL_GEMM

namespace {
typedef float v8 __attribute__((vector_size(32)));

// dst[c][r] = src[r][c] for one 8 × 8 block, in registers (three interleave stages)
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    v8 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) std::memcpy(&r[i], src + i * lds, sizeof(v8));
    for (int i = 0; i < 8; i += 2) {  // interleave 32-bit pairs
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {  // interleave 64-bit pairs
        u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 4; ++i) {  // 128-bit halves
        const v8 lo = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        const v8 hi = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        std::memcpy(dst + i * ldd, &lo, sizeof(v8));
        std::memcpy(dst + (i + 4) * ldd, &hi, sizeof(v8));
    }
}

template <class T>
void transpose_scalar(const T* src, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t lds, T* dst, int64_t ldd) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * ldd + r] = src[r * lds + c];
}
}  // namespace

template <class T>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t lds, T* dst, int64_t ldd) {
    constexpr int64_t kB = 16;
    for (int64_t r0 = 0; r0 < rows; r0 += kB) {
        for (int64_t c0 = 0; c0 < cols; c0 += kB) {
            const int64_t r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
            if constexpr (std::is_same_v<T, float>) {
                if (r1 - r0 == kB && c1 - c0 == kB) {  // four 8 × 8 register transposes
                    for (int64_t i = 0; i < kB; i += 8)
                        for (int64_t j = 0; j < kB; j += 8)
                            transpose8x8(src + (r0 + i) * lds + c0 + j, lds, dst + (c0 + j) * ldd + r0 + i, ldd);
                    continue;
                }
            }
            transpose_scalar(src, r0, r1, c0, c1, lds, dst, ldd);
        }
    }
}
template void transpose<float>(const float*, int64_t, int64_t, int64_t, float*, int64_t);
template void transpose<double>(const double*, int64_t, int64_t, int64_t, double*, int64_t);

}  // namespace tessera::ops::cpu
