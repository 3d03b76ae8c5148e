// KDA chunk math (see kda_chunk.h; formulas: ../shared/spec/kda.md §3.1–3.2).
#include "ops/cpu/kda_chunk.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ops/cpu/simd.h"
#include "ops/cpu/small_gemm.h"
#include "ops/cpu/vec_math.h"

namespace tessera::ops::cpu::kda {

using cpu::small_gemm_nn;
using cpu::small_gemm_tn;
using cpu::transpose;

namespace {
template <class T>
void zero(T* p, int64_t n) {
    std::fill(p, p + n, T(0));
}

// x, or 0 below the smallest normal number, as exp underflows (keeps subnormals out of the products;
// NaN stays NaN)
template <class T>
inline T flush_tiny(T x) {
    return x < std::numeric_limits<T>::min() ? T(0) : x;
}

// Factors of the off-diagonal block of row block n0 > 0: a[r] = exp(G[n0 + r] − G[n0]) for the kSub
// rows of the block, b[j] = exp(G[n0] − G[j]) for j < n0, each a running product of exp(g).
template <class T>
void offdiagonal_factors(const ChunkState<T>& s, int64_t K, int64_t n0, T* a, T* b) {
    std::fill(a, a + K, T(1));
    for (int64_t r = 1; r < kSub; ++r) {
        const T* eg = s.eg + (n0 + r) * K;
        const T* ap = a + (r - 1) * K;
        T* ar = a + r * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) ar[c] = flush_tiny(ap[c] * eg[c]);
    }
    std::memcpy(b + (n0 - 1) * K, s.eg + n0 * K, size_t(K) * sizeof(T));
    for (int64_t j = n0 - 2; j >= 0; --j) {
        const T* eg = s.eg + (j + 1) * K;
        const T* bn = b + (j + 1) * K;
        T* bj = b + j * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) bj[c] = flush_tiny(bn[c] * eg[c]);
    }
}
}  // namespace

int64_t chunk_state_elems(const Dims& d) {
    const int64_t CK = d.C * d.K, CV = d.C * d.V, CC = d.C * d.C;
    return 10 * CK + 3 * CV + 3 * CC + d.C + d.K;
}

// prepare: sub-block factors a, Qa, Ka [kSub, K], b, Bk, BkT [C, K] and L [C, C];
// backward: dAqk, dT, dM [C, C], tmp [max(C·C, C·K)]; dQg, dKend, dW, dKb, dQ, dK, dG, Rq, Rk, Ck,
// Bk [C, K]; dVb [C, V]; dgamma [K]; dbeta [C]; a, Qa, Ka [kSub, K]
int64_t scratch_elems(const Dims& d) {
    const int64_t CK = d.C * d.K, CV = d.C * d.V, CC = d.C * d.C;
    const int64_t KV = d.K * d.V;
    return 4 * CC + std::max(CC, CK) + 14 * CK + 3 * CV + 2 * KV + 2 * d.K + d.C + 3 * kSub * d.K;
}

template <class T>
ChunkState<T> carve_chunk_state(T* p, const Dims& d) {
    const int64_t CK = d.C * d.K, CV = d.C * d.V, CC = d.C * d.C;
    ChunkState<T> s;
    auto take = [&](int64_t n) {
        T* r = p;
        p += n;
        return r;
    };
    s.Q = take(CK);
    s.Kc = take(CK);
    s.g = take(CK);
    s.eg = take(CK);
    s.endfac = take(CK);
    s.eG = take(CK);
    s.Kb = take(CK);
    s.W = take(CK);
    s.Qg = take(CK);
    s.Kend = take(CK);
    s.Vc = take(CV);
    s.Vb = take(CV);
    s.U = take(CV);
    s.M = take(CC);
    s.Aqk = take(CC);
    s.Tinv = take(CC);
    s.beta = take(d.C);
    s.gamma = take(d.K);
    return s;
}

