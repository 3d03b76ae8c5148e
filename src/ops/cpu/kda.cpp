// KDA drivers on the CPU: the chunked forward/backward (windows of chunks across (sequence, value
// head) units: intra-chunk phases in parallel, the state recurrence sequential per unit) and the
// token-recurrent reference with its BPTT. Chunk math: kda_chunk.cpp.
#include "ops/kda.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>

#include "ops/cpu/kda_chunk.h"
#include "ops/cpu/kernel_util.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops {

namespace {

using cpu::kda::ChunkGrads;
using cpu::kda::ChunkInput;
using cpu::kda::ChunkState;
using cpu::kda::Dims;

// Validated geometry of one call.
struct Layout {
    int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, G = 0, C = 0;
    int64_t tokens = 0, num_seqs = 0, max_chunks = 0, max_len = 0, total_chunks = 0;
    cpu::Segments seg{0, 0, {}, "kda"};

    int64_t seq_start(int64_t s) const { return seg.first_token(s); }
    int64_t seq_len(int64_t s) const { return seg.length(s); }
    int64_t chunks(int64_t s) const { return (seq_len(s) + C - 1) / C; }
    // index of sequence s's first chunk among all sequences' chunks
    int64_t chunk_offset(int64_t s) const {
        if (seg.cu.empty()) return s * chunks(0);
        int64_t n = 0;
        for (int64_t i = 0; i < s; ++i) n += chunks(i);
        return n;
    }
    int64_t units() const { return num_seqs * HV; }
};

Layout check(const KdaParams& p, const KdaInputs& in) {
    Layout L;
    TESSERA_CHECK(in.q.ndim() == 4 && in.k.ndim() == 4 && in.v.ndim() == 4,
                  "kda: q, k must be [B, T, H, K] and v [B, T, HV, V]");
    L.B = in.q.size(0);
    L.T = in.q.size(1);
    L.H = in.q.size(2);
    L.K = in.q.size(3);
    L.HV = in.v.size(2);
    L.V = in.v.size(3);
    check_shape(in.k, in.q.shape, "kda: k");
    TESSERA_CHECK(in.v.size(0) == L.B && in.v.size(1) == L.T, "kda: v {} does not match q {}", in.v.shape.str(),
                  in.q.shape.str());
    TESSERA_CHECK(L.HV % L.H == 0, "kda: value heads {} must be a multiple of q/k heads {}", L.HV, L.H);
    L.G = L.HV / L.H;
    check_shape(in.g, Shape{L.B, L.T, L.HV, L.K}, "kda: g");
    check_shape(in.beta, Shape{L.B, L.T, L.HV}, "kda: beta");
    for (const TensorView* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) {
        check_contiguous(*t, "kda: inputs");
        TESSERA_CHECK(t->dtype == in.q.dtype, "kda: inputs must share one dtype (q is {}, found {})",
                      dtype_name(in.q.dtype), dtype_name(t->dtype));
    }
    TESSERA_CHECK(p.chunk_size == 32 || p.chunk_size == 64, "kda: chunk_size must be 32 or 64, not {}", p.chunk_size);
    L.C = p.chunk_size;
    L.tokens = L.B * L.T;
    L.seg = cpu::Segments(L.B, L.T, in.cu_seqlens, "kda");
    L.num_seqs = L.seg.count();
    for (int64_t s = 0; s < L.num_seqs; ++s) {
        L.max_chunks = std::max(L.max_chunks, L.chunks(s));
        L.max_len = std::max(L.max_len, L.seq_len(s));
        L.total_chunks += L.chunks(s);
    }
    if (in.h0.defined()) {
        check_shape(in.h0, Shape{L.num_seqs, L.HV, L.K, L.V}, "kda: h0");
        check_dtype(in.h0, in.q.dtype, "kda: h0");
        check_contiguous(in.h0, "kda: h0");
    }
    return L;
}

// NOTES: two ways to share the work. With enough (sequence, value head) units to balance the
// threads, each thread runs whole units, chunk after chunk, with no synchronisation ("per unit").
// Otherwise groups of units advance through windows of chunks together: the intra-chunk phases run
// in parallel over (unit, chunk) and only the state recurrence is sequential per unit.
struct Schedule {
    bool per_unit = false;
    int64_t group = 1;   // units processed together (windowed)
    int64_t window = 1;  // chunks per unit prepared in parallel (windowed)
};

Schedule schedule(const Layout& L, int threads) {
    Schedule s;
    s.per_unit = L.units() % threads == 0 || L.units() >= 4 * int64_t(threads);
    if (s.per_unit) return s;
    s.group = std::max<int64_t>(1, std::min<int64_t>(L.units(), 2 * int64_t(threads)));
    s.window = std::clamp<int64_t>((2 * threads + s.group - 1) / s.group, 1, 16);
    s.window = std::min(s.window, std::max<int64_t>(1, L.max_chunks));
    return s;
}

Dims dims(const Layout& L) { return {L.C, L.K, L.V}; }

// Element counts of the workspace parts (each rounded to 16 elements).
struct WorkSizes {
    int threads = 1;  // parallel regions run exactly this many threads
    int64_t slot = 0, slots = 0, scratch = 0, running = 0, store = 0, gva = 0, rec = 0;  // scratch, rec: per thread
    int64_t total() const { return slots * slot + threads * (scratch + rec) + running + store + gva; }
};

int64_t r16(int64_t n) { return (n + 15) / 16 * 16; }

WorkSizes work_sizes(const KdaParams& p, const Layout& L, bool backward, int threads, bool saved) {
    WorkSizes w;
    w.threads = threads;
    const int64_t KV = L.K * L.V;
    if (backward) w.gva = 2 * r16(L.tokens * L.HV * L.K);
    if (p.mode == KdaMode::recurrent) {
        // per thread: the running state and a [V] vector; backward adds every state of the sequence,
        // dS and S' [K, V] and two [V] vectors
        w.rec = r16(backward ? KV * (L.max_len + 3) + 2 * L.V : KV + L.V);
        return w;
    }
    const Dims d = dims(L);
    const Schedule s = schedule(L, threads);
    w.slot = r16(cpu::kda::chunk_state_elems(d) + KV + (backward ? 2 * L.C * L.V + KV : 0));
    const int64_t lanes = s.per_unit ? threads : s.group;  // units in flight
    w.slots = s.per_unit ? threads : s.group * s.window;
    w.scratch = r16(cpu::kda::scratch_elems(d));
    w.running = lanes * KV;
    if (backward && !saved) w.store = lanes * L.max_chunks * KV;
    return w;
}

// Exceptions must not leave an OpenMP region: the first one is kept and rethrown after it.
class Errors {
  public:
    template <class F>
    void run(F&& f) noexcept {
        try {
            f();
        } catch (...) {
#pragma omp critical(tessera_kda_errors)
            if (!first_) first_ = std::current_exception();
        }
    }
    void rethrow() const {
        if (first_) std::rethrow_exception(first_);
    }

