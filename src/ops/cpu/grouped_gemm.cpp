// Grouped GEMMs over expert-contiguous rows (see grouped_gemm.h).
#include "ops/grouped_gemm.h"

#include <omp.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

namespace tessera::ops {

namespace {
constexpr int64_t kRowBlock = 256;  // M-grouped tile: up to this many rows of one expert, all columns
// K-grouped: an expert's weight gradient is cut into bands of output rows, one band per this many of its rows (each
// band re-reads all the expert's rows, and oneDNN packs them per call, so fewer bands read less; more bands balance
// the threads when one expert holds much of the call; the numbers are in bench/RESULTS.md, MoE). The bands depend on
// the expert's own rows only, not on the call's: expert parallelism's chunks of experts then compute every expert
// with the bands of one call over all of them (oneDNN's AVX2 sgemm rounds differently with m).
constexpr int64_t kGradRowsPerBand = 2048;

// A tile: one single-threaded GEMM (ops::gemm inside a parallel region) on rows [r0, r0 + rows) of expert e, output
// rows [m0, m0 + m) of the K-grouped kind. Tile boundaries depend only on the layout, never on the thread count, and
// each output element belongs to one tile. The tiles go to the threads biggest first, each to the thread with the
// least work so far (longest processing time first), before the region starts: with skewed routing the few large
// experts' tiles spread out and the small ones fill in (dealing them round-robin left one thread with ~55% of the
// work at E = 896 under Zipf routing, the experts' loads alternating between the threads). Which thread runs a tile
// changes no bit; the assignment is still fixed by the layout and the thread count, so a run repeats exactly.
struct Tile {
    int64_t e, r0, rows, m0, m;
    double cost;
    int owner;
};

template <class Fn>
void run_tiles(std::vector<Tile>& tiles, Fn&& fn) {
    // (std::sort with a total order, not stable_sort: that one allocates on every call, and the step makes no heap
    // allocation after its first)
    std::sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
        if (a.cost != b.cost) return a.cost > b.cost;
        return std::tie(a.e, a.r0, a.m0) < std::tie(b.e, b.r0, b.m0);
    });
    const int planned = omp_get_max_threads();
    thread_local std::vector<double> load;
    load.assign(size_t(planned), 0.0);
    for (Tile& t : tiles) {
        t.owner = int(std::min_element(load.begin(), load.end()) - load.begin());
        load[size_t(t.owner)] += t.cost;
    }
#pragma omp parallel
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        for (size_t i = 0; i < tiles.size(); ++i)
            if ((nt == planned ? tiles[i].owner : int(i % size_t(nt))) == me) fn(tiles[i]);
    }
}

// the tile list of a call, reused (a grouped GEMM runs on its caller's thread: one list per thread)
std::vector<Tile>& tile_list() {
    thread_local std::vector<Tile> tiles;
    tiles.clear();
    return tiles;
}

// expert e's weight: B + e·stride, or its own address when the experts are stored apart (MXFP4 ones in the checkpoint's
// layout: core/tensor.h)
template <class TB>
TB expert_weight(TB B, int64_t stride, void* const* slices, int64_t e) {
    if (!slices) return B + e * stride;
    if constexpr (std::is_same_v<TB, Mxfp4>) {
        return Mxfp4{static_cast<const uint8_t*>(slices[2 * e]), 0, static_cast<const uint8_t*>(slices[2 * e + 1])};
    } else {
        return static_cast<TB>(slices[e]);
    }
}

// B: the experts' weights in T, or held narrow (bf16, MXFP4: widened by ops::gemm)
template <class T, class TB>
void m_grouped(Trans tb,
               const ExpertRows& g,
               int64_t N,
               int64_t K,
               const T* A,
               int64_t lda,
               TB B,
               int64_t b_stride,
               int64_t ldb,
               T beta,
               T* C,
               int64_t ldc,
               void* const* b_slices) {
    std::vector<Tile>& tiles = tile_list();
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t r1 = g.offsets[e + 1];
        for (int64_t m0 = g.offsets[e]; m0 < r1; m0 += kRowBlock) {
            const int64_t rows = std::min(kRowBlock, r1 - m0);
            tiles.push_back({e, m0, rows, 0, 0, double(rows), 0});
        }
    }
    run_tiles(tiles, [&](const Tile& t) {
        gemm(Trans::N, tb, t.rows, N, K, T(1), A + t.r0 * lda, lda, expert_weight(B, b_stride, b_slices, t.e), ldb,
             beta, C + t.r0 * ldc, ldc);
    });
}

template <class T>
void k_grouped(const ExpertRows& g,
               int64_t M,
               int64_t N,
               const T* A,
               int64_t lda,
               const T* B,
               int64_t ldb,
               T* C,
               int64_t c_stride,
               int64_t ldc) {
    std::vector<Tile>& tiles = tile_list();
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t r0 = g.offsets[e], rows = g.offsets[e + 1] - r0;
        if (rows == 0) continue;
        const int64_t bands = std::clamp<int64_t>(rows / kGradRowsPerBand, 1, (M + 7) / 8);
        const int64_t band = (M + bands * 8 - 1) / (bands * 8) * 8;
        for (int64_t m0 = 0; m0 < M; m0 += band) {
            const int64_t m = std::min(band, M - m0);
            tiles.push_back({e, r0, rows, m0, m, double(rows) * double(m), 0});
        }
    }
    run_tiles(tiles, [&](const Tile& t) {
        gemm(Trans::T, Trans::N, t.m, N, t.rows, T(1), A + t.r0 * lda + t.m0, lda, B + t.r0 * ldb, ldb, T(1),
             C + t.e * c_stride + t.m0 * ldc, ldc);
    });
}
}  // namespace

void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  const float* B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  const bf16* B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const float* A,
                  int64_t lda,
                  Mxfp4 B,
                  int64_t b_stride,
                  int64_t ldb,
                  float beta,
                  float* C,
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
void grouped_gemm(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  const double* A,
                  int64_t lda,
                  const double* B,
                  int64_t b_stride,
                  int64_t ldb,
                  double beta,
                  double* C,
                  int64_t ldc,
                  void* const* b_slices) {
    m_grouped(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, b_slices);
}
void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const float* A,
                        int64_t lda,
                        const float* B,
                        int64_t ldb,
                        float* C,
                        int64_t c_stride,
                        int64_t ldc) {
    k_grouped(g, M, N, A, lda, B, ldb, C, c_stride, ldc);
}
void grouped_gemm_wgrad(const ExpertRows& g,
                        int64_t M,
                        int64_t N,
                        const double* A,
                        int64_t lda,
                        const double* B,
                        int64_t ldb,
                        double* C,
                        int64_t c_stride,
                        int64_t ldc) {
    k_grouped(g, M, N, A, lda, B, ldb, C, c_stride, ldc);
}

}  // namespace tessera::ops