// One row r of a diagonal sub-block against its column j: advances e from E[r − 1, j] to
// E[r, j] = E[r − 1, j]·exp(g[r]) and sets q = Σ Q[r]·K[j]·E[r, j], m = Σ K[r]·K[j]·E[r, j].
template <class T>
static inline void diagonal_pair(int64_t K, const T* Qr, const T* Kr, const T* Kj, const T* egr, T* e, T& q, T& m) {
    if constexpr (std::is_same_v<T, float>) {
        if (K % simd::kW == 0) {  // explicit vectors: the omp reduction below ends in scalar adds
            using simd::vf;
            const vf tiny = simd::splat(std::numeric_limits<float>::min());
            vf aq{}, am{};
            for (int64_t c = 0; c < K; c += simd::kW) {
                vf x = simd::load(e + c) * simd::load(egr + c);
                x = x < tiny ? vf{} : x;
                simd::store(e + c, x);
                const vf kx = simd::load(Kj + c) * x;
                aq += simd::load(Qr + c) * kx;
                am += simd::load(Kr + c) * kx;
            }
            simd::hsum2(aq, am, q, m);
            return;
        }
    }
    T aq = 0, am = 0;
#pragma omp simd reduction(+ : aq, am)
    for (int64_t c = 0; c < K; ++c) {
        const T x = flush_tiny(e[c] * egr[c]);
        e[c] = x;
        const T kx = Kj[c] * x;
        aq += Qr[c] * kx;
        am += Kr[c] * kx;
    }
    q = aq;
    m = am;
}

// Fills the E-weighted products of rows [n0, n0 + kSub) against all earlier columns:
// Aqk[r, j] = Σ Q[r]·K[j]·E[r,j] (j ≤ r), M[r, j] = Σ K[r]·K[j]·E[r,j] (j < r). On the diagonal
// sub-block e carries E[r, j] = E[r − 1, j]·exp(g[r]) down the column j.
template <class T>
static void ek_products(
    const Dims& d, const ChunkState<T>& s, int64_t n0, T* a, T* b, T* Bk, T* BkT, T* Qa, T* Ka, T* e) {
    const int64_t C = d.C, K = d.K;
    for (int64_t j = n0; j < n0 + kSub; ++j) {
        const T* Kj = s.Kc + j * K;
        const T* Qj = s.Q + j * K;
        T aq = 0;
#pragma omp simd reduction(+ : aq)
        for (int64_t c = 0; c < K; ++c) {
            e[c] = T(1);
            aq += Qj[c] * Kj[c];
        }
        s.Aqk[j * C + j] = aq;
        for (int64_t r = j + 1; r < n0 + kSub; ++r) {
            diagonal_pair(K, s.Q + r * K, s.Kc + r * K, Kj, s.eg + r * K, e, s.Aqk[r * C + j], s.M[r * C + j]);
        }
    }
    if (n0 == 0) return;
    offdiagonal_factors(s, K, n0, a, b);
    for (int64_t i = 0; i < kSub * K; ++i) {
        Qa[i] = s.Q[n0 * K + i] * a[i];
        Ka[i] = s.Kc[n0 * K + i] * a[i];
    }
#pragma omp simd
    for (int64_t i = 0; i < n0 * K; ++i) Bk[i] = s.Kc[i] * b[i];
    transpose(Bk, n0, K, K, BkT, n0);
    small_gemm_nn(kSub, n0, K, T(1), Qa, K, BkT, n0, T(0), s.Aqk + n0 * C, C);
    small_gemm_nn(kSub, n0, K, T(1), Ka, K, BkT, n0, T(0), s.M + n0 * C, C);
}

// Tinv = (I + L)^-1 with L = Diag(β)·M strictly lower, by row blocks of kSub: the block's columns
// left of it are one product, Tinv[blk, :b0] = −L[blk, :b0]·Tinv[:b0, :b0]; then forward
// substitution inside the block, Tinv[r, :r] −= L[r, l]·Tinv[l, :r] for b0 ≤ l < r. L: [C, C] scratch.
template <class T>
static void invert_unit_lower(const Dims& d, const ChunkState<T>& s, T* L) {
    const int64_t C = d.C;
    for (int64_t r = 0; r < C; ++r) {
        const T b = s.beta[r];
#pragma omp simd
        for (int64_t l = 0; l < C; ++l) L[r * C + l] = b * s.M[r * C + l];  // M is 0 on and above the diagonal
    }
    zero(s.Tinv, C * C);
    for (int64_t b0 = 0; b0 < C; b0 += kSub) {
        if (b0) small_gemm_nn(kSub, b0, b0, T(-1), L + b0 * C, C, s.Tinv, C, T(0), s.Tinv + b0 * C, C);
        for (int64_t r = b0; r < b0 + kSub; ++r) {
            T* Tr = s.Tinv + r * C;
            Tr[r] = 1;
            for (int64_t l = b0; l < r; ++l) {
                const T Lrl = L[r * C + l];
                const T* Tl = s.Tinv + l * C;
#pragma omp simd
                for (int64_t j = 0; j <= l; ++j) Tr[j] -= Lrl * Tl[j];
            }
        }
    }
}