  private:
    std::exception_ptr first_;
};

template <class T>
struct Problem {
    Layout L;
    T scale;
    const T *q, *k, *v, *g, *beta, *h0;
    T* saved = nullptr;  // [total chunks, HV, K, V] or null

    T* saved_state(int64_t unit, int64_t c) const {
        return saved + ((L.chunk_offset(seq_of(unit)) + c) * L.HV + head_of(unit)) * L.K * L.V;
    }

    int64_t seq_of(int64_t unit) const { return unit / L.HV; }
    int64_t head_of(int64_t unit) const { return unit % L.HV; }
    int64_t rows(int64_t unit, int64_t c) const { return std::min(L.C, L.seq_len(seq_of(unit)) - c * L.C); }
    int64_t first_token(int64_t unit, int64_t c) const { return L.seq_start(seq_of(unit)) + c * L.C; }

    ChunkInput<T> input(int64_t unit, int64_t c) const {
        const int64_t t = first_token(unit, c), i = head_of(unit), h = i / L.G;
        return {q + (t * L.H + h) * L.K,
                k + (t * L.H + h) * L.K,
                v + (t * L.HV + i) * L.V,
                g + (t * L.HV + i) * L.K,
                beta + t * L.HV + i,
                L.H * L.K,
                L.HV * L.V,
                L.HV * L.K,
                L.HV,
                rows(unit, c)};
    }
    void init_state(int64_t unit, T* S) const {
        const int64_t n = L.K * L.V;
        if (h0) {
            std::memcpy(S, h0 + unit * n, size_t(n) * sizeof(T));
        } else {
            std::fill(S, S + n, T(0));
        }
    }
};

template <class T>
Problem<T> problem(const KdaParams& p, const KdaInputs& in, const Layout& L, const TensorView& saved) {
    const T scale = T(p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(L.K)));
    if (saved.defined()) {
        TESSERA_CHECK(p.mode == KdaMode::chunk, "kda: saved states exist in chunk mode only");
        check_shape(saved, Shape{L.total_chunks, L.HV, L.K, L.V}, "kda: saved_states");
        check_contiguous(saved, "kda: saved_states");
    }
    return {L,
            scale,
            in.q.ptr<T>(),
            in.k.ptr<T>(),
            in.v.ptr<T>(),
            in.g.ptr<T>(),
            in.beta.ptr<T>(),
            in.h0.defined() ? in.h0.ptr<T>() : nullptr,
            saved.defined() ? saved.ptr<T>() : nullptr};
}

