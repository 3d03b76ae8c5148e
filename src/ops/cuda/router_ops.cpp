// The CUDA entry points of the MoE router (ops/router.h): the score function, selection, gate weights and their
// backward (the logits' GEMM is linear's). The neutral entry points (ops/cpu/router.cpp) have checked shapes,
// dtypes and the parameters already; the aux losses are CPU-only for now.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

void router_score_function(const RouterParams& p, TensorView logits, TensorView scores) {
    dispatch_float(logits.dtype, "router", [&]<class T>(T) {
        check_launch(launch_router_scores<T>(carg<T>(logits, "router: logits"), marg<T>(scores, "router: scores"),
                                             p.score == RouterScore::softmax, stream()),
                     "router scores");
    });
}

void router_select(const RouterParams& p,
                   TensorView scores,
                   TensorView bias,
                   TensorView indices,
                   TensorView weights,
                   TensorView counts) {
    const int64_t N = scores.size(0), E = scores.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        check_launch(launch_router_select<T>(p.row(), scores.ptr<T>(), bias.defined() ? bias.ptr<T>() : nullptr, N, E,
                                             indices.ptr<int32_t>(), weights.ptr<T>(), counts.ptr<int32_t>(), stream()),
                     "router select");
    });
}

void router_weights(const RouterParams& p, TensorView scores, TensorView indices, TensorView weights) {
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        check_launch(launch_router_weights<T>(p.row(), scores.ptr<T>(), indices.ptr<int32_t>(), weights.ptr<T>(),
                                              scores.size(0), scores.size(1), indices.size(1), stream()),
                     "router weights");
    });
}

void router_weights_backward(
    const RouterParams& p, TensorView dweights, TensorView scores, TensorView indices, TensorView dscores) {
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        check_launch(launch_router_weights_backward<T>(p.row(), dweights.ptr<T>(), scores.ptr<T>(),
                                                       indices.ptr<int32_t>(), dscores.ptr<T>(), scores.size(0),
                                                       scores.size(1), indices.size(1), stream()),
                     "router weights backward");
    });
}

void router_score_backward(const RouterParams& p, TensorView scores, TensorView dscores, TensorView dlogits) {
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        check_launch(launch_router_score_backward<T>(
                         carg<T>(scores, "router: scores"), carg<T>(dscores, "router: dscores"),
                         marg<T>(dlogits, "router: dlogits"), p.score == RouterScore::softmax, stream()),
                     "router score backward");
    });
}

}  // namespace tessera::ops::cuda