template <class T>
void prepare_chunk(const Dims& d, const ChunkInput<T>& in, T scale, const ChunkState<T>& s, T* scratch) {
    const int64_t C = d.C, K = d.K, V = d.V;
    for (int64_t r = 0; r < C; ++r) {
        T* Q = s.Q + r * K;
        T* Kc = s.Kc + r * K;
        T* Vc = s.Vc + r * V;
        if (r < in.rows) {
            const T* q = in.q + r * in.q_stride;
            const T* k = in.k + r * in.q_stride;
            const T* v = in.v + r * in.v_stride;
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) {
                Q[c] = scale * q[c];
                Kc[c] = k[c];
            }
            std::memcpy(s.g + r * K, in.g + r * in.g_stride, size_t(K) * sizeof(T));
            std::memcpy(Vc, v, size_t(V) * sizeof(T));
            s.beta[r] = in.beta[r * in.beta_stride];
        } else {  // zero padding is exact: g = 0 keeps G, β = 0 and q = k = v = 0 add nothing
            zero(Q, K);
            zero(Kc, K);
            zero(Vc, V);
            zero(s.g + r * K, K);
            s.beta[r] = 0;
        }
    }
    // exp(G[r]) = Π_{i≤r} exp(g[i]): running products (factors ≤ 1, flushed to 0 below the smallest
    // normal as exp underflows)
    for (int64_t r = 0; r < C; ++r) {
        T* eg = s.eg + r * K;
        T* eG = s.eG + r * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) eg[c] = vexp(s.g[r * K + c]);
        if (r == 0) {
            std::memcpy(eG, eg, size_t(K) * sizeof(T));
        } else {
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) eG[c] = flush_tiny(eG[c - K] * eg[c]);
        }
        const T b = s.beta[r];
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) {
            s.Qg[r * K + c] = s.Q[r * K + c] * eG[c];
            s.Kb[r * K + c] = b * s.Kc[r * K + c] * eG[c];
        }
#pragma omp simd
        for (int64_t c = 0; c < V; ++c) s.Vb[r * V + c] = b * s.Vc[r * V + c];
    }
    for (int64_t c = 0; c < K; ++c) s.gamma[c] = s.eG[(C - 1) * K + c];
    // Kend = K·exp(G[last] − G[r]), exp(G[last] − G[r]) = Π_{i>r} exp(g[i]) taken from the chunk's end
    std::fill(s.endfac + (C - 1) * K, s.endfac + C * K, T(1));
    for (int64_t r = C - 2; r >= 0; --r) {
        T* f = s.endfac + r * K;
        const T* egn = s.eg + (r + 1) * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) f[c] = flush_tiny(f[c + K] * egn[c]);
    }
#pragma omp simd
    for (int64_t i = 0; i < C * K; ++i) s.Kend[i] = s.Kc[i] * s.endfac[i];

    zero(s.M, C * C);
    zero(s.Aqk, C * C);
    T* a = scratch + K;
    T* Qa = a + kSub * K;
    T* Ka = Qa + kSub * K;
    T* b = Ka + kSub * K;
    T* Bk = b + C * K;
    T* BkT = Bk + C * K;
    for (int64_t n0 = 0; n0 < C; n0 += kSub) ek_products(d, s, n0, a, b, Bk, BkT, Qa, Ka, scratch);

    invert_unit_lower(d, s, BkT + C * K);
    small_gemm_nn(C, K, C, T(1), s.Tinv, C, s.Kb, K, T(0), s.W, K);
    small_gemm_nn(C, V, C, T(1), s.Tinv, C, s.Vb, V, T(0), s.U, V);
}

template <class T>
void pseudo_values(const Dims& d, const ChunkState<T>& s, const T* S_n) {
    small_gemm_nn(d.C, d.V, d.K, T(-1), s.W, d.K, S_n, d.V, T(1), s.U, d.V);
}