// Carves the workspace for one call.
template <class T>
struct Work {
    WorkSizes n;
    T *slots, *scratch, *running, *store, *dqv, *dkv, *rec;

    T* slot(int64_t i) const { return slots + i * n.slot; }
    T* thread_scratch() const { return scratch + omp_get_thread_num() * n.scratch; }
    T* thread_rec() const { return rec + omp_get_thread_num() * n.rec; }
};

template <class T>
Work<T> carve(const WorkSizes& n, std::span<std::byte> ws) {
    const size_t need = size_t(n.total()) * sizeof(T);
    TESSERA_CHECK(ws.size() >= need, "kda: workspace of {} bytes is smaller than the {} needed", ws.size(), need);
    T* p = reinterpret_cast<T*>(ws.data());
    Work<T> w;
    w.n = n;
    w.slots = p;
    p += n.slots * n.slot;
    w.scratch = p;
    p += n.threads * n.scratch;
    w.running = p;
    p += n.running;
    w.store = p;
    p += n.store;
    w.dqv = p;
    w.dkv = p + n.gva / 2;
    p += n.gva;
    w.rec = p;
    return w;  // rec: threads × n.rec
}

// ---- chunked forward and backward ----

// The per-chunk steps, shared by both schedules. A slot holds a ChunkState, then S_n [K, V] and, in
// backward, dO [C, V], dV' [C, V] and dS_{n+1} [K, V].
template <class T>
struct Steps {
    const Problem<T>& P;
    const Work<T>& w;
    Dims d;
    int64_t KV, CV, state_elems;
    const T* dout = nullptr;
    T *dv = nullptr, *dg = nullptr, *dbeta = nullptr;

    Steps(const Problem<T>& p, const Work<T>& work)
        : P(p),
          w(work),
          d(dims(p.L)),
          KV(p.L.K * p.L.V),
          CV(p.L.C * p.L.V),
          state_elems(cpu::kda::chunk_state_elems(d)) {}

    ChunkState<T> state(T* slot) const { return cpu::kda::carve_chunk_state(slot, d); }
    T* S_n(T* slot) const { return slot + state_elems; }
    T* dO(T* slot) const { return S_n(slot) + KV; }
    T* dVp(T* slot) const { return dO(slot) + CV; }
    T* dS_next(T* slot) const { return dVp(slot) + CV; }

    void prepare(T* slot, int64_t unit, int64_t c) const {
        cpu::kda::prepare_chunk(d, P.input(unit, c), P.scale, state(slot), w.thread_scratch());
    }
    // keeps S_n in the slot (and the saved states), then advances S past the chunk
    void advance(T* slot, int64_t unit, int64_t c, T* S) const {
        std::memcpy(S_n(slot), S, size_t(KV) * sizeof(T));
        if (P.saved) std::memcpy(P.saved_state(unit, c), S, size_t(KV) * sizeof(T));
        cpu::kda::state_step(d, state(slot), S);
    }
    void output(T* slot, int64_t unit, int64_t c, T* o) const {
        const int64_t t = P.first_token(unit, c);
        cpu::kda::chunk_output(d, state(slot), S_n(slot), o + (t * P.L.HV + P.head_of(unit)) * P.L.V, P.L.HV * P.L.V,
                               P.rows(unit, c));
    }
    // backward: recompute the chunk, V' from S_n, and gather dO (zero-padded)
    void backward_prepare(T* slot, int64_t unit, int64_t c, const T* Sn) const {
        prepare(slot, unit, c);
        cpu::kda::pseudo_values(d, state(slot), Sn);
        T* g = dO(slot);
        std::fill(g, g + CV, T(0));
        if (!dout) return;
        const int64_t t = P.first_token(unit, c), i = P.head_of(unit);
        for (int64_t r = 0; r < P.rows(unit, c); ++r) {
            std::memcpy(g + r * P.L.V, dout + ((t + r) * P.L.HV + i) * P.L.V, size_t(P.L.V) * sizeof(T));
        }
    }
    // dS_{n+1} → dS_n, keeping dS_{n+1} and dV' in the slot
    void backward_state(T* slot, T* dS) const {
        std::memcpy(dS_next(slot), dS, size_t(KV) * sizeof(T));
        cpu::kda::dstate_step(d, state(slot), dO(slot), dVp(slot), dS);
    }
    void backward_local(T* slot, int64_t unit, int64_t c, const T* Sn) const {
        const Layout& L = P.L;
        const int64_t t = P.first_token(unit, c), i = P.head_of(unit);
        const ChunkGrads<T> out{w.dqv + (t * L.HV + i) * L.K,
                                w.dkv + (t * L.HV + i) * L.K,
                                dv ? dv + (t * L.HV + i) * L.V : nullptr,
                                dg ? dg + (t * L.HV + i) * L.K : nullptr,
                                dbeta ? dbeta + t * L.HV + i : nullptr,
                                L.HV * L.K,
                                L.HV * L.V,
                                L.HV * L.K,
                                L.HV};
        cpu::kda::chunk_backward(d, state(slot), P.scale, Sn, dVp(slot), dS_next(slot), dO(slot), out, P.rows(unit, c),
                                 w.thread_scratch());
    }
};

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
            T* S = w.running + omp_get_thread_num() * KV;
