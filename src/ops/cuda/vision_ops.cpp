// The image tower's ops on CUDA (ops/vision.h): the host computes each call's small tables with the CPU's own
// arithmetic (a patch's column and row, the position table's taps, the merge's source rows), uploads them into the
// thread's scratch in one request, and launches the kernels of vision.cu.
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

namespace {
// [B = 1, T = N, H, D] kernel arguments of an [N, H, D] view (T const-qualified for an input)
template <class T>
HeadsArg<T> patch_heads(const TensorView& v) {
    return {v.ptr<std::remove_const_t<T>>(), 0, v.strides[0], v.strides[1]};
}

void rotate_2d(double theta, std::span<const PatchGrid> grids, TensorView src, TensorView dst, double sign, bool acc) {
    const int64_t N = src.size(0), H = src.size(1), D = src.size(2);
    thread_local std::vector<int32_t> colrow;  // host tables grow only: no allocation once the largest call ran
    colrow.clear();
    for (const PatchGrid& g : grids) {
        for (int64_t p = 0; p < g.patches(); ++p) {
            colrow.push_back(int32_t(p % g.w));
            colrow.push_back(int32_t(p / g.w));
        }
    }
    std::array<double, 256> freq{};  // D/4 <= 256: checked by the neutral entry point
    for (int64_t j = 0; j < D / 4; ++j) freq[size_t(j)] = std::pow(theta, -4.0 * double(j) / double(D));
    const size_t a = scratch_part(colrow.size() * sizeof(int32_t));
    std::byte* s = static_cast<std::byte*>(scratch(a + size_t(D / 4) * sizeof(double)));
    const int32_t* d_colrow = upload(s, std::span<const int32_t>(colrow));
    const double* d_freq = upload(s + a, std::span<const double>(freq.data(), size_t(D / 4)));
    dispatch_float(src.dtype, "rope_2d", [&]<class T>(T) {
        check_launch(launch_rope_2d<T>(patch_heads<const T>(src), patch_heads<T>(dst), N, H, D, d_colrow, d_freq, sign,
                                       acc, stream()),
                     "rope_2d");
    });
}

const PosTaps* upload_taps(std::span<const PatchGrid> grids, int64_t Ht, int64_t Wt) {
    thread_local std::vector<PosTaps> taps;
    taps.clear();
    for (const PatchGrid& g : grids) {
        for (int64_t p = 0; p < g.patches(); ++p) {
            const BilinearTaps r = bilinear_taps(p / g.w, Ht, g.h), c = bilinear_taps(p % g.w, Wt, g.w);
            taps.push_back({{r.i0 * Wt + c.i0, r.i0 * Wt + c.i1, r.i1 * Wt + c.i0, r.i1 * Wt + c.i1},
                            {r.w0 * c.w0, r.w0 * c.w1, r.w1 * c.w0, r.w1 * c.w1}});
        }
    }
    return to_scratch(std::span<const PosTaps>(taps));
}

const int64_t* upload_merge(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, int64_t merged) {
    thread_local std::vector<int64_t> src;
    src.resize(size_t(merged * kh * kw));
    for_each_merge_slot(grids, kh, kw, [&](int64_t m, int64_t s, int64_t n) { src[size_t(m * kh * kw + s)] = n; });
    return to_scratch(std::span<const int64_t>(src));
}
}  // namespace

void gelu_forward(Gelu kind, TensorView x, TensorView y) {
    dispatch_float(x.dtype, "gelu", [&]<class T>(T) {
        check_launch(launch_gelu_forward<T>(kind == Gelu::tanh, carg<T>(x, "gelu: x"), marg<T>(y, "gelu: y"), stream()),
                     "gelu");
    });
}

void gelu_backward(Gelu kind, TensorView dy, TensorView x, TensorView dx) {
    dispatch_float(x.dtype, "gelu", [&]<class T>(T) {
        check_launch(launch_gelu_backward<T>(kind == Gelu::tanh, carg<T>(dy, "gelu: dy"), carg<T>(x, "gelu: x"),
                                             marg<T>(dx, "gelu: dx"), stream()),
                     "gelu backward");
    });
}

void rope_2d_forward(double theta, std::span<const PatchGrid> grids, TensorView x, TensorView y) {
    rotate_2d(theta, grids, x, y, +1.0, false);
}

void rope_2d_backward(double theta, std::span<const PatchGrid> grids, TensorView dy, TensorView dx) {
    rotate_2d(theta, grids, dy, dx, -1.0, true);
}

void pos_embed_forward(std::span<const PatchGrid> grids, TensorView table, TensorView x) {
    const PosTaps* taps = upload_taps(grids, table.size(0), table.size(1));
    dispatch_float(x.dtype, "pos_embed", [&]<class T>(T) {
        check_launch(launch_pos_embed_forward<T>(taps, table.ptr<T>(), marg<T>(x, "pos_embed: x"), stream()),
                     "pos_embed");
    });
}

void pos_embed_backward(std::span<const PatchGrid> grids, TensorView dx, TensorView dtable) {
    const PosTaps* taps = upload_taps(grids, dtable.size(0), dtable.size(1));
    dispatch_float(dx.dtype, "pos_embed", [&]<class T>(T) {
        check_launch(launch_pos_embed_backward<T>(taps, carg<T>(dx, "pos_embed: dx"), dtable.ptr<T>(), stream()),
                     "pos_embed backward");
    });
}

void patch_merge_forward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView x, TensorView y) {
    const int64_t* src = upload_merge(grids, kh, kw, y.size(0));
    dispatch_float(x.dtype, "patch_merge", [&]<class T>(T) {
        check_launch(launch_move_rows<T>(RowMove::gather, marg<T>(x, "patch_merge: x"), marg<T>(y, "patch_merge: y"),
                                         kh * kw, src, y.size(0) * kh * kw, x.size(1), stream()),
                     "patch_merge");
    });
}

void patch_merge_backward(std::span<const PatchGrid> grids, int64_t kh, int64_t kw, TensorView dy, TensorView dx) {
    const int64_t* src = upload_merge(grids, kh, kw, dy.size(0));
    dispatch_float(dx.dtype, "patch_merge", [&]<class T>(T) {
        check_launch(
            launch_move_rows<T>(RowMove::scatter_add, marg<T>(dx, "patch_merge: dx"), marg<T>(dy, "patch_merge: dy"),
                                kh * kw, src, dy.size(0) * kh * kw, dx.size(1), stream()),
            "patch_merge backward");
    });
}

void scatter_rows(TensorView src, std::span<const int64_t> at, TensorView dst) {
    const int64_t* idx = to_scratch(at);
    check_launch(launch_move_rows<float>(RowMove::scatter, marg<float>(dst, "scatter_rows: dst"),
                                         marg<float>(src, "scatter_rows: src"), 1, idx, int64_t(at.size()), dst.size(1),
                                         stream()),
                 "scatter_rows");
}

void zero_rows_at(TensorView t, std::span<const int64_t> at) {
    const int64_t* idx = to_scratch(at);
    const RowsArg<float> rows = marg<float>(t, "zero_rows_at: t");
    check_launch(launch_move_rows<float>(RowMove::zero, rows, rows, 1, idx, int64_t(at.size()), rows.cols, stream()),
                 "zero_rows_at");
}

}  // namespace tessera::ops::cuda