template <class T>
void state_step(const Dims& d, const ChunkState<T>& s, const T* S_n, T* S_next) {
    const int64_t C = d.C, K = d.K, V = d.V;
    pseudo_values(d, s, S_n);
    for (int64_t c = 0; c < K; ++c) {
        const T gm = s.gamma[c];
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) S_next[c * V + v] = gm * S_n[c * V + v];
    }
    small_gemm_tn(K, V, C, T(1), s.Kend, K, s.U, V, T(1), S_next, V);
}

template <class T>
void chunk_output(const Dims& d, const ChunkState<T>& s, const T* S_n, T* o, int64_t o_stride, int64_t rows) {
    const int64_t C = d.C, K = d.K, V = d.V;
    small_gemm_nn(rows, V, K, T(1), s.Qg, K, S_n, V, T(0), o, o_stride);
    small_gemm_nn(rows, V, C, T(1), s.Aqk, C, s.U, V, T(1), o, o_stride);
}

template <class T>
void dstate_step(const Dims& d, const ChunkState<T>& s, const T* dO, T* dVp, const T* dS_next, T* dS_n) {
    const int64_t C = d.C, K = d.K, V = d.V;
    small_gemm_tn(C, V, C, T(1), s.Aqk, C, dO, V, T(0), dVp, V);
    small_gemm_nn(C, V, K, T(1), s.Kend, K, dS_next, V, T(1), dVp, V);
    for (int64_t c = 0; c < K; ++c) {
        const T gm = s.gamma[c];
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) dS_n[c * V + v] = gm * dS_next[c * V + v];
    }
    small_gemm_tn(K, V, C, T(1), s.Qg, K, dO, V, T(1), dS_n, V);
    small_gemm_tn(K, V, C, T(-1), s.W, K, dVp, V, T(1), dS_n, V);
}

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
                    T* scratch) {
    const int64_t C = d.C, K = d.K, V = d.V, CK = C * K, CC = C * C;
    T* p = scratch;
    auto take = [&](int64_t n) {
        T* r = p;
        p += n;
        return r;
    };
    T* dAqk = take(CC);
    T* dT = take(CC);
    T* tmp = take(std::max(CC, CK));  // [C, C] and [C, K] products
    T* dM = take(CC);
    T* dQg = take(CK);
    T* dKend = take(CK);
    T* dW = take(CK);
    T* dKb = take(CK);
    T* dQ = take(CK);
    T* dK = take(CK);
    T* dG = take(CK);
    T* Rq = take(CK);
    T* Rk = take(CK);
    T* Ck = take(CK);
    T* Bk = take(CK);
    T* dVb = take(C * V);
    T* dgamma = take(K);
    T* dbeta = take(C);
    T* a = take(kSub * K);
    T* Qa = take(kSub * K);
    T* Ka = take(kSub * K);
    T* bfac = take(CK);
    T* lacc = take(K);
    T* UT = take(C * V);  // transposes for the A·Bᵀ products
    T* VbT = take(C * V);
    T* SnT = take(K * V);
    T* dSnT = take(K * V);
    T* KbT = take(CK);
    T* TinvT = take(CC);
    transpose(s.U, C, V, V, UT, C);
    transpose(s.Vb, C, V, V, VbT, C);
    transpose(S_n, K, V, V, SnT, K);
    transpose(dS_next, K, V, V, dSnT, K);
    transpose(s.Kb, C, K, K, KbT, C);
    transpose(s.Tinv, C, C, C, TinvT, C);

    // dAqk = tril(dO·V'ᵀ), diagonal included
    small_gemm_nn(C, C, V, T(1), dO, V, UT, C, T(0), dAqk, C);
    for (int64_t r = 0; r < C; ++r) zero(dAqk + r * C + r + 1, C - r - 1);
    small_gemm_nn(C, K, V, T(1), dO, V, SnT, K, T(0), dQg, K);      // dQg = dO·S_nᵀ
    small_gemm_nn(C, K, V, T(1), s.U, V, dSnT, K, T(0), dKend, K);  // dKend = V'·dS_{n+1}ᵀ
    for (int64_t c = 0; c < K; ++c) {
        T acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t v = 0; v < V; ++v) acc += dS_next[c * V + v] * S_n[c * V + v];
        dgamma[c] = acc;
    }
    small_gemm_nn(C, K, V, T(-1), dVp, V, SnT, K, T(0), dW, K);  // dW = −dV'·S_nᵀ
    small_gemm_nn(C, C, V, T(1), dVp, V, VbT, C, T(0), dT, C);   // dT = dU·Vbᵀ + dW·Kbᵀ
    small_gemm_nn(C, C, K, T(1), dW, K, KbT, C, T(1), dT, C);
    small_gemm_tn(C, V, C, T(1), s.Tinv, C, dVp, V, T(0), dVb, V);  // dVb = Tinvᵀ·dU
    small_gemm_tn(C, K, C, T(1), s.Tinv, C, dW, K, T(0), dKb, K);   // dKb = Tinvᵀ·dW

    zero(dK, CK);
    zero(dQ, CK);
    zero(dG, CK);
    for (int64_t r = 0; r < C; ++r) {
        T db = 0;
#pragma omp simd reduction(+ : db)
        for (int64_t v = 0; v < V; ++v) db += dVb[r * V + v] * s.Vc[r * V + v];
        const T b = s.beta[r];
#pragma omp simd reduction(+ : db)
        for (int64_t c = 0; c < K; ++c) {
            const T x = dKb[r * K + c];
            dK[r * K + c] += b * s.eG[r * K + c] * x;
            db += x * s.Kc[r * K + c] * s.eG[r * K + c];
            dG[r * K + c] += x * s.Kb[r * K + c];
        }
        dbeta[r] = db;
    }
    // dL = −strict_tril(Tinvᵀ·dT·Tinvᵀ);  dβ[r] += Σ_j dL[r,j]·M[r,j];  dM = Diag(β)·dL
    small_gemm_nn(C, C, C, T(1), dT, C, TinvT, C, T(0), tmp, C);
    small_gemm_tn(C, C, C, T(-1), s.Tinv, C, tmp, C, T(0), dM, C);
    for (int64_t r = 0; r < C; ++r) {
        T db = 0;
        for (int64_t j = 0; j < C; ++j) {
            if (j < r) {
                db += dM[r * C + j] * s.M[r * C + j];
                dM[r * C + j] *= s.beta[r];
            } else {
                dM[r * C + j] = 0;
            }
        }
        dbeta[r] += db;
    }

    // E-weighted terms of M (dM) and Aqk (dAqk):
    //   Rk[r] = Σ_j dM[r,j]·K[j]⊙E, Rq[r] = Σ_j dAqk[r,j]·K[j]⊙E, Ck[j] = Σ_r (dM[r,j]·K[r] + dAqk[r,j]·Q[r])⊙E
    zero(Rq, CK);
    zero(Rk, CK);
    zero(Ck, CK);
    for (int64_t n0 = 0; n0 < C; n0 += kSub) {
        // diagonal sub-block: lacc carries E[r, j] = E[r − 1, j]·exp(g[r]) down the column j
        for (int64_t j = n0; j < n0 + kSub; ++j) {
            const T* Kj = s.Kc + j * K;
            const T* Qj = s.Q + j * K;
            const T wd = dAqk[j * C + j];
            // NOTES: E[j,j] = 1 does not depend on G: these terms go to dq and dk only. Through Rq/Ck
            // they would enter dG[j] twice with opposite signs, and the rounding of that cancellation
            // is far larger than dg itself under strong decay.
            T* ck = Ck + j * K;
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) {
                dQ[j * K + c] += wd * Kj[c];
                dK[j * K + c] += wd * Qj[c];
                lacc[c] = T(1);
            }
            for (int64_t r = j + 1; r < n0 + kSub; ++r) {
                const T wq = dAqk[r * C + j], wm = dM[r * C + j];
                const T* Kr = s.Kc + r * K;
                const T* Qr = s.Q + r * K;
                const T* egr = s.eg + r * K;
                T* rq = Rq + r * K;
                T* rk = Rk + r * K;
#pragma omp simd
                for (int64_t c = 0; c < K; ++c) {
                    const T x = flush_tiny(lacc[c] * egr[c]);
                    lacc[c] = x;
                    const T kx = Kj[c] * x;
                    rq[c] += wq * kx;
                    rk[c] += wm * kx;
                    ck[c] += (wm * Kr[c] + wq * Qr[c]) * x;
                }
            }
        }
        if (n0 == 0) continue;
        offdiagonal_factors(s, K, n0, a, bfac);
        for (int64_t i = 0; i < kSub * K; ++i) {
            Qa[i] = s.Q[n0 * K + i] * a[i];
            Ka[i] = s.Kc[n0 * K + i] * a[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < n0 * K; ++i) Bk[i] = s.Kc[i] * bfac[i];
        // row side: R[n0 + r] += a_r ⊙ (dX[n0 + r, 0:n0]·Bk)
        small_gemm_nn(kSub, K, n0, T(1), dAqk + n0 * C, C, Bk, K, T(0), tmp, K);
        for (int64_t i = 0; i < kSub * K; ++i) Rq[n0 * K + i] += a[i] * tmp[i];
        small_gemm_nn(kSub, K, n0, T(1), dM + n0 * C, C, Bk, K, T(0), tmp, K);
        for (int64_t i = 0; i < kSub * K; ++i) Rk[n0 * K + i] += a[i] * tmp[i];
        // column side: Ck[j] += b_j ⊙ (dM[blk, j]ᵀ·Ka + dAqk[blk, j]ᵀ·Qa)
        small_gemm_tn(n0, K, kSub, T(1), dM + n0 * C, C, Ka, K, T(0), tmp, K);
        small_gemm_tn(n0, K, kSub, T(1), dAqk + n0 * C, C, Qa, K, T(1), tmp, K);
#pragma omp simd
        for (int64_t i = 0; i < n0 * K; ++i) Ck[i] += tmp[i] * bfac[i];
    }
