// The CUDA entry points of the MoE router (ops/router.h): the score function, selection, gate weights and their
// backward (the logits' GEMM is linear's). The neutral entry points (ops/cpu/router.cpp) have checked shapes,
// dtypes and the parameters already. The aux losses read their per-row or per-sequence values back and sum them on
// the host in the CPU's order.
#include <vector>

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
        check_launch(launch_router_select<T>(p.row(), scores.ptr<T>(), ptr_or_null<T>(bias), N, E,
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

double router_seq_aux_loss(double alpha,
                           TensorView scores,
                           TensorView indices,
                           std::span<const int64_t> starts,
                           TensorView dscores,
                           std::span<double> /*scratch*/) {
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1), nseq = int64_t(starts.size()) - 1;
    double loss = 0;
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        // one scratch request: starts, z [N], f and P [nseq, E], ls [nseq]
        const size_t sb = scratch_part(starts.size_bytes()), zb = scratch_part(8 * size_t(N)),
                     fb = 8 * size_t(nseq * E);
        auto* base = static_cast<std::byte*>(scratch(sb + zb + scratch_part(2 * fb) + 8 * size_t(nseq)));
        const RouterAuxArgs<T> a{scores.ptr<T>(),
                                 indices.ptr<int32_t>(),
                                 upload(base, starts),
                                 reinterpret_cast<double*>(base + sb),
                                 N,
                                 E,
                                 K};
        auto* f = reinterpret_cast<double*>(base + sb + zb);
        auto* ls = reinterpret_cast<double*>(base + sb + zb + scratch_part(2 * fb));
        check_launch(launch_router_seq_aux<T>(a, nseq, alpha, f, f + nseq * E, ls, ptr_or_null<T>(dscores), stream()),
                     "router seq aux loss");
        for (const double v : download(ls, size_t(nseq))) loss += alpha * v / double(nseq);
    });
    return loss;
}

void router_balance_stats(TensorView scores,
                          TensorView indices,
                          std::span<double> choices,
                          std::span<double> prob_sums) {
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const int64_t range[2] = {0, N};
        const size_t zb = scratch_part(8 * size_t(N)), eb = scratch_part(8 * size_t(E));
        auto* base = static_cast<std::byte*>(scratch(256 + zb + 2 * eb));
        auto* c = reinterpret_cast<double*>(base + 256 + zb);
        auto* pr = reinterpret_cast<double*>(base + 256 + zb + eb);
        upload(c, std::span<const double>(choices));
        upload(pr, std::span<const double>(prob_sums));
        const RouterAuxArgs<T> a{scores.ptr<T>(),
                                 indices.ptr<int32_t>(),
                                 upload(base, std::span<const int64_t>(range)),
                                 reinterpret_cast<double*>(base + 256),
                                 N,
                                 E,
                                 K};
        check_launch(launch_router_balance_stats<T>(a, c, pr, stream()), "router balance stats");
        const std::vector<double> hc = download(c, size_t(E)), hp = download(pr, size_t(E));
        std::copy(hc.begin(), hc.end(), choices.begin());
        std::copy(hp.begin(), hp.end(), prob_sums.begin());
    });
}

void router_balance_backward(std::span<const double> grad, TensorView scores, TensorView dscores) {
    const int64_t N = scores.size(0), E = scores.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const RouterAuxArgs<T> a{scores.ptr<T>(), nullptr, nullptr, nullptr, N, E, 0};
        check_launch(launch_router_balance_backward<T>(a, to_scratch(grad), dscores.ptr<T>(), stream()),
                     "router balance backward");
    });
}

double router_z_loss(double beta, TensorView logits, TensorView dlogits) {
    double loss = 0;
    dispatch_float(logits.dtype, "router z-loss", [&]<class T>(T) {
        const RowsArg<const T> U = carg<T>(logits, "router: logits");
        auto* lse = static_cast<double*>(scratch(8 * size_t(U.rows)));
        check_launch(launch_router_z_loss<T>(U, beta, lse, ptr_or_null<T>(dlogits), stream()), "router z-loss");
        const double N = double(U.rows);
        for (const double l : download(lse, size_t(U.rows))) loss += beta * l * l / N;
    });
    return loss;
}

}  // namespace tessera::ops::cuda
