// KDA's token-recurrent reference on the CPU (mode recurrent): the token-by-token recurrence and its
// BPTT, in the op's dtype with exp in double; one thread per (sequence, value head) unit.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/cpu/kda_driver.h"

namespace tessera::ops::cpu::kda {

template <class T>
void recurrent_forward(const Problem<T>& P, T* o, T* ht, const Work<T>& w) {
    const Layout& L = P.L;
    const int64_t K = L.K, V = L.V, KV = K * V;
    Errors err;
#pragma omp parallel num_threads(w.n.threads)
    {
        T* S = w.thread_rec();
        T* ks = S + KV;
#pragma omp for schedule(dynamic)
        for (int64_t unit = 0; unit < L.units(); ++unit) {
            err.run([&] {
                const int64_t s = P.seq_of(unit), i = P.head_of(unit), h = i / L.G, t0 = L.seq_start(s);
                P.init_state(unit, S);
                for (int64_t t = t0; t < t0 + L.seq_len(s); ++t) {
                    const T* q = P.q + (t * L.H + h) * K;
                    const T* k = P.k + (t * L.H + h) * K;
                    const T* v = P.v + (t * L.HV + i) * V;
                    const T* g = P.g + (t * L.HV + i) * K;
                    const T b = P.beta[t * L.HV + i];
                    std::fill(ks, ks + V, T(0));
                    for (int64_t c = 0; c < K; ++c) {  // S ← Diag(e^g)·S; ks = Sᵀk
                        const T a = T(std::exp(double(g[c])));
                        for (int64_t j = 0; j < V; ++j) {
                            S[c * V + j] *= a;
                            ks[j] += k[c] * S[c * V + j];
                        }
                    }
                    for (int64_t j = 0; j < V; ++j) ks[j] = b * (v[j] - ks[j]);  // β·u
                    T* out = o + (t * L.HV + i) * V;
                    std::fill(out, out + V, T(0));
                    for (int64_t c = 0; c < K; ++c) {
                        const T qc = P.scale * q[c];
                        for (int64_t j = 0; j < V; ++j) {
                            S[c * V + j] += k[c] * ks[j];
                            out[j] += qc * S[c * V + j];
                        }
                    }
                }
                if (ht) std::memcpy(ht + unit * KV, S, size_t(KV) * sizeof(T));
            });
        }
    }
    err.rethrow();
}

template <class T>
void recurrent_backward(const Problem<T>& P, const T* dout, const T* dht, const KdaGrads& G, const Work<T>& w) {
    const Layout& L = P.L;
    const int64_t K = L.K, V = L.V, KV = K * V;
    T* dv = G.dv.defined() ? G.dv.template ptr<T>() : nullptr;
    T* dgp = G.dg.defined() ? G.dg.template ptr<T>() : nullptr;
    T* dbeta = G.dbeta.defined() ? G.dbeta.template ptr<T>() : nullptr;
    T* dh0 = G.dh0.defined() ? G.dh0.template ptr<T>() : nullptr;
    Errors err;
#pragma omp parallel num_threads(w.n.threads)
    {
        T* states = w.thread_rec();  // [len + 1, K, V]
        T* dS = states + (L.max_len + 1) * KV;
        T* Sp = dS + KV;
        T* u = Sp + KV;
        T* du = u + V;
#pragma omp for schedule(dynamic)
        for (int64_t unit = 0; unit < L.units(); ++unit) {
            err.run([&] {
                const int64_t s = P.seq_of(unit), i = P.head_of(unit), h = i / L.G, t0 = L.seq_start(s);
                const int64_t len = L.seq_len(s);
                P.init_state(unit, states);
                for (int64_t t = 0; t < len; ++t) {  // forward, keeping every state
                    const int64_t tok = t0 + t;
                    const T* k = P.k + (tok * L.H + h) * K;
                    const T* v = P.v + (tok * L.HV + i) * V;
                    const T* g = P.g + (tok * L.HV + i) * K;
                    const T b = P.beta[tok * L.HV + i];
                    const T* Sprev = states + t * KV;
                    T* S = states + (t + 1) * KV;
                    std::fill(u, u + V, T(0));
                    for (int64_t c = 0; c < K; ++c) {
                        const T a = T(std::exp(double(g[c])));
                        for (int64_t j = 0; j < V; ++j) {
                            S[c * V + j] = a * Sprev[c * V + j];
                            u[j] += k[c] * S[c * V + j];
                        }
                    }
                    for (int64_t j = 0; j < V; ++j) u[j] = v[j] - u[j];
                    for (int64_t c = 0; c < K; ++c) {
                        for (int64_t j = 0; j < V; ++j) S[c * V + j] += b * k[c] * u[j];
                    }
                }
                if (dht) {
                    std::memcpy(dS, dht + unit * KV, size_t(KV) * sizeof(T));
                } else {
                    std::fill(dS, dS + KV, T(0));
                }
                for (int64_t t = len - 1; t >= 0; --t) {
                    const int64_t tok = t0 + t;
                    const T* q = P.q + (tok * L.H + h) * K;
                    const T* k = P.k + (tok * L.H + h) * K;
                    const T* v = P.v + (tok * L.HV + i) * V;
                    const T* g = P.g + (tok * L.HV + i) * K;
                    const T b = P.beta[tok * L.HV + i];
                    const T* Sprev = states + t * KV;
                    const T* S = states + (t + 1) * KV;
                    T* dq = w.dqv + (tok * L.HV + i) * K;
                    T* dk = w.dkv + (tok * L.HV + i) * K;
                    // recompute S' = Diag(e^g)·S_{t-1} and u = v − S'ᵀk
                    std::fill(u, u + V, T(0));
                    for (int64_t c = 0; c < K; ++c) {
                        const T a = T(std::exp(double(g[c])));
                        for (int64_t j = 0; j < V; ++j) {
                            Sp[c * V + j] = a * Sprev[c * V + j];
                            u[j] += k[c] * Sp[c * V + j];
                        }
                    }
                    for (int64_t j = 0; j < V; ++j) u[j] = v[j] - u[j];
                    // o = Sᵀ(scale·q)
                    if (dout) {
                        const T* dO = dout + (tok * L.HV + i) * V;
                        for (int64_t c = 0; c < K; ++c) {
                            T acc = 0;
                            for (int64_t j = 0; j < V; ++j) {
                                acc += S[c * V + j] * dO[j];
                                dS[c * V + j] += P.scale * q[c] * dO[j];
                            }
                            dq[c] += P.scale * acc;
                        }
                    }
                    // S = S' + β·k·uᵀ
                    T db = 0;
                    std::fill(du, du + V, T(0));
                    for (int64_t c = 0; c < K; ++c) {
                        T dsu = 0;
                        for (int64_t j = 0; j < V; ++j) {
                            dsu += dS[c * V + j] * u[j];
                            du[j] += b * dS[c * V + j] * k[c];
                        }
                        db += k[c] * dsu;
                        dk[c] += b * dsu;
                    }
                    if (dbeta) dbeta[tok * L.HV + i] += db;
                    // u = v − S'ᵀk
                    if (dv) {
                        for (int64_t j = 0; j < V; ++j) dv[(tok * L.HV + i) * V + j] += du[j];
                    }
                    for (int64_t c = 0; c < K; ++c) {
                        T acc = 0, dgc = 0;
                        const T a = T(std::exp(double(g[c])));
                        for (int64_t j = 0; j < V; ++j) {
                            acc += Sp[c * V + j] * du[j];
                            const T dSp = dS[c * V + j] - k[c] * du[j];
                            dgc += dSp * Sp[c * V + j];
                            dS[c * V + j] = a * dSp;  // S' = Diag(e^g)·S_{t-1}
                        }
                        dk[c] -= acc;
                        if (dgp) dgp[(tok * L.HV + i) * K + c] += dgc;
                    }
                }
                if (dh0) {
                    for (int64_t n = 0; n < KV; ++n) dh0[unit * KV + n] += dS[n];
                }
            });
        }
    }
    err.rethrow();
}

template void recurrent_forward<float>(const Problem<float>&, float*, float*, const Work<float>&);
template void recurrent_forward<double>(const Problem<double>&, double*, double*, const Work<double>&);
template void recurrent_backward<float>(
    const Problem<float>&, const float*, const float*, const KdaGrads&, const Work<float>&);
template void recurrent_backward<double>(
    const Problem<double>&, const double*, const double*, const KdaGrads&, const Work<double>&);

}  // namespace tessera::ops::cpu::kda
