// MoE router on the CPU: scores, group-limited top-k, gate weights and their backward, aux losses.
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

template <class T>
void allowed_groups(const RouterParams& p, const T* s, const T* bias, int64_t E, uint8_t* allowed) {
    const int64_t G = p.groups;
    if (G <= 1) {
        allowed[0] = 1;
        return;
    }
    const int64_t gs = E / G;
    T score[kRouterMaxGroups];
    for (int64_t g = 0; g < G; ++g) {
        allowed[g] = 0;
        T best = -INFINITY, second = -INFINITY;
        for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
            const T v = bias ? s[e] + bias[e] : s[e];
            if (v > best) {
                second = best;
                best = v;
            } else if (v > second) {
                second = v;
            }
        }
        score[g] = bias && gs > 1 ? best + second : best;
    }
    for (int64_t m = 0; m < p.topk_groups; ++m) {
        int64_t pick = -1;
        for (int64_t g = 0; g < G; ++g) {
            if (!allowed[g] && (pick < 0 || score[g] > score[pick])) pick = g;
        }
        allowed[pick] = 1;
    }
}

template <class T>
void weights_row(const RouterParams& p, const T* s, const int32_t* idx, T* w, int64_t K) {
    T z = 0;
    for (int64_t j = 0; j < K; ++j) z += idx[j] >= 0 ? s[idx[j]] : T(0);
    const T scale = T(p.scaling) / (p.normalize ? z + T(1e-20) : T(1));
    for (int64_t j = 0; j < K; ++j) w[j] = idx[j] >= 0 ? s[idx[j]] * scale : T(0);
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
    cpu_only("router", {x, w, logits, scores});
    TESSERA_CHECK(w.ndim() == 2, "router: w must be [E, D], not {}", w.shape.str());
    p.validate(w.size(0));
    linear_forward({}, x, w, {}, logits);
    check_shape(scores, logits.shape, "router: scores");
    dispatch_float(x.dtype, "router", [&]<class T>(T) {
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
    allowed_groups(p, s, bias, E, allowed);
}
void router_allowed_groups(const RouterParams& p, const double* s, const double* bias, int64_t E, uint8_t* allowed) {
    allowed_groups(p, s, bias, E, allowed);
}

void router_select(const RouterParams& p,
                   TensorView scores,
                   TensorView bias,
                   TensorView indices,
                   TensorView weights,
                   TensorView counts) {
    cpu_only("router", {scores, bias, indices, weights, counts});
    check_router_shapes(scores, indices, weights, "router");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    p.validate(E);
    TESSERA_CHECK(K == p.topk, "router: indices has {} slots but topk = {}", K, p.topk);
    if (bias.defined()) check_shape(bias, Shape{E}, "router: bias");
    check_shape(counts, Shape{E}, "router: counts");
    check_dtype(counts, DType::i32, "router: counts");
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const T* b = bias.defined() ? bias.ptr<T>() : nullptr;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const T* s = scores.ptr<T>() + n * E;
            int32_t* idx = indices.ptr<int32_t>() + n * K;
            T* val = weights.ptr<T>() + n * K;  // holds the kept s̃ until the weights replace them
            uint8_t allowed[kRouterMaxGroups];
            allowed_groups(p, s, b, E, allowed);
            int64_t count = 0;
            for (int64_t e = 0; e < E; ++e) {
                if (!router_expert_allowed(p, allowed, E, e)) continue;
                const T v = b ? s[e] + b[e] : s[e];
                int64_t pos;
                if (count < K) {
                    pos = count++;
                } else if (v > val[K - 1]) {
                    pos = K - 1;
                } else {
                    continue;
                }
                for (; pos > 0 && val[pos - 1] < v; --pos) {  // equal values keep the lower id first
                    val[pos] = val[pos - 1];
                    idx[pos] = idx[pos - 1];
                }
                val[pos] = v;
                idx[pos] = int32_t(e);
            }
            weights_row(p, s, idx, val, K);
        }
    });
    int32_t* c = counts.ptr<int32_t>();
    std::fill(c, c + E, 0);
    const int32_t* idx = indices.ptr<int32_t>();
    for (int64_t i = 0; i < N * K; ++i) ++c[idx[i]];
}

void router_weights(const RouterParams& p, TensorView scores, TensorView indices, TensorView weights) {
    cpu_only("router", {scores, indices, weights});
    check_router_shapes(scores, indices, weights, "router");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            weights_row(p, scores.ptr<T>() + n * E, indices.ptr<int32_t>() + n * K, weights.ptr<T>() + n * K, K);
        }
    });
}

void router_weights_backward(
    const RouterParams& p, TensorView dweights, TensorView scores, TensorView indices, TensorView dscores) {
    cpu_only("router", {dweights, scores, indices, dscores});
    check_router_shapes(scores, indices, dweights, "router backward");
    check_shape(dscores, scores.shape, "router: dscores");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    dispatch_float(scores.dtype, "router", [&]<class T>(T) {
        const T rho = T(p.scaling);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const T* s = scores.ptr<T>() + n * E;
            const T* dg = dweights.ptr<T>() + n * K;
            const int32_t* idx = indices.ptr<int32_t>() + n * K;
            T* ds = dscores.ptr<T>() + n * E;
            if (!p.normalize) {
                for (int64_t j = 0; j < K; ++j) {
                    if (idx[j] >= 0) ds[idx[j]] += rho * dg[j];
                }
                continue;
            }
            T z = 0, t = 0;  // g_j = ρ s_j / z: ds_j = ρ (dg_j − Σ_i dg_i s_i / z) / z
            for (int64_t j = 0; j < K; ++j) {
                if (idx[j] < 0) continue;
                z += s[idx[j]];
                t += dg[j] * s[idx[j]];
            }
            z += T(1e-20);
            for (int64_t j = 0; j < K; ++j) {
                if (idx[j] >= 0) ds[idx[j]] += rho * (dg[j] - t / z) / z;
            }
        }
    });
}

void router_score_backward(const RouterParams& p, TensorView scores, TensorView dscores, TensorView dlogits) {
    cpu_only("router", {scores, dscores, dlogits});
    check_shape(dscores, scores.shape, "router: dscores");
    check_shape(dlogits, scores.shape, "router: dlogits");
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
    cpu_only("router", {scores, indices, dscores});
    check_router_shapes(scores, indices, {}, "router seq aux loss");
    if (dscores.defined()) check_shape(dscores, scores.shape, "router: dscores");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    TESSERA_CHECK(starts.size() >= 2 && starts.front() == 0 && starts.back() == N,
                  "router seq aux loss: sequence starts must run from 0 to N = {}", N);
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
    cpu_only("router", {scores, indices});
    check_router_shapes(scores, indices, {}, "router balance stats");
    const int64_t N = scores.size(0), E = scores.size(1), K = indices.size(1);
    TESSERA_CHECK(int64_t(choices.size()) == E && int64_t(prob_sums.size()) == E,
                  "router balance stats: {} and {} slots for {} experts", choices.size(), prob_sums.size(), E);
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
    cpu_only("router", {scores, dscores});
    check_shape(dscores, scores.shape, "router: dscores");
    const int64_t N = scores.size(0), E = scores.size(1);
    TESSERA_CHECK(int64_t(grad.size()) == E, "router balance backward: {} gradient slots for {} experts", grad.size(),
                  E);
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
    cpu_only("router", {logits, dlogits});
    if (dlogits.defined()) check_shape(dlogits, logits.shape, "router: dlogits");
    double loss = 0;
    dispatch_float(logits.dtype, "router z-loss", [&]<class T>(T) {
        check_contiguous(logits, "router: logits");
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
