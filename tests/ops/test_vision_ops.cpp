// The image tower's ops (ops/vision.h) against values and loops written out here: GELU at known points, the 2-D
// RoPE's angles element by element, the position table's bilinear taps at hand-computed points, the 2x2 merge's
// row order; every backward against central finite differences in f64 (a backward that is not the forward's
// adjoint fails), and the thread count not changing a bit.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <vector>

#include "ops/vision.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using ops::PatchGrid;

double& at(Tensor& t, int64_t i) { return t.ptr<double>()[i]; }

// Σ_i w_i·f(x)_i for fixed random w, as a function of x: its gradient by central differences against backward.
void expect_adjoint(Tensor& x,
                    Shape out_shape,
                    const std::function<void(const Tensor& x, Tensor& y)>& forward,
                    const std::function<void(const Tensor& dy, Tensor& dx)>& backward,
                    uint64_t seed) {
    const Tensor w = test::randn(DType::f64, out_shape, seed);
    auto loss = [&] {
        Tensor y = Tensor(DType::f64, out_shape);
        forward(x, y);
        double s = 0;
        for (int64_t i = 0; i < y.numel(); ++i) s += w.ptr<double>()[i] * y.ptr<double>()[i];
        return s;
    };
    Tensor dx = Tensor(DType::f64, x.shape());
    backward(w, dx);
    Tensor num = Tensor(DType::f64, x.shape());
    const double h = 1e-6;
    for (int64_t i = 0; i < x.numel(); ++i) {
        const double keep = at(x, i);
        at(x, i) = keep + h;
        const double up = loss();
        at(x, i) = keep - h;
        const double down = loss();
        at(x, i) = keep;
        at(num, i) = (up - down) / (2 * h);
    }
    EXPECT_TRUE(test::all_close(dx, num, 1e-6, 1e-8));
}

TEST(VisionOps, GeluMatchesItsDefinitions) {
    Tensor x = Tensor(DType::f64, Shape{1, 4});
    const double xs[] = {1.0, -2.0, 0.0, 3.5};
    for (int i = 0; i < 4; ++i) at(x, i) = xs[i];
    Tensor y = Tensor(DType::f64, Shape{1, 4});
    ops::gelu_forward(ops::Gelu::erf, x, y);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(at(y, i), xs[i] * 0.5 * std::erfc(-xs[i] / std::sqrt(2.0)), 1e-15);
    EXPECT_NEAR(at(y, 0), 0.8413447460685429, 1e-15);  // Φ(1)
    ops::gelu_forward(ops::Gelu::tanh, x, y);
    for (int i = 0; i < 4; ++i) {
        const double u = std::sqrt(2.0 / M_PI) * (xs[i] + 0.044715 * xs[i] * xs[i] * xs[i]);
        EXPECT_NEAR(at(y, i), 0.5 * xs[i] * (1 + std::tanh(u)), 1e-15);
    }
    EXPECT_NEAR(at(y, 0), 0.8411919906082768, 1e-15);
}

TEST(VisionOps, GeluBackwardIsItsDerivative) {
    for (ops::Gelu kind : {ops::Gelu::erf, ops::Gelu::tanh}) {
        Tensor x = test::randn(DType::f64, Shape{3, 5}, 1, 2.0);
        expect_adjoint(
            x, Shape{3, 5}, [&](const Tensor& a, Tensor& y) { ops::gelu_forward(kind, a, y); },
            [&](const Tensor& dy, Tensor& dx) { ops::gelu_backward(kind, dy, x, dx); }, 2);
    }
}

const std::vector<PatchGrid> kGrids{{2, 3}, {4, 2}};  // 14 patches

TEST(VisionOps, Rope2dTurnsEvenPairsByTheColumnAndOddPairsByTheRow) {
    const int64_t N = 14, H = 2, D = 8;
    const Tensor x = test::randn(DType::f64, Shape{N, H, D}, 3);
    Tensor y = Tensor(DType::f64, Shape{N, H, D});
    const double theta = 100.0;
    ops::rope_2d_forward(theta, kGrids, x, y);
    int64_t n = 0;
    for (const PatchGrid& g : kGrids) {
        for (int64_t p = 0; p < g.patches(); ++p, ++n) {
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t i = 0; i < D / 2; ++i) {
                    const double pos = i % 2 == 0 ? double(p % g.w) : double(p / g.w);
                    const double a = pos * std::pow(theta, -4.0 * double(i / 2) / double(D));
                    const double* s = x.ptr<double>() + (n * H + h) * D + 2 * i;
                    const double* d = y.ptr<double>() + (n * H + h) * D + 2 * i;
                    EXPECT_NEAR(d[0], s[0] * std::cos(a) - s[1] * std::sin(a), 1e-14);
                    EXPECT_NEAR(d[1], s[1] * std::cos(a) + s[0] * std::sin(a), 1e-14);
                }
            }
        }
    }
    Tensor x2 = test::randn(DType::f64, Shape{N, H, D}, 4);
    expect_adjoint(
        x2, Shape{N, H, D}, [&](const Tensor& a, Tensor& out) { ops::rope_2d_forward(theta, kGrids, a, out); },
        [&](const Tensor& dy, Tensor& dx) { ops::rope_2d_backward(theta, kGrids, dy, dx); }, 5);
}

