// The CUDA entry points of the KDA block's small ops: L2 norm, gated RMSNorm, the forget gate and the causal
// conv1d (training and the decoding step). The neutral entry points (ops/cpu/*.cpp) have checked shapes, dtypes
// and cu_seqlens already.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

void l2norm_forward(const L2NormParams& p, TensorView x, TensorView y) {
    dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        check_launch(launch_l2norm_forward<T>(carg<T>(x, "l2norm: x"), marg<T>(y, "l2norm: y"), p.eps, stream()),
                     "l2norm");
    });
}

void l2norm_backward(const L2NormParams& p, TensorView dy, TensorView x, TensorView dx) {
    dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        check_launch(launch_l2norm_backward<T>(carg<T>(dy, "l2norm: dy"), carg<T>(x, "l2norm: x"),
                                               marg<T>(dx, "l2norm: dx"), p.eps, stream()),
                     "l2norm backward");
    });
}

void gated_rmsnorm_forward(
    const GatedRmsNormParams& p, TensorView x, TensorView gate, TensorView weight, TensorView y) {
    dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        check_launch(launch_gated_rmsnorm_forward<T>(
                         carg<T>(x, "gated_rmsnorm: x"), carg<T>(gate, "gated_rmsnorm: gate"), weight.ptr<T>(),
                         marg<T>(y, "gated_rmsnorm: y"), p.eps, p.activation == GateActivation::silu, stream()),
                     "gated_rmsnorm");
    });
}

void gated_rmsnorm_backward(const GatedRmsNormParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView gate,
                            TensorView weight,
                            TensorView dx,
                            TensorView dgate,
                            TensorView dweight) {
    dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        const RowsArg<const T> X = carg<T>(x, "gated_rmsnorm: x");
        const RowsArg<T> none{nullptr, 0, 0, 0};
        auto* rstd = static_cast<T*>(scratch(sizeof(T) * size_t(X.rows)));
        check_launch(
            launch_gated_rmsnorm_backward<T>(carg<T>(dy, "gated_rmsnorm: dy"), X, carg<T>(gate, "gated_rmsnorm: gate"),
                                             weight.ptr<T>(), dx.defined() ? marg<T>(dx, "gated_rmsnorm: dx") : none,
                                             dgate.defined() ? marg<T>(dgate, "gated_rmsnorm: dgate") : none,
                                             dweight.defined() ? dweight.ptr<T>() : nullptr, rstd, p.eps,
                                             p.activation == GateActivation::silu, stream()),
            "gated_rmsnorm backward");
    });
}

void kda_gate_forward(const KdaGateParams& p, TensorView f, TensorView A_log, TensorView dt_bias, TensorView g) {
    const int64_t HV = f.size(-2), K = f.size(-1);
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        check_launch(launch_kda_gate_forward<T>(f.ptr<T>(), A_log.ptr<T>(), dt_bias.ptr<T>(), g.ptr<T>(),
                                                f.numel() / (HV * K), HV, K, p.lower_bound, stream()),
                     "kda_gate");
    });
}

void kda_gate_backward(const KdaGateParams& p,
                       TensorView dg,
                       TensorView f,
                       TensorView A_log,
                       TensorView dt_bias,
                       TensorView df,
                       TensorView dA_log,
                       TensorView ddt_bias) {
    const int64_t HV = f.size(-2), K = f.size(-1);
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        auto ptr = [](TensorView t) { return t.defined() ? t.ptr<T>() : nullptr; };
        check_launch(
            launch_kda_gate_backward<T>(dg.ptr<T>(), f.ptr<T>(), A_log.ptr<T>(), dt_bias.ptr<T>(), ptr(df), ptr(dA_log),
                                        ptr(ddt_bias), f.numel() / (HV * K), HV, K, p.lower_bound, stream()),
            "kda_gate backward");
    });
}

namespace {
ConvShape conv_shape(const CausalConv1dParams& p,
                     const TensorView& x,
                     const TensorView& w,
                     std::span<const int64_t> cu) {
    return {.tokens = x.size(0) * x.size(1),
            .T = x.size(1),
            .C = x.size(2),
            .W = w.size(1),
            .cu = cu.empty() ? nullptr : to_scratch(cu),
            .segments = cu.empty() ? x.size(0) : int64_t(cu.size()) - 1,
            .silu = p.activation == Activation::silu};
}
}  // namespace

void causal_conv1d_forward(
    const CausalConv1dParams& p, TensorView x, TensorView w, TensorView y, std::span<const int64_t> cu_seqlens) {
    const ConvShape s = conv_shape(p, x, w, cu_seqlens);
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        check_launch(launch_conv1d_forward<T>(s, x.ptr<T>(), w.ptr<T>(), y.ptr<T>(), stream()), "causal_conv1d");
    });
}

void causal_conv1d_backward(const CausalConv1dParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView w,
                            TensorView dx,
                            TensorView dw,
                            std::span<const int64_t> cu_seqlens) {
    TESSERA_CHECK(w.size(1) <= kConvMaxWidth, "causal_conv1d (CUDA): backward supports widths up to {}, not {}",
                  kConvMaxWidth, w.size(1));
    const ConvShape s = conv_shape(p, x, w, cu_seqlens);
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        check_launch(
            launch_conv1d_backward<T>(s, dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(), dx.defined() ? dx.ptr<T>() : nullptr,
                                      dw.defined() ? dw.ptr<T>() : nullptr, stream()),
            "causal_conv1d backward");
    });
}

void causal_conv1d_step(const CausalConv1dParams& p, TensorView x, TensorView w, TensorView window, TensorView y) {
    check_launch(launch_conv1d_step(x.size(0), x.size(1), w.size(1), p.activation == Activation::silu, x.ptr<float>(),
                                    w.ptr<float>(), window.ptr<float>(), y.ptr<float>(), stream()),
                 "causal_conv1d step");
}

}  // namespace tessera::ops::cuda
