// KDA drivers on the CPU (internal to ops/cpu): the validated geometry of a call, the work schedule,
// the workspace layout and the problem's pointers, shared by the chunked driver (kda_chunked.cpp), the
// token-recurrent reference (kda_recurrent.cpp) and the entry points (kda.cpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "ops/cpu/kda_chunk.h"
#include "ops/cpu/kernel_util.h"
#include "ops/kda.h"

namespace tessera::ops::cpu::kda {

// Validated geometry of one call.
struct Layout {
    int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, G = 0, C = 0;
    int64_t tokens = 0, num_seqs = 0, max_chunks = 0, max_len = 0, total_chunks = 0;
    Segments seg{0, 0, {}, "kda"};

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

// NOTES: two ways to share the work. With enough (sequence, value head) units to balance the
// threads, each thread runs whole units, chunk after chunk, with no synchronisation ("per unit").
// Otherwise groups of units advance through windows of chunks together: the intra-chunk phases run
// in parallel over (unit, chunk) and only the state recurrence is sequential per unit.
struct Schedule {
    bool per_unit = false;
    int64_t group = 1;   // units processed together (windowed)
    int64_t window = 1;  // chunks per unit prepared in parallel (windowed)
};

inline Schedule schedule(const Layout& L, int threads) {
    Schedule s;
    s.per_unit = L.units() % threads == 0 || L.units() >= 4 * int64_t(threads);
    if (s.per_unit) return s;
    s.group = std::max<int64_t>(1, std::min<int64_t>(L.units(), 2 * int64_t(threads)));
    s.window = std::clamp<int64_t>((2 * threads + s.group - 1) / s.group, 1, 16);
    s.window = std::min(s.window, std::max<int64_t>(1, L.max_chunks));
    return s;
}

inline Dims dims(const Layout& L) { return {L.C, L.K, L.V}; }

// Element counts of the workspace parts (each rounded to 16 elements).
struct WorkSizes {
    int threads = 1;  // parallel regions run exactly this many threads
    int64_t slot = 0, slots = 0, scratch = 0, running = 0, store = 0, gva = 0, rec = 0;  // scratch, rec: per thread
    int64_t total() const { return slots * slot + threads * (scratch + rec) + running + store + gva; }
};

inline int64_t r16(int64_t n) { return (n + 15) / 16 * 16; }

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

// The workspace of one call, carved by kda.cpp.
template <class T>
struct Work {
    WorkSizes n;
    T *slots, *scratch, *running, *store, *rec;
    T *dqv, *dkv;  // per-value-head dq, dk [tokens, HV, K]; null when the chunked backward needs none

    T* slot(int64_t i) const { return slots + i * n.slot; }
    T* thread_scratch() const { return scratch + omp_get_thread_num() * n.scratch; }
    T* thread_rec() const { return rec + omp_get_thread_num() * n.rec; }
};

// The chunked algorithm (kda_chunked.cpp) and the token-recurrent reference (kda_recurrent.cpp).
template <class T>
void chunk_forward(const Problem<T>& P, T* o, T* ht, const Work<T>& w);
template <class T>
void chunk_backward_all(const Problem<T>& P, const T* dout, const T* dht, const KdaGrads& G, const Work<T>& w);
template <class T>
void recurrent_forward(const Problem<T>& P, T* o, T* ht, const Work<T>& w);
template <class T>
void recurrent_backward(const Problem<T>& P, const T* dout, const T* dht, const KdaGrads& G, const Work<T>& w);

}  // namespace tessera::ops::cpu::kda