TEST(VisionOps, PosEmbedUsesTheTableAsIsOrItsBilinearTaps) {
    // table [2, 4, 1]: value 10·r + c
    Tensor table = Tensor(DType::f64, Shape{2, 4, 1});
    for (int64_t r = 0; r < 2; ++r)
        for (int64_t c = 0; c < 4; ++c) at(table, r * 4 + c) = 10.0 * double(r) + double(c);
    const std::vector<PatchGrid> grids{{2, 4}, {4, 2}};
    Tensor x = Tensor(DType::f64, Shape{16, 1});
    ops::pos_embed_forward(grids, table, x);
    for (int64_t p = 0; p < 8; ++p) EXPECT_EQ(at(x, p), at(table, p));  // the table's own size: no resize
    // 2 → 4 rows: source (d + 0.5)/2 − 0.5 = −0.25 (clamped to 0), 0.25, 0.75, 1.25 (upper tap clamped to row 1);
    // 4 → 2 columns: (d + 0.5)·2 − 0.5 = 0.5, 2.5
    const double rows[] = {0.0, 0.25, 0.75, 1.0}, cols[] = {0.5, 2.5};
    for (int64_t r = 0; r < 4; ++r)
        for (int64_t c = 0; c < 2; ++c) EXPECT_NEAR(at(x, 8 + r * 2 + c), 10.0 * rows[r] + cols[c], 1e-12);

    Tensor t2 = test::randn(DType::f64, Shape{3, 4, 5}, 6);
    const std::vector<PatchGrid> mixed{{3, 4}, {2, 6}, {5, 3}};
    expect_adjoint(
        t2, Shape{39, 5}, [&](const Tensor& tab, Tensor& out) { ops::pos_embed_forward(mixed, tab, out); },
        [&](const Tensor& dy, Tensor& dtab) { ops::pos_embed_backward(mixed, dy, dtab); }, 8);
}

TEST(VisionOps, PatchMergePutsEachCellsPatchesSideBySide) {
    const std::vector<PatchGrid> grids{{2, 4}, {4, 2}};
    Tensor x = Tensor(DType::f64, Shape{16, 1});
    for (int64_t i = 0; i < 16; ++i) at(x, i) = double(i);
    Tensor y = Tensor(DType::f64, Shape{4, 4});
    ops::patch_merge_forward(grids, 2, 2, x, y);
    // image 0 (2x4): cells (0,0) = patches 0 1 4 5, (0,1) = 2 3 6 7; image 1 (4x2, from 8): 8 9 10 11, 12 13 14 15
    const double want[] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(at(y, i), want[i]) << i;
    Tensor x2 = test::randn(DType::f64, Shape{16, 3}, 9);
    expect_adjoint(
        x2, Shape{4, 12}, [&](const Tensor& a, Tensor& out) { ops::patch_merge_forward(grids, 2, 2, a, out); },
        [&](const Tensor& dy, Tensor& dx) { ops::patch_merge_backward(grids, 2, 2, dy, dx); }, 10);
    test::expect_error(
        [&] {
            ops::patch_merge_forward({{{3, 4}}}, 2, 2, x.view().prefix(Shape{12, 1}), y);
        },
        "not whole 2x2 cells");
}

TEST(VisionOps, ResultsDoNotDependOnTheThreadCount) {
    const std::vector<PatchGrid> grids{{6, 4}, {2, 10}};
    const Tensor table = test::randn(DType::f32, Shape{4, 4, 96}, 11), dx = test::randn(DType::f32, Shape{44, 96}, 12);
    const Tensor x = test::randn(DType::f32, Shape{44, 2, 48}, 13);
    auto run = [&](int threads) {
        omp_set_num_threads(threads);
        std::vector<Tensor> out;
        out.push_back(Tensor(DType::f32, Shape{4, 4, 96}));
        ops::pos_embed_backward(grids, dx, out.back());
        out.push_back(Tensor(DType::f32, Shape{44, 2, 48}));
        ops::rope_2d_forward(500.0, grids, x, out.back());
        return out;
    };
    const int keep = omp_get_max_threads();
    const std::vector<Tensor> one = run(1), two = run(2), three = run(3);
    omp_set_num_threads(keep);
    for (size_t i = 0; i < one.size(); ++i) {
        EXPECT_TRUE(test::bitwise_equal(one[i], two[i]));
        EXPECT_TRUE(test::bitwise_equal(one[i], three[i]));
    }
}

}  // namespace
}  // namespace tessera
