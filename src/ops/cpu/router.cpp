// MoE router: the entry points (checks, then CUDA tensors to ops/cuda for the scores, the selection, the gate
// weights and their backward; the aux losses are CPU-only for now) and the CPU loops. One token's selection and
// gate weights are the row functions of ops/router_rows.h, shared with the CUDA kernels.
#include "ops/router.h"

#include <cmath>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"
#include "ops/linear.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;
using cpu::Rows;
using cpu::rows_of;

namespace {

// A gradient shaped, typed and laid out like its input (absent: nothing to check).
void check_dscores(const TensorView& x, const TensorView& dx, const char* what = "router: dscores") {
    if (!dx.defined()) return;
    check_shape(dx, x.shape, what);
    check_dtype(dx, x.dtype, what);
    check_contiguous(dx, what);
}

void check_router_shapes(const TensorView& scores,
                         const TensorView& indices,
                         const TensorView& weights,
                         std::string_view where) {
    TESSERA_CHECK(scores.ndim() == 2, "{}: scores must be [N, E], not {}", where, scores.shape.str());
    check_contiguous(scores, where, "scores");
    check_dtype(indices, DType::i32, where, "indices");
    check_contiguous(indices, where, "indices");
    TESSERA_CHECK(indices.ndim() == 2 && indices.size(0) == scores.size(0),
                  "{}: indices must be [N = {}, TOPK], not {}", where, scores.size(0), indices.shape.str());
    if (weights.defined()) {
        check_shape(weights, indices.shape, where, "weights");
        check_contiguous(weights, where, "weights");
    }
}

}  // namespace

void RouterParams::validate(int64_t experts) const {
    TESSERA_CHECK(experts >= 1, "router: needs at least one expert");
    TESSERA_CHECK(groups >= 1 && groups <= kRouterMaxGroups && experts % groups == 0,
                  "router: groups = {} must divide the {} experts (at most {} groups)", groups, experts,
                  kRouterMaxGroups);
    TESSERA_CHECK(topk_groups >= 1 && topk_groups <= groups, "router: topk_groups = {} must be in [1, groups = {}]",
                  topk_groups, groups);
    TESSERA_CHECK(topk >= 1 && topk <= topk_groups * (experts / groups),
                  "router: topk = {} must be in [1, {}] (the experts in the kept groups)", topk,
                  topk_groups * (experts / groups));
    TESSERA_CHECK(std::isfinite(scaling), "router: scaling must be finite");
}

void router_scores(const RouterParams& p, TensorView x, TensorView w, TensorView logits, TensorView scores) {
    note_op_use("router");
    op_device("router", {x, w, logits, scores});
    TESSERA_CHECK(w.ndim() == 2, "router: w must be [E, D], not {}", w.shape.str());
    p.validate(w.size(0));
    linear_forward({}, x, w, {}, logits);
    router_score_function(p, logits, scores);
}

void router_score_function(const RouterParams& p, TensorView logits, TensorView scores) {
    const Device device = op_device("router", {logits, scores});
    check_shape(scores, logits.shape, "router: scores");
    TESSERA_CHECK(scores.dtype == logits.dtype, "router: scores and logits must share one dtype");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_score_function(p, logits, scores));
    dispatch_float(logits.dtype, "router", [&]<class T>(T) {
        Rows<T> U = rows_of<T>(logits, "router: logits"), S = rows_of<T>(scores, "router: scores");
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < U.rows; ++n) {
            const T* u = U.row(n);
            T* s = S.row(n);
            if (p.score == RouterScore::sigmoid) {
                for (int64_t e = 0; e < U.cols; ++e) s[e] = cpu::vsigmoid(u[e]);
                continue;
            }
            T m = u[0], z = 0;
            for (int64_t e = 1; e < U.cols; ++e) m = std::max(m, u[e]);
            for (int64_t e = 0; e < U.cols; ++e) z += (s[e] = cpu::vexp(u[e] - m));
            const T inv = T(1) / z;
            for (int64_t e = 0; e < U.cols; ++e) s[e] *= inv;
        }
    });
}