#pragma omp for schedule(dynamic)
            for (int64_t unit = 0; unit < L.units(); ++unit) {
                err.run([&] {
                    P.init_state(unit, S);
                    for (int64_t c = 0; c < L.chunks(P.seq_of(unit)); ++c) {
                        st.prepare(slot, unit, c);
                        st.advance(slot, unit, c, S);
                        st.output(slot, unit, c, o);
                    }
                    if (ht) std::memcpy(ht + unit * KV, S, size_t(KV) * sizeof(T));
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
                    if (valid(item, unit, c)) err.run([&] { st.output(w.slot(item), unit, c, o); });
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
            T* dS = w.running + me * KV;
            T* store = w.store + me * L.max_chunks * KV;
#pragma omp for schedule(dynamic)
            for (int64_t unit = 0; unit < L.units(); ++unit) {
                err.run([&] {
                    const int64_t chunks = L.chunks(P.seq_of(unit));
                    auto Sn = [&](int64_t c) { return P.saved ? P.saved_state(unit, c) : store + c * KV; };
                    if (!P.saved) {  // the state entering every chunk
                        P.init_state(unit, dS);
                        for (int64_t c = 0; c < chunks; ++c) {
                            std::memcpy(store + c * KV, dS, size_t(KV) * sizeof(T));
                            st.prepare(slot, unit, c);
                            cpu::kda::state_step(st.d, st.state(slot), dS);
                        }
                    }
                    init_dstate(unit, dS);
                    for (int64_t c = chunks - 1; c >= 0; --c) {
                        st.backward_prepare(slot, unit, c, Sn(c));
                        st.backward_state(slot, dS);
                        st.backward_local(slot, unit, c, Sn(c));
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
                            cpu::kda::state_step(st.d, st.state(w.slot(u * sch.window + j)), S);
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
                        err.run([&] { st.backward_local(w.slot(item), unit, c, Sn(item / sch.window, c)); });
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

// ---- token-recurrent reference ----

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

// dq[t, h] += Σ_{i in group h, ascending} dqv[t, i] (and dk likewise)
template <class T>
void reduce_value_heads(const Layout& L, const T* src, const TensorView& dst) {
    if (!dst.defined()) return;
    T* out = dst.ptr<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < L.tokens; ++t) {
        for (int64_t h = 0; h < L.H; ++h) {
            T* o = out + (t * L.H + h) * L.K;
            for (int64_t i = h * L.G; i < (h + 1) * L.G; ++i) {
                const T* s = src + (t * L.HV + i) * L.K;
                for (int64_t c = 0; c < L.K; ++c) o[c] += s[c];
            }
        }
    }
}

}  // namespace

Shape kda_saved_states_shape(const KdaParams& p, const KdaInputs& in) {
    const Layout L = check(p, in);
    return Shape{L.total_chunks, L.HV, L.K, L.V};
}

size_t kda_workspace_bytes(
    const KdaParams& p, const KdaInputs& in, bool backward, int num_threads, bool backward_with_saved_states) {
    const Layout L = check(p, in);
    return size_t(work_sizes(p, L, backward, num_threads, backward_with_saved_states).total()) * dtype_size(in.q.dtype);
}

size_t kda_workspace_bound(const KdaParams& p,
                           const KdaInputs& shapes,
                           int64_t max_len,
                           bool backward,
                           int num_threads,
                           bool backward_with_saved_states) {
    KdaInputs rows = shapes;
    rows.cu_seqlens = {};
    Layout L = check(p, rows);
    L.max_chunks = (max_len + L.C - 1) / L.C;
    L.max_len = max_len;
    WorkSizes w = work_sizes(p, L, backward, num_threads, backward_with_saved_states);
    if (p.mode == KdaMode::chunk) {
        // NOTES: whatever the number of (sequence, head) units: per-unit runs `threads` lanes; windowed
        // runs group <= 2·threads lanes and group·window <= 2·threads + group slots
        const int64_t KV = L.K * L.V, lanes = 2 * int64_t(num_threads);
        w.slots = std::max<int64_t>(w.slots, 4 * int64_t(num_threads));
        w.running = std::max<int64_t>(w.running, lanes * KV);
        if (backward && !backward_with_saved_states) w.store = lanes * L.max_chunks * KV;
    }
    return size_t(w.total()) * dtype_size(shapes.q.dtype);
}

void kda_forward(const KdaParams& p,
                 const KdaInputs& in,
                 TensorView o,
                 TensorView ht,
                 std::span<std::byte> ws,
                 TensorView saved_states) {
    const Layout L = check(p, in);
    check_shape(o, in.v.shape, "kda: o");
    check_contiguous(o, "kda: o");
    if (ht.defined()) check_shape(ht, Shape{L.num_seqs, L.HV, L.K, L.V}, "kda: ht");
    cpu::dispatch_float(in.q.dtype, "kda", [&]<class T>(T) {
        const Problem<T> P = problem<T>(p, in, L, saved_states);
        const Work<T> w = carve<T>(work_sizes(p, L, false, omp_get_max_threads(), false), ws);
        T* htp = ht.defined() ? ht.ptr<T>() : nullptr;
        if (p.mode == KdaMode::recurrent) {
            recurrent_forward(P, o.ptr<T>(), htp, w);
        } else {
            chunk_forward(P, o.ptr<T>(), htp, w);
        }
    });
}

void kda_backward(const KdaParams& p,
                  const KdaInputs& in,
                  TensorView dout,
                  TensorView dht,
                  const KdaGrads& grads,
                  std::span<std::byte> ws,
                  TensorView saved_states) {
    const Layout L = check(p, in);
    if (dout.defined()) check_shape(dout, in.v.shape, "kda: do");
    if (dht.defined()) check_shape(dht, Shape{L.num_seqs, L.HV, L.K, L.V}, "kda: dht");
    auto check_grad = [&](const TensorView& g, const TensorView& like, const char* what) {
        if (!g.defined()) return;
        check_shape(g, like.shape, what);
        check_dtype(g, in.q.dtype, what);
        check_contiguous(g, what);
    };
    check_grad(grads.dq, in.q, "kda: dq");
    check_grad(grads.dk, in.k, "kda: dk");
    check_grad(grads.dv, in.v, "kda: dv");
    check_grad(grads.dg, in.g, "kda: dg");
    check_grad(grads.dbeta, in.beta, "kda: dbeta");
    if (grads.dh0.defined()) check_shape(grads.dh0, Shape{L.num_seqs, L.HV, L.K, L.V}, "kda: dh0");
    cpu::dispatch_float(in.q.dtype, "kda", [&]<class T>(T) {
        const Problem<T> P = problem<T>(p, in, L, saved_states);
        const Work<T> w = carve<T>(work_sizes(p, L, true, omp_get_max_threads(), saved_states.defined()), ws);
        std::fill(w.dqv, w.dqv + w.n.gva, T(0));
        const T* dO = dout.defined() ? dout.ptr<T>() : nullptr;
        const T* dS = dht.defined() ? dht.ptr<T>() : nullptr;
        if (p.mode == KdaMode::recurrent) {
            recurrent_backward(P, dO, dS, grads, w);
        } else {
            chunk_backward_all(P, dO, dS, grads, w);
        }
        reduce_value_heads(L, w.dqv, grads.dq);
        reduce_value_heads(L, w.dkv, grads.dk);
    });
}

double kda_forward_flops(int64_t tokens, int64_t value_heads, int64_t d, int64_t chunk_size) {
    const double D = double(d), C = double(chunk_size);
    return double(tokens) * double(value_heads) * (6.0 * D * D + 3.0 * C * D + C * C);
}

}  // namespace tessera::ops
