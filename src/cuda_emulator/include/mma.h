// CUDA's warp matrix functions (mma.h, namespace nvcuda::wmma) as the CUDA emulator provides them: the 16×16×16 shape
// with bf16 operands and f32 accumulators, which tessera's kernels use. On a GPU a fragment is spread over the
// warp's 32 lanes in an unspecified layout; here every lane holds the whole tile (row-major in x), so code that treats
// x[0, num_elements) elementwise (the only layout-free use) works on both. Every function is warp-synchronous as on a
// GPU: the lanes meet at a warp barrier first (a lane that skips the call deadlocks the warp), then each computes the
// whole tile. A product sums its 16 terms in order into the f32 accumulator; bf16 × bf16 products are exact in f32,
// so only the order of the sums can differ from a GPU's tensor cores. Loads and stores check what CUDA requires and a
// GPU does not report: a 32-byte aligned pointer and a leading dimension of whole 16 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace nvcuda::wmma {

struct matrix_a;
struct matrix_b;
struct accumulator;
struct row_major;
struct col_major;
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator's WMMA has the 16x16x16 shape only");
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = rows * cols;
    T x[num_elements];  // the whole tile, row-major
};

namespace detail {
inline float widen(float v) { return v; }
inline float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
void check_memory(const T* p, unsigned ldm, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0) tessera::cuda_emulator::fault(what);
    if (ldm * sizeof(T) % 16 != 0 || ldm < 16) tessera::cuda_emulator::fault(what);
}

// element (r, c) of a tile at p with leading dimension ldm
template <class T>
const T& at(const T* p, unsigned ldm, bool row_major, int r, int c) {
    return row_major ? p[size_t(r) * ldm + size_t(c)] : p[size_t(c) * ldm + size_t(r)];
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout, class V>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& v) {
    tessera::cuda_emulator::warp_sync();
    for (T& e : f.x) e = T(v);
}

// matrix_a or matrix_b, its layout in the fragment's type
template <class Use, int M, int N, int K, class T, class Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
    static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>);
    tessera::cuda_emulator::warp_sync();
    detail::check_memory(p, ldm, "wmma::load_matrix_sync: a misaligned pointer or leading dimension");
    using F = fragment<Use, M, N, K, T, Layout>;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = detail::at(p, ldm, std::is_same_v<Layout, row_major>, r, c);
}

template <int M, int N, int K, class T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm, layout_t layout) {
    tessera::cuda_emulator::warp_sync();
    detail::check_memory(p, ldm, "wmma::load_matrix_sync: a misaligned pointer or leading dimension");
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) f.x[r * N + c] = detail::at(p, ldm, layout == mem_row_major, r, c);
}

template <int M, int N, int K, class T>
void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    tessera::cuda_emulator::warp_sync();
    detail::check_memory(p, ldm, "wmma::store_matrix_sync: a misaligned pointer or leading dimension");
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c)
            (layout == mem_row_major ? p[size_t(r) * ldm + size_t(c)] : p[size_t(c) * ldm + size_t(r)]) =
                f.x[r * N + c];
}

// d = a·b + c (d may be c)
template <int M, int N, int K, class T, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
    tessera::cuda_emulator::warp_sync();
    // The lanes of a warp come one after another with the same tiles: the last product is remembered (by value).
    struct Last {
        bool valid = false;
        fragment<matrix_a, M, N, K, T, LA> a;
        fragment<matrix_b, M, N, K, T, LB> b;
        fragment<accumulator, M, N, K, float> c, d;
    };
    static Last last;
    if (last.valid && std::memcmp(&last.a, &a, sizeof a) == 0 && std::memcmp(&last.b, &b, sizeof b) == 0 &&
        std::memcmp(&last.c, &c, sizeof c) == 0) {
        d = last.d;
        return;
    }
    last.a = a;
    last.b = b;
    last.c = c;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            float s = c.x[i * N + j];
            for (int k = 0; k < K; ++k) s += detail::widen(a.x[i * K + k]) * detail::widen(b.x[k * N + j]);
            last.d.x[i * N + j] = s;
        }
    last.valid = true;
    d = last.d;
}

}  // namespace nvcuda::wmma