void router_allowed_groups(const RouterParams& p, const float* s, const float* bias, int64_t E, uint8_t* allowed) {
    router_allowed_groups_row(p.row(), s, bias, E, allowed);
}
void router_allowed_groups(const RouterParams& p, const double* s, const double* bias, int64_t E, uint8_t* allowed) {
    router_allowed_groups_row(p.row(), s, bias, E, allowed);
}

void router_select(const RouterParams& p,
                   TensorView scores,
                   TensorView bias,
                   TensorView indices,
                   TensorView weights,
                   TensorView counts) {
    const Device device = op_device("router", {scores, bias, indices, weights, counts});
    check_router_shapes(scores, indices, weights, "router");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    p.validate(E);
    TESSERA_CHECK(K == p.topk, "router: indices has {} slots but topk = {}", K, p.topk);
    if (bias.defined()) check_shape(bias, Shape{E}, "router: bias");
    check_shape(counts, Shape{E}, "router: counts");
    check_dtype(counts, DType::i32, "router: counts");
    TESSERA_CHECK(weights.defined(), "router: select needs weights");
    if (bias.defined()) check_contiguous(bias, "router: bias");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_select(p, scores, bias, indices, weights, counts));
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const T* b = bias.defined() ? bias.ptr<T>() : nullptr;
        const RouterRowParams rp = p.row();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            uint8_t allowed[kRouterMaxGroups];
            router_select_row(rp, scores.ptr<T>() + n * E, b, E, indices.ptr<int32_t>() + n * K,
                              weights.ptr<T>() + n * K, allowed);
        }
    });
    int32_t* c = counts.ptr<int32_t>();
    std::fill(c, c + E, 0);
    const int32_t* idx = indices.ptr<int32_t>();
    for (int64_t i = 0; i < N * K; ++i) ++c[idx[i]];
}

void router_weights(const RouterParams& p, TensorView scores, TensorView indices, TensorView weights) {
    const Device device = op_device("router", {scores, indices, weights});
    check_router_shapes(scores, indices, weights, "router");
    TESSERA_CHECK(weights.defined(), "router: weights needs its output");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_weights(p, scores, indices, weights));
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            router_weights_row(p.row(), scores.ptr<T>() + n * E, indices.ptr<int32_t>() + n * K,
                               weights.ptr<T>() + n * K, K);
        }
    });
}

void router_weights_backward(
    const RouterParams& p, TensorView dweights, TensorView scores, TensorView indices, TensorView dscores) {
    const Device device = op_device("router", {dweights, scores, indices, dscores});
    check_router_shapes(scores, indices, dweights, "router backward");
    TESSERA_CHECK(dweights.defined(), "router backward: needs dweights");
    check_shape(dscores, scores.shape, "router: dscores");
    check_contiguous(dscores, "router: dscores");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_weights_backward(p, dweights, scores, indices, dscores));
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n)
            router_weights_backward_row(p.row(), scores.ptr<T>() + n * E, dweights.ptr<T>() + n * K,
                                        indices.ptr<int32_t>() + n * K, dscores.ptr<T>() + n * E, K);
    });
}

void router_score_backward(const RouterParams& p, TensorView scores, TensorView dscores, TensorView dlogits) {
    const Device device = op_device("router", {scores, dscores, dlogits});
    check_shape(dscores, scores.shape, "router: dscores");
    check_shape(dlogits, scores.shape, "router: dlogits");
    TESSERA_CHECK(dscores.dtype == scores.dtype && dlogits.dtype == scores.dtype,
                  "router: scores and their gradients must share one dtype");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_score_backward(p, scores, dscores, dlogits));
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        Rows<T> S = rows_of<T>(scores, "router: scores"), DS = rows_of<T>(dscores, "router: dscores"),
                DU = rows_of<T>(dlogits, "router: dlogits");
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < S.rows; ++n) {
            const T* s = S.row(n);
            const T* ds = DS.row(n);
            T* du = DU.row(n);
            if (p.score == RouterScore::sigmoid) {
                for (int64_t e = 0; e < S.cols; ++e) du[e] += ds[e] * s[e] * (T(1) - s[e]);
                continue;
            }
            T dot = 0;
            for (int64_t e = 0; e < S.cols; ++e) dot += ds[e] * s[e];
            for (int64_t e = 0; e < S.cols; ++e) du[e] += s[e] * (ds[e] - dot);
        }
    });
}