#pragma omp simd
    for (int64_t i = 0; i < CK; ++i) {
        dK[i] += Rk[i] + Ck[i];
        dQ[i] += Rq[i];
        dG[i] += s.Kc[i] * (Rk[i] - Ck[i]) + s.Q[i] * Rq[i];
    }
    // through Qg = Q⊙e^G and Kend = K⊙e^(G[last] − G), γ = e^G[last]
    T* dGlast = dG + (C - 1) * K;
    for (int64_t r = 0; r < C; ++r) {
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) {
            const int64_t i = r * K + c;
            dQ[i] += dQg[i] * s.eG[i];
            dG[i] += dQg[i] * s.Qg[i];
            dK[i] += dKend[i] * s.endfac[i];
            const T ke = dKend[i] * s.Kend[i];
            dG[i] -= ke;
            dGlast[c] += ke;
        }
    }
    for (int64_t c = 0; c < K; ++c) dGlast[c] += dgamma[c] * s.gamma[c];
    // dg = reverse cumsum of dG over the rows
    for (int64_t r = C - 2; r >= 0; --r) {
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) dG[r * K + c] += dG[(r + 1) * K + c];
    }
    for (int64_t r = 0; r < rows; ++r) {
        if (out.dq) {
            T* dq = out.dq + r * out.dq_stride;
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) dq[c] += scale * dQ[r * K + c];
        }
        if (out.dk) {
            T* dk = out.dk + r * out.dq_stride;
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) dk[c] += dK[r * K + c];
        }
        if (out.dg) {
            T* dg = out.dg + r * out.dg_stride;
#pragma omp simd
            for (int64_t c = 0; c < K; ++c) dg[c] += dG[r * K + c];
        }
        if (out.dv) {
            T* dv = out.dv + r * out.dv_stride;
            const T b = s.beta[r];
#pragma omp simd
            for (int64_t v = 0; v < V; ++v) dv[v] += b * dVb[r * V + v];
        }
        if (out.dbeta) out.dbeta[r * out.dbeta_stride] += dbeta[r];
    }
}

#define TESSERA_KDA_INSTANTIATE(T)                                                                                \
    template ChunkState<T> carve_chunk_state<T>(T*, const Dims&);                                                 \
    template void prepare_chunk<T>(const Dims&, const ChunkInput<T>&, T, const ChunkState<T>&, T*);               \
    template void pseudo_values<T>(const Dims&, const ChunkState<T>&, const T*);                                  \
    template void state_step<T>(const Dims&, const ChunkState<T>&, const T*, T*);                                 \
    template void chunk_output<T>(const Dims&, const ChunkState<T>&, const T*, T*, int64_t, int64_t);             \
    template void dstate_step<T>(const Dims&, const ChunkState<T>&, const T*, T*, const T*, T*);                  \
    template void chunk_backward<T>(const Dims&, const ChunkState<T>&, T, const T*, const T*, const T*, const T*, \
                                    const ChunkGrads<T>&, int64_t, T*);
TESSERA_KDA_INSTANTIATE(float)
TESSERA_KDA_INSTANTIATE(double)

}  // namespace tessera::ops::cpu::kda
