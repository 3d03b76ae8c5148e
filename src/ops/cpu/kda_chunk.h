// KDA chunk math (internal to ops/cpu): the per-chunk forward preparation, the state step, the
// output, and the per-chunk backward of ../shared/spec/kda.md §3.1–3.2, for one (sequence, value
// head) chunk of C rows (a partial last chunk is zero-padded: g = β = q = k = v = 0 is exact).
//
// Numerical safety (spec §3.4): every decay factor is exp of G[r] − G[j] with j ≤ r, G[last] − G[r]
// or G[r], all ≤ 0, and is formed as a running product of exp(g) (one exp per gate), never as exp of
// a difference. Off-diagonal 16-row sub-blocks factor exp(G[r] − G[j]) = exp(G[r] − G[n])·exp(G[n] − G[j])
// with n the first row of the row block (both factors ≤ 1, bit-causal); diagonal sub-blocks take
// E[r, j] = E[r − 1, j]·exp(g[r]) (bit-causal too).
// NOTES: differences of the chunk's prefix sums would be inexact: after a gate of −1000 the prefix
// sums are ~−1000 and their differences would keep only ~4 digits in f32. A product's relative error
// grows with its number of factors (≤ 63 roundings), not with the size of the exponent; products
// below the smallest normal are flushed to 0 as exp's own underflow is (no subnormals).
#pragma once

#include <cstdint>

namespace tessera::ops::cpu::kda {

constexpr int64_t kSub = 16;  // sub-block rows

// One chunk's inputs: pointers to its first row of the op's tensors (strides in elements).
template <class T>
struct ChunkInput {
    const T *q, *k, *v, *g, *beta;
    int64_t q_stride, v_stride, g_stride, beta_stride;  // per token
    int64_t rows;                                       // valid rows (<= C)
};

// Everything forward computes for a chunk (kept for backward as well). Sizes: C·K, C·V, C·C, K.
template <class T>
struct ChunkState {
    T* Q;       // [C, K] scale·q
    T* Kc;      // [C, K]
    T* Vc;      // [C, V]
    T* g;       // [C, K] the raw gates (zero-padded)
    T* eg;      // [C, K] exp(g): the per-row factors of the diagonal sub-blocks' E
    T* endfac;  // [C, K] exp(G[last] − G[r]) = exp(Σ_{i>r} g_i)
    T* eG;      // [C, K] exp(G), G the chunk-local inclusive cumsum of g
    T* beta;    // [C]
    T* M;       // [C, C] strictly lower: Σ_d K[r]K[j]E[r,j]   (before β)
    T* Aqk;     // [C, C] lower incl. diagonal: Σ_d Q[r]K[j]E[r,j]
    T* Tinv;    // [C, C] (I + Diag(β)M)^-1, unit lower
    T* Kb;      // [C, K] β·K·exp(G)
    T* Vb;      // [C, V] β·V
    T* W;       // [C, K] Tinv·Kb
    T* U;       // [C, V] Tinv·Vb; the state step turns it into V' = U − W·S
    T* Qg;      // [C, K] Q·exp(G)
    T* Kend;    // [C, K] K·exp(G[last] − G)
    T* gamma;   // [K] exp(G[last])
};

struct Dims {
    int64_t C, K, V;
};

// Floats a ChunkState needs, and per-thread scratch for prepare/backward.
int64_t chunk_state_elems(const Dims& d);
int64_t scratch_elems(const Dims& d);

template <class T>
ChunkState<T> carve_chunk_state(T* base, const Dims& d);

// Phase A: fills every field of s from the chunk's inputs (independent per chunk).
template <class T>
void prepare_chunk(const Dims& d, const ChunkInput<T>& in, T scale, const ChunkState<T>& s, T* scratch);

// U ← V' = U − W·S_n (the pseudo-values, given the state entering the chunk).
template <class T>
void pseudo_values(const Dims& d, const ChunkState<T>& s, const T* S_n);
// Sequential state step: pseudo_values(S_n), then S_{n+1} = Diag(γ)·S_n + Kendᵀ·V' (S_next may be S_n).
template <class T>
void state_step(const Dims& d, const ChunkState<T>& s, const T* S_n, T* S_next);

// O = Qg·S_n + Aqk·V' for the chunk's valid rows, written with row stride o_stride.
template <class T>
void chunk_output(const Dims& d, const ChunkState<T>& s, const T* S_n, T* o, int64_t o_stride, int64_t rows);

// Sequential backward state step: dV' = Aqkᵀ·dO + Kend·dS_{n+1};
// dS_n = Qgᵀ·dO + Diag(γ)·dS_{n+1} − Wᵀ·dV'. dO: [C, V] (zero-padded rows); dS_n may be dS_{n+1}.
template <class T>
void dstate_step(const Dims& d, const ChunkState<T>& s, const T* dO, T* dVp, const T* dS_next, T* dS_n);

// Per-chunk gradients given S_n (state entering the chunk), V' (in s.U), dV', dS_{n+1} and dO.
// Accumulates into dq/dk ([rows, K] at dq_stride), dv, dg, dbeta; absent (null) ones are skipped.
template <class T>
struct ChunkGrads {
    T *dq, *dk, *dv, *dg, *dbeta;
    int64_t dq_stride, dv_stride, dg_stride, dbeta_stride;
};
template <class T>
void chunk_backward(const Dims& d,
                    const ChunkState<T>& s,
                    T scale,
                    const T* S_n,
                    const T* dVp,
                    const T* dS_next,
                    const T* dO,
                    const ChunkGrads<T>& out,
                    int64_t rows,
                    T* scratch);

}  // namespace tessera::ops::cpu::kda