double router_seq_aux_loss(double alpha,
                           TensorView scores,
                           TensorView indices,
                           std::span<const int64_t> starts,
                           TensorView dscores,
                           std::span<double> scratch) {
    const Device device = op_device("router", {scores, indices, dscores});
    check_router_shapes(scores, indices, {}, "router seq aux loss");
    check_dscores(scores, dscores);
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    TESSERA_CHECK(starts.size() >= 2 && starts.front() == 0 && starts.back() == N,
                  "router seq aux loss: sequence starts must run from 0 to N = {}", N);
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(router_seq_aux_loss(alpha, scores, indices, starts, dscores, scratch));
    TESSERA_CHECK(scratch.size() >= size_t(2 * E), "router seq aux loss: scratch of {} doubles < 2·E = {}",
                  scratch.size(), 2 * E);
    const double nseq = double(starts.size() - 1);
    double loss = 0;
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const std::span<double> f = scratch.first(size_t(E)), P = scratch.subspan(size_t(E), size_t(E));
        for (size_t q = 0; q + 1 < starts.size(); ++q) {
            const int64_t a = starts[q], b = starts[q + 1], Ts = b - a;
            std::fill(f.begin(), f.end(), 0.0);
            std::fill(P.begin(), P.end(), 0.0);
            for (int64_t t = a; t < b; ++t) {
                const int32_t* idx = indices.ptr<int32_t>() + t * K;
                for (int64_t j = 0; j < K; ++j) {
                    if (idx[j] >= 0) f[size_t(idx[j])] += double(E) / double(K * Ts);
                }
                const T* s = scores.ptr<T>() + t * E;
                double z = 0;
                for (int64_t e = 0; e < E; ++e) z += double(s[e]);
                for (int64_t e = 0; e < E; ++e) P[size_t(e)] += double(s[e]) / z / double(Ts);
            }
            double ls = 0;
            for (int64_t e = 0; e < E; ++e) ls += f[size_t(e)] * P[size_t(e)];
            loss += alpha * ls / nseq;
            // ∂/∂s_e = α/(nseq·T_s)·(f_e − Σ_i f_i s'_i)/Σ_j s_j
            for (int64_t t = a; t < b && dscores.defined(); ++t) {
                const T* s = scores.ptr<T>() + t * E;
                T* ds = dscores.ptr<T>() + t * E;
                double z = 0, fs = 0;
                for (int64_t e = 0; e < E; ++e) z += double(s[e]);
                for (int64_t e = 0; e < E; ++e) fs += f[size_t(e)] * double(s[e]) / z;
                const double c = alpha / (nseq * double(Ts) * z);
                for (int64_t e = 0; e < E; ++e) ds[e] += T(c * (f[size_t(e)] - fs));
            }
        }
    });
    return loss;
}

void router_balance_stats(TensorView scores,
                          TensorView indices,
                          std::span<double> choices,
                          std::span<double> prob_sums) {
    const Device device = op_device("router", {scores, indices});
    check_router_shapes(scores, indices, {}, "router balance stats");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    TESSERA_CHECK(int64_t(choices.size()) == E && int64_t(prob_sums.size()) == E,
                  "router balance stats: {} and {} slots for {} experts", choices.size(), prob_sums.size(), E);
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_balance_stats(scores, indices, choices, prob_sums));
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        for (int64_t t = 0; t < N; ++t) {
            const int32_t* idx = indices.ptr<int32_t>() + t * K;
            for (int64_t j = 0; j < K; ++j) {
                if (idx[j] >= 0) choices[size_t(idx[j])] += 1.0;
            }
            const T* s = scores.ptr<T>() + t * E;
            double z = 0;
            for (int64_t e = 0; e < E; ++e) z += double(s[e]);
            for (int64_t e = 0; e < E; ++e) prob_sums[size_t(e)] += double(s[e]) / z;
        }
    });
}

