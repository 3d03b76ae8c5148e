// The CUDA entry points of LayerNorm, RoPE, SiTU-GLU and the Attention Residuals mix: operand layouts for the
// launchers. The neutral entry points (ops/cpu/*.cpp) have checked shapes and dtypes already.
#include <array>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

void layernorm_forward(const LayerNormParams& p,
                       TensorView x,
                       TensorView w,
                       TensorView b,
                       TensorView y,
                       TensorView mean,
                       TensorView rstd) {
    dispatch_float(x.dtype, "layernorm", [&]<class T>(T) {
        check_launch(
            launch_layernorm_forward<T>(carg<T>(x, "layernorm: x"), w.ptr<T>(), b.ptr<T>(), marg<T>(y, "layernorm: y"),
                                        mean.ptr<T>(), rstd.ptr<T>(), p.eps, stream()),
            "layernorm");
    });
}

void layernorm_backward(const LayerNormParams&,
                        TensorView dy,
                        TensorView x,
                        TensorView w,
                        TensorView mean,
                        TensorView rstd,
                        TensorView dx,
                        TensorView dw,
                        TensorView db) {
    dispatch_float(x.dtype, "layernorm", [&]<class T>(T) {
        const RowsArg<T> DX = dx.defined() ? marg<T>(dx, "layernorm: dx") : RowsArg<T>{nullptr, 0, 0, 0};
        const RowsArg<const T> X = carg<T>(x, "layernorm: x");
        T* slabs = dw.defined() ? column_slabs_scratch<T>(X.rows, X.cols, 2) : nullptr;
        check_launch(
            launch_layernorm_backward<T>(carg<T>(dy, "layernorm: dy"), X, w.ptr<T>(), mean.ptr<T>(), rstd.ptr<T>(), DX,
                                         ptr_or_null<T>(dw), ptr_or_null<T>(db), slabs, stream()),
            "layernorm backward");
    });
}

namespace {
// dst (+)= m·R(sign·angle)·src over [B, T, H, D] views (ops/rope.h)
void rotate(const RopeParams& p, TensorView src, TensorView dst, double sign, bool accumulate) {
    const int64_t D = src.size(3);
    std::array<double, 512> inv_freq{};  // D/2 <= 512: checked by the neutral entry point
    rope_inv_freq(p, D, std::span(inv_freq.data(), size_t(D / 2)));
    const double* freq = to_scratch(std::span<const double>(inv_freq.data(), size_t(D / 2)));
    const RopeShape s{.B = src.size(0),
                      .T = src.size(1),
                      .H = src.size(2),
                      .D = D,
                      .offset = p.offset,
                      .interleaved = p.interleaved,
                      .accumulate = accumulate,
                      .m = p.scaling.cos_sin_factor(),
                      .sign = sign};
    dispatch_float(src.dtype, "rope", [&]<class T>(T) {
        const HeadsArg<const T> a = cheads<T>(src);
        const HeadsArg<T> b = heads<T>(dst);
        check_launch(launch_rope<T>(s, freq, a, b, stream()), "rope");
    });
}
}  // namespace

void rope_forward(const RopeParams& p, TensorView x, TensorView y) { rotate(p, x, y, +1.0, false); }
void rope_backward(const RopeParams& p, TensorView dy, TensorView dx) { rotate(p, dy, dx, -1.0, true); }

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y) {
    dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        check_launch(launch_situ_glu_forward<T>(p.beta, p.linear_beta, carg<T>(gate, "situ_glu: gate"),
                                                carg<T>(up, "situ_glu: up"), marg<T>(y, "situ_glu: y"), stream()),
                     "situ_glu");
    });
}

void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        check_launch(
            launch_situ_glu_backward<T>(p.beta, p.linear_beta, carg<T>(dy, "situ_glu: dy"),
                                        carg<T>(gate, "situ_glu: gate"), carg<T>(up, "situ_glu: up"),
                                        marg<T>(dgate, "situ_glu: dgate"), marg<T>(dup, "situ_glu: dup"), stream()),
            "situ_glu backward");
    });
}

namespace {
template <class T>
MixArg<T> mix_arg(std::span<const TensorView> sources) {
    MixArg<T> m{};
    m.S = int64_t(sources.size());
    m.N = sources[0].size(0);
    m.C = sources[0].size(1);
    for (size_t i = 0; i < sources.size(); ++i) m.src[i] = sources[i].ptr<T>();
    return m;
}
}  // namespace

void attn_res_mix_forward(const AttnResParams& p,
                          std::span<const TensorView> sources,
                          TensorView gamma,
                          TensorView w,
                          TensorView out,
                          TensorView probs,
                          TensorView) {
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        check_launch(launch_attn_res_forward<T>(mix_arg<T>(sources), gamma.ptr<T>(), w.ptr<T>(), out.ptr<T>(),
                                                probs.ptr<T>(), p.eps, stream()),
                     "attn_res_mix");
    });
}

void attn_res_mix_backward(const AttnResParams& p,
                           TensorView dout,
                           std::span<const TensorView> sources,
                           TensorView gamma,
                           TensorView w,
                           TensorView probs,
                           std::span<const TensorView> dsources,
                           TensorView dgamma,
                           TensorView dw,
                           TensorView scratch) {
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        MixGradArg<T> dm{};
        for (size_t i = 0; i < dsources.size(); ++i) dm.dsrc[i] = dsources[i].ptr<T>();
        T* ds_rs = scratch.ptr<T>() + gamma.numel();  // the CPU's layout: w⊙γ [C], then ds and r [N, S] each
        const MixArg<T> m = mix_arg<T>(sources);
        T* slabs = dgamma.defined() ? column_slabs_scratch<T>(m.N, m.C, 1) : nullptr;
        check_launch(
            launch_attn_res_backward<T>(m, dout.ptr<T>(), gamma.ptr<T>(), w.ptr<T>(), probs.ptr<T>(), dm,
                                        ptr_or_null<T>(dgamma), ptr_or_null<T>(dw), ds_rs, slabs, p.eps, stream()),
            "attn_res_mix backward");
    });
}

}  // namespace tessera::ops::cuda
