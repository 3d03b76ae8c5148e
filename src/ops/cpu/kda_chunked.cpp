// KDA's chunked forward and backward on the CPU: windows of chunks across (sequence, value head)
// units, the intra-chunk phases in parallel and the state recurrence sequential per unit (see
// kda_driver.h for the two schedules). Chunk math: kda_chunk.cpp.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "ops/cpu/kda_driver.h"

namespace tessera::ops::cpu::kda {

namespace {

// The per-chunk steps, shared by both schedules. A slot holds a ChunkState, then S_n [K, V] and, in
// backward, dO [C, V], dV' [C, V] and dS_{n+1} [K, V]. The per-unit schedule uses the slot's S_n and
// dS_{n+1} as the second buffer of a pair (states are stepped out of place, never copied); the
// windowed one keeps there the copies its later parallel phase reads.
template <class T>
struct Steps {
    const Problem<T>& P;
    const Work<T>& w;
    Dims d;
    int64_t KV, CV, state_elems;
    const T* dout = nullptr;
    T *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg = nullptr, *dbeta = nullptr;  // dq, dk: [tokens, HV, K]

    Steps(const Problem<T>& p, const Work<T>& work)
        : P(p), w(work), d(dims(p.L)), KV(p.L.K * p.L.V), CV(p.L.C * p.L.V), state_elems(chunk_state_elems(d)) {}

    ChunkState<T> state(T* slot) const { return carve_chunk_state(slot, d); }
    T* S_n(T* slot) const { return slot + state_elems; }
    T* dO(T* slot) const { return S_n(slot) + KV; }
    T* dVp(T* slot) const { return dO(slot) + CV; }
    T* dS_next(T* slot) const { return dVp(slot) + CV; }