double router_global_aux_loss(double alpha,
                              std::span<const double> choices,
                              std::span<const double> prob_sums,
                              double rows,
                              std::span<double> grad) {
    const size_t E = choices.size();
    TESSERA_CHECK(prob_sums.size() == E && (grad.empty() || grad.size() == E) && rows > 0,
                  "router global aux loss: {} experts, {} probability sums, {} gradient slots, {} rows", E,
                  prob_sums.size(), grad.size(), rows);
    double sum = 0;
    for (size_t e = 0; e < E; ++e) sum += choices[e] * prob_sums[e];
    const double c = alpha * double(E) / (rows * rows);
    for (size_t e = 0; e < grad.size(); ++e) grad[e] = c * choices[e];
    return c * sum;
}

void router_balance_backward(std::span<const double> grad, TensorView scores, TensorView dscores) {
    const Device device = op_device("router", {scores, dscores});
    TESSERA_CHECK(scores.ndim() == 2, "router balance backward: scores must be [N, E], not {}", scores.shape.str());
    check_contiguous(scores, "router: scores");
    TESSERA_CHECK(dscores.defined(), "router balance backward: dscores is required");
    check_dscores(scores, dscores);
    const int64_t N = scores.size(0), E = scores.size(1);
    TESSERA_CHECK(int64_t(grad.size()) == E, "router balance backward: {} gradient slots for {} experts", grad.size(),
                  E);
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_balance_backward(grad, scores, dscores));
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        for (int64_t t = 0; t < N; ++t) {  // ∂/∂s_j Σ_e g_e s_e/z = (g_j − Σ_e g_e ŝ_e) / z
            const T* s = scores.ptr<T>() + t * E;
            T* ds = dscores.ptr<T>() + t * E;
            double z = 0, gs = 0;
            for (int64_t e = 0; e < E; ++e) z += double(s[e]);
            for (int64_t e = 0; e < E; ++e) gs += grad[size_t(e)] * double(s[e]) / z;
            for (int64_t e = 0; e < E; ++e) ds[e] += T((grad[size_t(e)] - gs) / z);
        }
    });
}

double router_z_loss(double beta, TensorView logits, TensorView dlogits) {
    const Device device = op_device("router", {logits, dlogits});
    TESSERA_CHECK(logits.ndim() == 2, "router z-loss: logits must be [N, E], not {}", logits.shape.str());
    check_contiguous(logits, "router: logits");
    check_dscores(logits, dlogits, "router: dlogits");
    if (device == Device::cuda) return TESSERA_ON_CUDA(router_z_loss(beta, logits, dlogits));
    double loss = 0;
    dispatch_float(logits.dtype, "router z-loss", [&]<class T>(T) {
        Rows<T> U = rows_of<T>(logits, "router: logits");
        const double N = double(U.rows);
        for (int64_t n = 0; n < U.rows; ++n) {
            const T* u = U.row(n);
            double m = double(u[0]), z = 0;
            for (int64_t e = 1; e < U.cols; ++e) m = std::max(m, double(u[e]));
            for (int64_t e = 0; e < U.cols; ++e) z += std::exp(double(u[e]) - m);
            const double lse = m + std::log(z);
            loss += beta * lse * lse / N;
            if (!dlogits.defined()) continue;
            T* du = dlogits.ptr<T>() + n * U.cols;
            const double c = beta * 2.0 * lse / N;
            for (int64_t e = 0; e < U.cols; ++e) du[e] += T(c * std::exp(double(u[e]) - lse));
        }
    });
    return loss;
}

}  // namespace tessera::ops