    void prepare(T* slot, int64_t unit, int64_t c) const {
        prepare_chunk(d, P.input(unit, c), P.scale, state(slot), w.thread_scratch());
    }
    // where S_n is kept for the chunk's output: the saved states, or the slot
    T* entering(T* slot, int64_t unit, int64_t c) const { return P.saved ? P.saved_state(unit, c) : S_n(slot); }
    // windowed schedule: keeps S_n for the output, then advances S past the chunk
    void advance(T* slot, int64_t unit, int64_t c, T* S) const {
        T* Sn = entering(slot, unit, c);
        std::memcpy(Sn, S, size_t(KV) * sizeof(T));
        state_step(d, state(slot), Sn, S);
    }
    void output(T* slot, int64_t unit, int64_t c, const T* Sn, T* o) const {
        const int64_t t = P.first_token(unit, c);
        chunk_output(d, state(slot), Sn, o + (t * P.L.HV + P.head_of(unit)) * P.L.V, P.L.HV * P.L.V, P.rows(unit, c));
    }
    // backward: recompute the chunk, V' from S_n, and gather dO (zero-padded)
    void backward_prepare(T* slot, int64_t unit, int64_t c, const T* Sn) const {
        prepare(slot, unit, c);
        pseudo_values(d, state(slot), Sn);
        T* g = dO(slot);
        std::fill(g, g + CV, T(0));
        if (!dout) return;
        const int64_t t = P.first_token(unit, c), i = P.head_of(unit);
        for (int64_t r = 0; r < P.rows(unit, c); ++r) {
            std::memcpy(g + r * P.L.V, dout + ((t + r) * P.L.HV + i) * P.L.V, size_t(P.L.V) * sizeof(T));
        }
    }
    // windowed schedule: dS_{n+1} → dS_n, keeping dS_{n+1} and dV' in the slot
    void backward_state(T* slot, T* dS) const {
        std::memcpy(dS_next(slot), dS, size_t(KV) * sizeof(T));
        dstate_step(d, state(slot), dO(slot), dVp(slot), dS_next(slot), dS);
    }
    void backward_local(T* slot, int64_t unit, int64_t c, const T* Sn, const T* dSn) const {
        const Layout& L = P.L;
        const int64_t t = P.first_token(unit, c), i = P.head_of(unit);
        const ChunkGrads<T> out{dq ? dq + (t * L.HV + i) * L.K : nullptr,
                                dk ? dk + (t * L.HV + i) * L.K : nullptr,
                                dv ? dv + (t * L.HV + i) * L.V : nullptr,
                                dg ? dg + (t * L.HV + i) * L.K : nullptr,
                                dbeta ? dbeta + t * L.HV + i : nullptr,
                                L.HV * L.K,
                                L.HV * L.V,
                                L.HV * L.K,
                                L.HV};
        chunk_backward(d, state(slot), P.scale, Sn, dVp(slot), dSn, dO(slot), out, P.rows(unit, c), w.thread_scratch());
    }
};

}  // namespace

template <class T>
void chunk_forward(const Problem<T>& P, T* o, T* ht, const Work<T>& w) {
    const Layout& L = P.L;
    const int threads = w.n.threads;
    const Schedule sch = schedule(L, threads);
    const Steps<T> st(P, w);
    const int64_t KV = st.KV;
    Errors err;
    if (sch.per_unit) {
#pragma omp parallel num_threads(threads)
        {
            T* slot = w.slot(omp_get_thread_num());
            T* const pair[2] = {w.running + omp_get_thread_num() * KV, st.S_n(slot)};
#pragma omp for schedule(dynamic)
            for (int64_t unit = 0; unit < L.units(); ++unit) {
                err.run([&] {
                    const int64_t chunks = L.chunks(P.seq_of(unit));
                    // S_n lives in the saved states when there are any, else in the pair; S_{n+1} is
                    // written where the next chunk (or ht) wants it
                    T* S = P.saved && chunks > 0 ? P.saved_state(unit, 0) : pair[0];
                    P.init_state(unit, S);
                    for (int64_t c = 0; c < chunks; ++c) {
                        T* next = c + 1 < chunks ? (P.saved ? P.saved_state(unit, c + 1) : nullptr)
                                                 : (ht ? ht + unit * KV : nullptr);
                        if (!next) next = S == pair[0] ? pair[1] : pair[0];
                        st.prepare(slot, unit, c);
                        state_step(st.d, st.state(slot), S, next);
                        st.output(slot, unit, c, S, o);
                        S = next;
                    }
                    if (ht && chunks == 0) std::memcpy(ht + unit * KV, S, size_t(KV) * sizeof(T));
                });
            }
        }
        err.rethrow();
        return;
    }
    for (int64_t g0 = 0; g0 < L.units(); g0 += sch.group) {
        const int64_t gu = std::min(sch.group, L.units() - g0);
        int64_t chunks = 0;
        for (int64_t u = 0; u < gu; ++u) {
            P.init_state(g0 + u, w.running + u * KV);
            chunks = std::max(chunks, L.chunks(P.seq_of(g0 + u)));
        }
        for (int64_t w0 = 0; w0 < chunks; w0 += sch.window) {
            const int64_t items = gu * sch.window;
            auto valid = [&](int64_t item, int64_t& unit, int64_t& c) {
                unit = g0 + item / sch.window;
                c = w0 + item % sch.window;
                return c < L.chunks(P.seq_of(unit));
            };
#pragma omp parallel num_threads(threads)
            {
#pragma omp for schedule(dynamic)
                for (int64_t item = 0; item < items; ++item) {
                    int64_t unit, c;
                    if (valid(item, unit, c)) err.run([&] { st.prepare(w.slot(item), unit, c); });
                }
#pragma omp for schedule(dynamic)
                for (int64_t u = 0; u < gu; ++u) {
                    for (int64_t j = 0; j < sch.window; ++j) {
                        int64_t unit, c;
                        if (!valid(u * sch.window + j, unit, c)) break;
                        err.run([&] { st.advance(w.slot(u * sch.window + j), unit, c, w.running + u * KV); });
                    }
                }
#pragma omp for schedule(dynamic)
                for (int64_t item = 0; item < items; ++item) {
                    int64_t unit, c;
                    if (valid(item, unit, c)) {
                        err.run([&] {
                            T* slot = w.slot(item);
                            st.output(slot, unit, c, st.entering(slot, unit, c), o);
                        });
                    }
                }
            }
            err.rethrow();
        }
        if (ht) std::memcpy(ht + g0 * KV, w.running, size_t(gu * KV) * sizeof(T));
    }
}

template <class T>
void chunk_backward_all(const Problem<T>& P, const T* dout, const T* dht, const KdaGrads& G, const Work<T>& w) {
    const Layout& L = P.L;
    const int threads = w.n.threads;
    const Schedule sch = schedule(L, threads);
    Steps<T> st(P, w);
    st.dout = dout;
    st.dv = G.dv.defined() ? G.dv.template ptr<T>() : nullptr;
    st.dg = G.dg.defined() ? G.dg.template ptr<T>() : nullptr;
    st.dbeta = G.dbeta.defined() ? G.dbeta.template ptr<T>() : nullptr;
    if (w.dqv) {  // grouped value heads: per-value-head buffers, summed by the caller
        st.dq = w.dqv;
        st.dk = w.dkv;
    } else {  // one value head per q/k head: straight into dq and dk
        st.dq = G.dq.defined() ? G.dq.template ptr<T>() : nullptr;
        st.dk = G.dk.defined() ? G.dk.template ptr<T>() : nullptr;
    }
    T* dh0 = G.dh0.defined() ? G.dh0.template ptr<T>() : nullptr;
    const int64_t KV = st.KV;
    auto init_dstate = [&](int64_t unit, T* dS) {
        if (dht) {
            std::memcpy(dS, dht + unit * KV, size_t(KV) * sizeof(T));
        } else {
            std::fill(dS, dS + KV, T(0));
        }
    };
    Errors err;
    if (sch.per_unit) {
#pragma omp parallel num_threads(threads)
        {
            const int me = omp_get_thread_num();
            T* slot = w.slot(me);
            T* const pair[2] = {w.running + me * KV, st.dS_next(slot)};
            T* store = w.store + me * L.max_chunks * KV;
#pragma omp for schedule(dynamic)
            for (int64_t unit = 0; unit < L.units(); ++unit) {
                err.run([&] {
                    const int64_t chunks = L.chunks(P.seq_of(unit));
                    auto Sn = [&](int64_t c) { return P.saved ? P.saved_state(unit, c) : store + c * KV; };
                    if (!P.saved && chunks > 0) {  // the state entering every chunk (the last one's exit is not needed)
                        P.init_state(unit, Sn(0));
                        for (int64_t c = 0; c + 1 < chunks; ++c) {
                            st.prepare(slot, unit, c);
                            state_step(st.d, st.state(slot), Sn(c), Sn(c + 1));
                        }
                    }
                    T* dS = pair[0];  // dS_{n+1}; dS_n goes to the other buffer of the pair
                    init_dstate(unit, dS);
                    for (int64_t c = chunks - 1; c >= 0; --c) {
                        T* dSn = dS == pair[0] ? pair[1] : pair[0];
                        st.backward_prepare(slot, unit, c, Sn(c));
                        dstate_step(st.d, st.state(slot), st.dO(slot), st.dVp(slot), dS, dSn);
                        st.backward_local(slot, unit, c, Sn(c), dS);
                        dS = dSn;
                    }
                    if (dh0) {
                        for (int64_t n = 0; n < KV; ++n) dh0[unit * KV + n] += dS[n];
                    }
                });
            }
        }
        err.rethrow();
        return;
    }
    for (int64_t g0 = 0; g0 < L.units(); g0 += sch.group) {
        const int64_t gu = std::min(sch.group, L.units() - g0);
        int64_t chunks = 0;
        for (int64_t u = 0; u < gu; ++u) chunks = std::max(chunks, L.chunks(P.seq_of(g0 + u)));
        auto Sn = [&](int64_t u, int64_t c) {
            return P.saved ? P.saved_state(g0 + u, c) : w.store + (u * L.max_chunks + c) * KV;
        };
        auto valid = [&](int64_t w0, int64_t item, int64_t& unit, int64_t& c) {
            unit = g0 + item / sch.window;
            c = w0 + item % sch.window;
            return c < L.chunks(P.seq_of(unit));
        };
        const int64_t items = gu * sch.window;
        // pass 1: the state entering every chunk (unless the forward saved them)
        for (int64_t u = 0; u < gu; ++u) P.init_state(g0 + u, w.running + u * KV);
        for (int64_t w0 = 0; w0 < chunks && !P.saved; w0 += sch.window) {
#pragma omp parallel num_threads(threads)
            {
#pragma omp for schedule(dynamic)
                for (int64_t item = 0; item < items; ++item) {
                    int64_t unit, c;
                    if (valid(w0, item, unit, c)) err.run([&] { st.prepare(w.slot(item), unit, c); });
                }
#pragma omp for schedule(dynamic)
                for (int64_t u = 0; u < gu; ++u) {
                    for (int64_t j = 0; j < sch.window; ++j) {
                        int64_t unit, c;
                        if (!valid(w0, u * sch.window + j, unit, c)) break;
                        err.run([&] {
                            T* S = w.running + u * KV;
                            std::memcpy(Sn(u, c), S, size_t(KV) * sizeof(T));
                            state_step(st.d, st.state(w.slot(u * sch.window + j)), Sn(u, c), S);
                        });
                    }
                }
            }
            err.rethrow();
        }
        // pass 2: reverse, windows from the last one down
        for (int64_t u = 0; u < gu; ++u) init_dstate(g0 + u, w.running + u * KV);
        for (int64_t w0 = (chunks - 1) / sch.window * sch.window; w0 >= 0; w0 -= sch.window) {
#pragma omp parallel num_threads(threads)
            {
#pragma omp for schedule(dynamic)
                for (int64_t item = 0; item < items; ++item) {
                    int64_t unit, c;
                    if (valid(w0, item, unit, c)) {
                        err.run([&] { st.backward_prepare(w.slot(item), unit, c, Sn(item / sch.window, c)); });
                    }
                }
#pragma omp for schedule(dynamic)
                for (int64_t u = 0; u < gu; ++u) {
                    for (int64_t j = sch.window - 1; j >= 0; --j) {
                        int64_t unit, c;
                        if (valid(w0, u * sch.window + j, unit, c)) {
                            err.run([&] { st.backward_state(w.slot(u * sch.window + j), w.running + u * KV); });
                        }
                    }
                }
#pragma omp for schedule(dynamic)
                for (int64_t item = 0; item < items; ++item) {
                    int64_t unit, c;
                    if (valid(w0, item, unit, c)) {
                        err.run([&] {
                            T* slot = w.slot(item);
                            st.backward_local(slot, unit, c, Sn(item / sch.window, c), st.dS_next(slot));
                        });
                    }
                }
            }
            err.rethrow();
        }
        if (dh0) {
            for (int64_t i = 0; i < gu * KV; ++i) dh0[g0 * KV + i] += w.running[i];
        }
    }
}

template void chunk_forward<float>(const Problem<float>&, float*, float*, const Work<float>&);
template void chunk_forward<double>(const Problem<double>&, double*, double*, const Work<double>&);
template void chunk_backward_all<float>(
    const Problem<float>&, const float*, const float*, const KdaGrads&, const Work<float>&);
template void chunk_backward_all<double>(
    const Problem<double>&, const double*, const double*, const KdaGrads&, const Work<double>&);

}  // namespace tessera::ops::cpu::kda
