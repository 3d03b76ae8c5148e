// KDA's chunked algorithm on CUDA (ops/kda.h, mode chunk): the CPU's WY form (ops/cpu/kda_chunk.h; formulas:
// ../shared/spec/kda.md §3.1–3.2) split into kernels after the structure of fla's chunk_kda, so that the work is
// parallel over chunks and only a short scan per (sequence, value head) is sequential:
//  - prepare: a block per (chunk, value head) builds what does not depend on the state entering the chunk (the decay
//    factors, Aqk, M, T = (I + Diag(β)M)⁻¹, W, U, Qg, Kend, γ) in the chunk's slot of device scratch; given the
//    states, it also turns U into V' = U − W·S_n;
//  - the state scan: a block per (sequence, value head, 32 value columns) walks the chunks in order. The state step
//    is column-local (V' = U − W·S, S ← Diag(γ)·S + Kendᵀ·V'), so 8 threads own one column of S in shared memory
//    (every 8th row each; the products over the rows summed by a butterfly); it writes the state entering every
//    chunk (the saved states) and V';
//  - the output: a block per chunk, O = Qg·S_n + Aqk·V';
//  - backward: the reverse scan of dS (column-local as well: dV' = Aqkᵀ·dO + Kend·dS_{n+1},
//    dS_n = Qgᵀ·dO + Diag(γ)·dS_{n+1} − Wᵀ·dV'), then a block per chunk for every other gradient.
// The chunks go in windows of global chunk indices, so the slots stay within a bound of device memory; a sequence cut
// by a window goes on from its saved state (forward) or from a carried dS (backward).
// Every sum has one thread and one order: bitwise run to run. Decay factors are running products of exp(g), as on the
// CPU (never exp of a difference of prefix sums), flushed to 0 below the smallest normal number as exp underflows.
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {

constexpr int64_t kSub = 16;        // rows of the sub-blocks whose decay factors are carried from their first row
constexpr int kChunkThreads = 256;  // threads of a per-chunk block

template <class T>
__device__ inline T flush_tiny(T x) {
    return x < (sizeof(T) == 4 ? T(FLT_MIN) : T(DBL_MIN)) ? T(0) : x;
}

// First row of row block n0's factors in the Bk, Bf tables (blocks n0 = 16, 32, … hold n0 rows each).
__host__ __device__ inline int64_t factor_row(int64_t n0) { return n0 * (n0 - kSub) / (2 * kSub); }

// One chunk's slot (fields [rows, columns]). Forward: the inputs (Q = scale·q, Kc, Vc, β zero-padded), eg = e^g,
// eG = e^G (G the chunk-local inclusive cumsum), endfac = e^(G[last] − G), a = e^(G[r] − G[n0]) within r's row block,
// Qa = Q⊙a, Ka = Kc⊙a; per row block n0 ≥ 16 and row j < n0: Bf = e^(G[n0] − G[j]), Bk = Kc⊙Bf; Kb = β·Kc⊙eG,
// Vb = β·Vc, Qg = Q⊙eG, Kend = Kc⊙endfac; M (strictly lower), Aqk (lower with the diagonal), Tinv; W = Tinv·Kb,
// U = Tinv·Vb (V' once the state is known), γ = e^G[last]. Backward adds dO (zero-padded), dV', dS_{n+1} and its
// products.
template <class T>
struct Slot {
    T *Q, *Kc, *eg, *eG, *endfac, *a, *Qa, *Ka, *Kb, *W, *Qg, *Kend;  // [C, K]
    T *Bf, *Bk;                                                       // [factor_row(C), K]
    T *Vc, *Vb, *U;                                                   // [C, V]
    T *M, *Aqk, *Tinv;                                                // [C, C]
    T *beta, *gamma;                                                  // [C], [K]
    T *dO, *dVp, *dVb;                                                // [C, V]
    T* dSn;                                                           // [K, V]
    T *dAqk, *dT, *tmp, *dM;                                          // [C, C]
    T *dQg, *dKend, *dW, *dKb, *dQ, *dK, *dG;                         // [C, K]
    T *dgamma, *dbeta;                                                // [K], [C]
};

// Elements of a slot (forward, or forward and backward), a multiple of 32 so that slots stay aligned.
__host__ __device__ inline int64_t slot_elements(int64_t C, int64_t K, int64_t V, bool backward) {
    const int64_t CK = C * K, CV = C * V, CC = C * C;
    int64_t n = 12 * CK + 2 * factor_row(C) * K + 3 * CV + 3 * CC + C + K;
    if (backward) n += 3 * CV + K * V + 4 * CC + 7 * CK + K + C;
    return (n + 31) / 32 * 32;
}

// The slot's fields from p, in slot_elements' count (backward: its part too).
template <class T>
__device__ Slot<T> carve_slot(T* p, int64_t C, int64_t K, int64_t V, bool backward) {
    const int64_t CK = C * K, CV = C * V, CC = C * C, F = factor_row(C) * K;
    auto take = [&p](int64_t n) {
        T* f = p;
        p += n;
        return f;
    };
    Slot<T> x{};
    x.Q = take(CK), x.Kc = take(CK), x.eg = take(CK), x.eG = take(CK), x.endfac = take(CK), x.a = take(CK);
    x.Qa = take(CK), x.Ka = take(CK), x.Kb = take(CK), x.W = take(CK), x.Qg = take(CK), x.Kend = take(CK);
    x.Bf = take(F), x.Bk = take(F);
    x.Vc = take(CV), x.Vb = take(CV), x.U = take(CV);
    x.M = take(CC), x.Aqk = take(CC), x.Tinv = take(CC);
    x.beta = take(C), x.gamma = take(K);
    if (!backward) return x;
    x.dO = take(CV), x.dVp = take(CV), x.dVb = take(CV);
    x.dSn = take(K * V);
    x.dAqk = take(CC), x.dT = take(CC), x.tmp = take(CC), x.dM = take(CC);
    x.dQg = take(CK), x.dKend = take(CK), x.dW = take(CK), x.dKb = take(CK), x.dQ = take(CK), x.dK = take(CK);
    x.dG = take(CK);
    x.dgamma = take(K), x.dbeta = take(C);
    return x;
}

// The slot of global chunk g and value head i in a window starting at chunk c0.
template <class T>
__device__ inline Slot<T> slot_of(const KdaShape& s, T* slots, int64_t g, int64_t c0, int64_t i, bool backward) {
    const int64_t elems = slot_elements(s.C, s.K, s.V, backward);
    return carve_slot(slots + ((g - c0) * s.HV + i) * elems, s.C, s.K, s.V, backward);
}

// Which elements of a block product are computed; the others are set to 0.
enum class Part : int { all, lower, strict };  // all, n ≤ m, n < m

// The block's products go by output tiles of kTile × kTile held in registers: thread (ty, tx) of the 16 × 16 owns
// rows ty + 16·i and columns tx + 16·j (i, j < 4) of the tile; the operands come through shared memory kStep values
// of l at a time. Every element is still one thread's sum from zero, l ascending, so the tiles change where the
// operands are read from, not the bits. Against one thread per element reading both operands from the slots, a
// 64 × 128 × 64 product reads each operand value from global memory once per tile instead of once per element.
constexpr int kTile = 64, kStep = 16, kLanes = kTile / 16;
static_assert(kChunkThreads == 256, "block_tiles: a 16 × 16 grid of threads");

// The shared memory of block_tiles: the two operand tiles of the scalar path, or the tensor-core path's bf16 operand
// tiles and f32 output tile.
constexpr size_t kTilesSmem = std::max(2 * kStep * (kTile + 1) * sizeof(double),
                                       2 * kStep * kTile * sizeof(__nv_bfloat16) + kTile * kTile * sizeof(float));

// That shared memory, one buffer per kernel: declared in block_tiles (a template), every product with its own store
// would get its own.
__device__ inline unsigned char* tiles_smem() {
    __align__(32) __shared__ unsigned char smem[kTilesSmem];
    return smem;
}

// block_tiles on tensor cores (train.precision = bf16 with f32 data): the operands rounded to bf16 as they are staged
// ([m][l] and [l][n]), the tile's 16 sub-tiles of 16 × 16 on the 8 warps (a row of 16 and two columns of 16 each), f32
// sums over l in steps of 16 (WMMA), then the tile through shared memory to store: element e of the tile goes to
// thread e mod 256, the same thread for the same shape (so a second product may read what the first stored).
template <class Keep, class Store>
__device__ void block_tiles_tc(int64_t M,
                               int64_t N,
                               int64_t L,
                               const float* A,
                               int64_t am,
                               int64_t al,
                               const float* B,
                               int64_t bl,
                               int64_t bn,
                               Keep keep,
                               Store store,
                               unsigned char* smem) {
    namespace wmma = nvcuda::wmma;
    auto* As = reinterpret_cast<__nv_bfloat16*>(smem);        // [kTile][kStep]
    __nv_bfloat16* Bs = As + kTile * kStep;                   // [kStep][kTile]
    auto* Cs = reinterpret_cast<float*>(Bs + kStep * kTile);  // [kTile][kTile]
    const int tid = threadIdx.x, warp = tid / 32, sm = warp / 2 * 16, sn = warp % 2 * 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    for (int64_t m0 = 0; m0 < M; m0 += kTile)
        for (int64_t n0 = 0; n0 < N; n0 += kTile) {
            if (!keep(m0, n0)) continue;
            wmma::fill_fragment(acc[0], 0.0f);
            wmma::fill_fragment(acc[1], 0.0f);
            for (int64_t l0 = 0; l0 < L; l0 += kStep) {
                const int64_t steps = min(int64_t(kStep), L - l0);
                __syncthreads();  // the previous step's operands (or the previous tile's output) are consumed
                for (int e = tid; e < kStep * kTile; e += kChunkThreads) {
                    const int a_l = al == 1 ? e % kStep : e / kTile, a_m = al == 1 ? e / kStep : e % kTile;
                    const int b_l = bl == 1 ? e % kStep : e / kTile, b_n = bl == 1 ? e / kStep : e % kTile;
                    As[a_m * kStep + a_l] =
                        __float2bfloat16(a_l < steps && m0 + a_m < M ? A[(m0 + a_m) * am + (l0 + a_l) * al] : 0.0f);
                    Bs[b_l * kTile + b_n] =
                        __float2bfloat16(b_l < steps && n0 + b_n < N ? B[(l0 + b_l) * bl + (n0 + b_n) * bn] : 0.0f);
                }
                __syncthreads();
                wmma::load_matrix_sync(fa, As + sm * kStep, unsigned(kStep));
                for (int h = 0; h < 2; ++h) {
                    wmma::load_matrix_sync(fb, Bs + sn + 16 * h, unsigned(kTile));
                    wmma::mma_sync(acc[h], fa, fb, acc[h]);
                }
            }
            __syncthreads();  // the previous tile's output is consumed
            for (int h = 0; h < 2; ++h)
                wmma::store_matrix_sync(Cs + sm * kTile + sn + 16 * h, acc[h], unsigned(kTile), wmma::mem_row_major);
            __syncthreads();
            for (int e = tid; e < kTile * kTile; e += kChunkThreads) {
                const int64_t m = m0 + e / kTile, n = n0 + e % kTile;
                if (m < M && n < N) store(m, n, Cs[e]);
            }
        }
}

// store(m, n, Σ_l A(m, l)·B(l, n)) for every element of the M × N product over the block's threads, A(m, l) =
// A[m·am + l·al], B(l, n) = B[l·bl + n·bn]; tiles where keep(m0, n0) is false (none of their elements wanted) are
// skipped. Every thread of the block takes part. tc (f32 only): on tensor cores, operands rounded to bf16.
template <class T, class Keep, class Store>
__device__ void block_tiles(bool tc,
                            int64_t M,
                            int64_t N,
                            int64_t L,
                            const T* A,
                            int64_t am,
                            int64_t al,
                            const T* B,
                            int64_t bl,
                            int64_t bn,
                            Keep keep,
                            Store store) {
    unsigned char* smem = tiles_smem();
    if constexpr (std::is_same_v<T, float>) {
        if (tc) return block_tiles_tc(M, N, L, A, am, al, B, bl, bn, keep, store, smem);
    }
    auto* As = reinterpret_cast<T(*)[kTile + 1]>(smem);  // [l][m], [l][n]; the pad spreads l-major stores
    auto* Bs = As + kStep;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    for (int64_t m0 = 0; m0 < M; m0 += kTile)
        for (int64_t n0 = 0; n0 < N; n0 += kTile) {
            if (!keep(m0, n0)) continue;
            T acc[kLanes][kLanes];
#pragma unroll
            for (int i = 0; i < kLanes; ++i)
#pragma unroll
                for (int j = 0; j < kLanes; ++j) acc[i][j] = 0;
            for (int64_t l0 = 0; l0 < L; l0 += kStep) {
                const int64_t steps = min(int64_t(kStep), L - l0);
                __syncthreads();  // the previous step's (or product's) operands are consumed
                // consecutive threads read consecutive addresses where the operand's stride along l is 1
                for (int e = tid; e < kStep * kTile; e += kChunkThreads) {
                    const int a_l = al == 1 ? e % kStep : e / kTile, a_m = al == 1 ? e / kStep : e % kTile;
                    const int b_l = bl == 1 ? e % kStep : e / kTile, b_n = bl == 1 ? e / kStep : e % kTile;
                    As[a_l][a_m] = a_l < steps && m0 + a_m < M ? A[(m0 + a_m) * am + (l0 + a_l) * al] : T(0);
                    Bs[b_l][b_n] = b_l < steps && n0 + b_n < N ? B[(l0 + b_l) * bl + (n0 + b_n) * bn] : T(0);
                }
                __syncthreads();
                for (int l = 0; l < steps; ++l) {
                    T a[kLanes], b[kLanes];
#pragma unroll
                    for (int i = 0; i < kLanes; ++i) a[i] = As[l][ty + 16 * i];
#pragma unroll
                    for (int j = 0; j < kLanes; ++j) b[j] = Bs[l][tx + 16 * j];
#pragma unroll
                    for (int i = 0; i < kLanes; ++i)
#pragma unroll
                        for (int j = 0; j < kLanes; ++j) acc[i][j] += a[i] * b[j];
                }
            }
#pragma unroll
            for (int i = 0; i < kLanes; ++i)
#pragma unroll
                for (int j = 0; j < kLanes; ++j) {
                    const int64_t m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
                    if (m < M && n < N) store(m, n, acc[i][j]);
                }
        }
}

// Out[m, n] = alpha·Σ_l A(m, l)·B(l, n) + beta·Out[m, n] (block_tiles' operands, and tc); beta = 0 overwrites.
// Elements outside `part` are set to 0.
template <class T>
__device__ void block_mm(bool tc,
                         int64_t M,
                         int64_t N,
                         int64_t L,
                         T alpha,
                         const T* A,
                         int64_t am,
                         int64_t al,
                         const T* B,
                         int64_t bl,
                         int64_t bn,
                         T beta,
                         T* out,
                         int64_t ldo,
                         Part part = Part::all) {
    const auto wanted = [part](int64_t m, int64_t n) {
        return part == Part::all || (part == Part::lower ? n <= m : n < m);
    };
    // a tile above the diagonal holds no wanted element: zeroed without its product
    const auto keep = [&](int64_t m0, int64_t n0) {
        if (wanted(min(M, m0 + kTile) - 1, n0)) return true;
        for (int64_t e = threadIdx.x; e < kTile * kTile; e += blockDim.x) {
            const int64_t m = m0 + e / kTile, n = n0 + e % kTile;
            if (m < M && n < N) out[m * ldo + n] = 0;
        }
        return false;
    };
    block_tiles(tc, M, N, L, A, am, al, B, bl, bn, keep, [&](int64_t m, int64_t n, T acc) {
        T* o = out + m * ldo + n;
        *o = !wanted(m, n) ? T(0) : beta == T(0) ? alpha * acc : alpha * acc + beta * *o;
    });
}

// Where a per-chunk block is: global chunk g (of its sequence sq, chunk n of it, first token t0, rows valid rows),
// value head i, q/k head h, and its slot.
template <class T>
struct ChunkAt {
    int64_t g, i, h, n, t0, rows;
    KdaSeq sq;
    Slot<T> x;
};

template <class T>
__device__ ChunkAt<T> chunk_at(
    const KdaShape& s, const KdaSeq* seqs, const int64_t* chunk_seq, int64_t c0, T* slots, bool backward) {
    ChunkAt<T> c;
    c.g = c0 + blockIdx.x / s.HV;
    c.i = blockIdx.x % s.HV;
    c.h = c.i / (s.HV / s.H);
    c.sq = seqs[chunk_seq[c.g]];
    c.n = c.g - c.sq.chunk0;
    c.t0 = c.sq.first + c.n * s.C;
    c.rows = min(s.C, c.sq.len - c.n * s.C);
    c.x = slot_of(s, slots, c.g, c0, c.i, backward);
    return c;
}

template <class T>
__global__ void __launch_bounds__(kChunkThreads) prepare_kernel(KdaShape s,
                                                                const KdaSeq* seqs,
                                                                const int64_t* chunk_seq,
                                                                int64_t c0,
                                                                KdaTensors<T> in,
                                                                const T* states,
                                                                T* slots,
                                                                bool backward) {
    const ChunkAt<T> at = chunk_at<T>(s, seqs, chunk_seq, c0, slots, backward);
    const Slot<T>& x = at.x;
    const int64_t C = s.C, K = s.K, V = s.V, tid = threadIdx.x, nt = blockDim.x;
    const T scale = T(s.scale);
    // the inputs, zero-padded past the chunk's rows (exact: g = β = q = k = v = 0 add nothing)
    for (int64_t e = tid; e < C * K; e += nt) {
        const int64_t r = e / K, c = e % K, tok = at.t0 + r;
        const bool in_chunk = r < at.rows;
        x.Q[e] = in_chunk ? scale * in.q[(tok * s.H + at.h) * K + c] : T(0);
        x.Kc[e] = in_chunk ? in.k[(tok * s.H + at.h) * K + c] : T(0);
        x.eg[e] = in_chunk ? T(exp(double(in.g[(tok * s.HV + at.i) * K + c]))) : T(1);
    }
    for (int64_t e = tid; e < C * V; e += nt) {
        const int64_t r = e / V, tok = at.t0 + r;
        x.Vc[e] = r < at.rows ? in.v[(tok * s.HV + at.i) * V + e % V] : T(0);
    }
    for (int64_t r = tid; r < C; r += nt) x.beta[r] = r < at.rows ? in.beta[(at.t0 + r) * s.HV + at.i] : T(0);
    __syncthreads();
    // the running products down each channel's column
    for (int64_t c = tid; c < K; c += nt) {
        T p = x.eg[c];
        x.eG[c] = p;
        for (int64_t r = 1; r < C; ++r) x.eG[r * K + c] = p = flush_tiny(p * x.eg[r * K + c]);
        x.gamma[c] = p;
        x.endfac[(C - 1) * K + c] = p = T(1);
        for (int64_t r = C - 2; r >= 0; --r) x.endfac[r * K + c] = p = flush_tiny(p * x.eg[(r + 1) * K + c]);
        for (int64_t r = 0; r < C; ++r) x.a[r * K + c] = p = r % kSub == 0 ? T(1) : flush_tiny(p * x.eg[r * K + c]);
        for (int64_t n0 = kSub; n0 < C; n0 += kSub) {
            T* bf = x.Bf + factor_row(n0) * K;
            T* bk = x.Bk + factor_row(n0) * K;
            p = x.eg[n0 * K + c];
            for (int64_t j = n0 - 1; j >= 0; --j) {
                if (j < n0 - 1) p = flush_tiny(p * x.eg[(j + 1) * K + c]);
                bf[j * K + c] = p;
                bk[j * K + c] = x.Kc[j * K + c] * p;
            }
        }
    }
    __syncthreads();
    for (int64_t e = tid; e < C * K; e += nt) {
        const T b = x.beta[e / K];
        x.Qg[e] = x.Q[e] * x.eG[e];
        x.Kb[e] = b * x.Kc[e] * x.eG[e];
        x.Kend[e] = x.Kc[e] * x.endfac[e];
        x.Qa[e] = x.Q[e] * x.a[e];
        x.Ka[e] = x.Kc[e] * x.a[e];
    }
    for (int64_t e = tid; e < C * V; e += nt) x.Vb[e] = x.beta[e / V] * x.Vc[e];
    __syncthreads();
    // Aqk[r, j] = Σ Q[r]·Kc[j]·E[r, j] (j ≤ r), M[r, j] = Σ Kc[r]·Kc[j]·E[r, j] (j < r). In r's diagonal row block
    // E[r, j] is carried from E[j, j] = 1 down the rows; left of it, E[r, j] = a[r]·Bf_n0[j], so there the row block
    // n0's elements are the products Qa·Bk_n0ᵀ and Ka·Bk_n0ᵀ: at s.bf16 on tensor cores (below), else here.
    for (int64_t e = tid; e < C * C; e += nt) {
        const int64_t r = e / C, j = e % C, n0 = r / kSub * kSub;
        if (s.bf16 && j < n0) continue;
        T aq = 0, am = 0;
        if (j <= r && j >= n0) {
            for (int64_t c = 0; c < K; ++c) {
                T f = 1;
                for (int64_t l = j + 1; l <= r; ++l) f = flush_tiny(f * x.eg[l * K + c]);
                const T kx = x.Kc[j * K + c] * f;
                aq += x.Q[r * K + c] * kx;
                am += x.Kc[r * K + c] * kx;
            }
            if (j == r) am = 0;
        } else if (j < n0) {
            const T* bk = x.Bk + (factor_row(n0) + j) * K;
            for (int64_t c = 0; c < K; ++c) {
                aq += x.Qa[r * K + c] * bk[c];
                am += x.Ka[r * K + c] * bk[c];
            }
        }
        x.Aqk[e] = aq;
        x.M[e] = am;
    }
    for (int64_t n0 = kSub; s.bf16 && n0 < C; n0 += kSub) {
        const T* bk = x.Bk + factor_row(n0) * K;
        const int64_t rows = min(kSub, C - n0);
        const auto all = [](int64_t, int64_t) { return true; };
        block_tiles<T>(true, rows, n0, K, x.Qa + n0 * K, K, int64_t(1), bk, int64_t(1), K, all,
                       [&](int64_t m, int64_t n, T acc) { x.Aqk[(n0 + m) * C + n] = acc; });
        block_tiles<T>(true, rows, n0, K, x.Ka + n0 * K, K, int64_t(1), bk, int64_t(1), K, all,
                       [&](int64_t m, int64_t n, T acc) { x.M[(n0 + m) * C + n] = acc; });
    }
    __syncthreads();
    // Tinv = (I + Diag(β)·M)⁻¹, unit lower, by forward substitution: a thread per column
    for (int64_t j = tid; j < C; j += nt) {
        for (int64_t r = 0; r < C; ++r) {
            T t = r == j ? T(1) : T(0);
            for (int64_t l = j; l < r; ++l) t -= (x.beta[r] * x.M[r * C + l]) * x.Tinv[l * C + j];
            x.Tinv[r * C + j] = t;
        }
    }
    __syncthreads();
    block_mm<T>(s.bf16, C, K, C, 1, x.Tinv, C, 1, x.Kb, K, 1, 0, x.W, K);
    block_mm<T>(s.bf16, C, V, C, 1, x.Tinv, C, 1, x.Vb, V, 1, 0, x.U, V);
    if (!states) return;
    __syncthreads();  // V' = U − W·S_n
    block_mm<T>(s.bf16, C, V, K, -1, x.W, K, 1, states + (at.g * s.HV + at.i) * K * V, V, 1, 1, x.U, V);
}

// The scans: a group of kScanLanes threads per value column j, lane p holding rows p, p + kScanLanes, … of the
// column of S (or dS) in shared memory; products over the rows are summed across the group by a butterfly. Each step
// of the butterfly adds the same two values on both lanes (in either order: the same bits), so every lane ends with
// the same sum.
constexpr int kScanLanes = 8;
constexpr int kScanColumns = 32;  // value columns per scan block
constexpr int kScanThreads = kScanColumns * kScanLanes;

template <class T>
__device__ inline T group_sum(T x) {
    for (int m = kScanLanes / 2; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// Where a scan thread is: its (sequence, value head) unit, column j, lane p, and the sequence's chunks in the window
// [c0, c1): [first, end) of global chunk indices.
struct ScanAt {
    int64_t unit, i, j, p, chunks, first, end;
    bool valid;  // j < V (the others take part in the butterflies only)
    KdaSeq sq;
};

__device__ inline ScanAt scan_at(const KdaShape& s, const KdaSeq* seqs, int64_t c0, int64_t c1) {
    ScanAt a;
    a.unit = blockIdx.x;
    a.i = a.unit % s.HV;
    a.j = int64_t(blockIdx.y) * kScanColumns + threadIdx.x / kScanLanes;
    a.p = threadIdx.x % kScanLanes;
    a.valid = a.j < s.V;
    a.sq = seqs[a.unit / s.HV];
    a.chunks = (a.sq.len + s.C - 1) / s.C;
    a.first = max(c0, a.sq.chunk0);
    a.end = min(c1, a.sq.chunk0 + a.chunks);
    return a;
}

// The forward state scan over the window's chunks.
template <class T>
__global__ void __launch_bounds__(kScanThreads) state_scan_kernel(
    KdaShape s, const KdaSeq* seqs, int64_t c0, int64_t c1, const T* h0, T* slots, T* states, T* ht, bool backward) {
    const int64_t K = s.K, V = s.V, C = s.C, KV = K * V, P = kScanLanes;
    const ScanAt a = scan_at(s, seqs, c0, c1);
    T* S = reinterpret_cast<T*>(dynamic_shared()) + threadIdx.x / kScanLanes;  // S[c·kScanColumns]
    constexpr int64_t ld = kScanColumns;
    if (a.chunks == 0) {  // an empty sequence: ht = h0
        if (c0 == 0 && ht && a.valid)
            for (int64_t c = a.p; c < K; c += P)
                ht[(a.unit * K + c) * V + a.j] = h0 ? h0[(a.unit * K + c) * V + a.j] : T(0);
        return;
    }
    if (a.first >= a.end) return;
    // the state entering the window: h0 at the sequence's start, else the one the window before saved
    const T* from = a.first == a.sq.chunk0 ? (h0 ? h0 + a.unit * KV : nullptr) : states + (a.first * s.HV + a.i) * KV;
    for (int64_t c = a.p; c < K; c += P) S[c * ld] = from && a.valid ? from[c * V + a.j] : T(0);
    for (int64_t g = a.first; g < a.end; ++g) {
        const Slot<T> x = slot_of(s, slots, g, c0, a.i, backward);
        if (a.valid)
            for (int64_t c = a.p; c < K; c += P) states[(g * s.HV + a.i) * KV + c * V + a.j] = S[c * ld];
        for (int64_t r = 0; r < C; ++r) {  // V' = U − W·S
            T part = 0;
            for (int64_t c = a.p; c < K; c += P) part += x.W[r * K + c] * S[c * ld];
            const T ws = group_sum(part);
            if (a.valid && a.p == 0) x.U[r * V + a.j] -= ws;
        }
        __syncthreads();
        if (a.valid)
            for (int64_t c = a.p; c < K; c += P) {  // S ← Diag(γ)·S + Kendᵀ·V'
                T acc = 0;
                for (int64_t r = 0; r < C; ++r) acc += x.Kend[r * K + c] * x.U[r * V + a.j];
                S[c * ld] = x.gamma[c] * S[c * ld] + acc;
            }
    }
    T* to = a.end == a.sq.chunk0 + a.chunks ? (ht ? ht + a.unit * KV : nullptr) : states + (a.end * s.HV + a.i) * KV;
    if (to && a.valid)
        for (int64_t c = a.p; c < K; c += P) to[c * V + a.j] = S[c * ld];
}

// O = Qg·S_n + Aqk·V' for the chunk's valid rows: the inter-chunk part goes to o, then the intra-chunk part is added
// by the thread that wrote it (Aqk is zero above its diagonal).
template <class T>
__global__ void __launch_bounds__(kChunkThreads) output_kernel(
    KdaShape s, const KdaSeq* seqs, const int64_t* chunk_seq, int64_t c0, T* slots, const T* states, T* o) {
    const ChunkAt<T> at = chunk_at<T>(s, seqs, chunk_seq, c0, slots, false);
    const int64_t C = s.C, K = s.K, V = s.V;
    const T* Sn = states + (at.g * s.HV + at.i) * K * V;
    T* out = o + (at.t0 * s.HV + at.i) * V;
    const int64_t ldo = s.HV * V;
    const auto all = [](int64_t, int64_t) { return true; };
    bool add = false;  // one store for both products (one instantiation of block_tiles: one copy of its shared memory)
    const auto put = [&](int64_t r, int64_t j, T x) { out[r * ldo + j] = add ? x + out[r * ldo + j] : x; };
    block_tiles(s.bf16, at.rows, V, K, at.x.Qg, K, int64_t(1), Sn, V, int64_t(1), all, put);
    add = true;
    block_tiles(s.bf16, at.rows, V, C, at.x.Aqk, C, int64_t(1), at.x.U, V, int64_t(1), all, put);
}

// The reverse scan of dS over the window's chunks. It writes each chunk's dO (zero-padded), dS_{n+1} and dV' into
// its slot; dS goes on in `carry` to the window before, and into dh0 at the sequence's start.
template <class T>
__global__ void __launch_bounds__(kScanThreads) dstate_scan_kernel(
    KdaShape s, const KdaSeq* seqs, int64_t c0, int64_t c1, const T* dout, const T* dht, T* slots, T* carry, T* dh0) {
    const int64_t K = s.K, V = s.V, C = s.C, KV = K * V, P = kScanLanes;
    const ScanAt a = scan_at(s, seqs, c0, c1);
    T* dS = reinterpret_cast<T*>(dynamic_shared()) + threadIdx.x / kScanLanes;  // dS[c·kScanColumns]
    constexpr int64_t ld = kScanColumns;
    if (a.chunks == 0) {  // an empty sequence: dh0 += dht
        if (c0 == 0 && dh0 && dht && a.valid)
            for (int64_t c = a.p; c < K; c += P) dh0[(a.unit * K + c) * V + a.j] += dht[(a.unit * K + c) * V + a.j];
        return;
    }
    if (a.first >= a.end) return;
    const T* from = a.end == a.sq.chunk0 + a.chunks ? dht : carry;
    for (int64_t c = a.p; c < K; c += P) dS[c * ld] = from && a.valid ? from[a.unit * KV + c * V + a.j] : T(0);
    for (int64_t g = a.end - 1; g >= a.first; --g) {
        const Slot<T> x = slot_of(s, slots, g, c0, a.i, true);
        const int64_t t0 = a.sq.first + (g - a.sq.chunk0) * C, rows = min(C, a.sq.len - (g - a.sq.chunk0) * C);
        if (a.valid) {
            for (int64_t c = a.p; c < K; c += P) x.dSn[c * V + a.j] = dS[c * ld];
            for (int64_t r = a.p; r < C; r += P)
                x.dO[r * V + a.j] = r < rows && dout ? dout[((t0 + r) * s.HV + a.i) * V + a.j] : T(0);
        }
        __syncthreads();
        for (int64_t r = 0; r < C; ++r) {  // dV' = Aqkᵀ·dO + Kend·dS
            T part = 0;
            if (a.valid) {
                for (int64_t l = r + a.p; l < C; l += P) part += x.Aqk[l * C + r] * x.dO[l * V + a.j];
                for (int64_t c = a.p; c < K; c += P) part += x.Kend[r * K + c] * dS[c * ld];
            }
            const T dvp = group_sum(part);
            if (a.valid && a.p == 0) x.dVp[r * V + a.j] = dvp;
        }
        __syncthreads();
        if (a.valid)
            for (int64_t c = a.p; c < K; c += P) {  // dS ← Diag(γ)·dS + Qgᵀ·dO − Wᵀ·dV'
                T fromo = 0, fromv = 0;
                for (int64_t r = 0; r < C; ++r) {
                    fromo += x.Qg[r * K + c] * x.dO[r * V + a.j];
                    fromv += x.W[r * K + c] * x.dVp[r * V + a.j];
                }
                dS[c * ld] = x.gamma[c] * dS[c * ld] + fromo - fromv;
            }
    }
    const bool starts = a.first == a.sq.chunk0;
    T* to = starts ? dh0 : carry;
    if (to && a.valid)
        for (int64_t c = a.p; c < K; c += P) {
            T& d = to[a.unit * KV + c * V + a.j];
            d = starts ? d + dS[c * ld] : dS[c * ld];
        }
}

// Every gradient of one chunk but dS (spec §3.2), given S_n, V' (in U), dO, dV' and dS_{n+1} in its slot.
// dq, dk rows: per value head when qk_heads = HV (GVA; summed over the group afterwards).
template <class T>
__global__ void __launch_bounds__(kChunkThreads) chunk_backward_kernel(KdaShape s,
                                                                       const KdaSeq* seqs,
                                                                       const int64_t* chunk_seq,
                                                                       int64_t c0,
                                                                       T* slots,
                                                                       const T* states,
                                                                       KdaGradPtrs<T> gr,
                                                                       int64_t qk_heads) {
    const ChunkAt<T> at = chunk_at<T>(s, seqs, chunk_seq, c0, slots, true);
    const Slot<T>& x = at.x;
    const int64_t C = s.C, K = s.K, V = s.V, tid = threadIdx.x, nt = blockDim.x;
    const T* Sn = states + (at.g * s.HV + at.i) * K * V;
    block_mm<T>(s.bf16, C, C, V, 1, x.dO, V, 1, x.U, 1, V, 0, x.dAqk, C, Part::lower);  // dAqk = tril(dO·V'ᵀ)
    block_mm<T>(s.bf16, C, K, V, 1, x.dO, V, 1, Sn, 1, V, 0, x.dQg, K);                 // dQg = dO·S_nᵀ
    block_mm<T>(s.bf16, C, K, V, 1, x.U, V, 1, x.dSn, 1, V, 0, x.dKend, K);             // dKend = V'·dS_{n+1}ᵀ
    block_mm<T>(s.bf16, C, K, V, -1, x.dVp, V, 1, Sn, 1, V, 0, x.dW, K);                // dW = −dV'·S_nᵀ
    block_mm<T>(s.bf16, C, C, V, 1, x.dVp, V, 1, x.Vb, 1, V, 0, x.dT, C);     // dT = dV'·Vbᵀ (+ dW·Kbᵀ below)
    block_mm<T>(s.bf16, C, V, C, 1, x.Tinv, 1, C, x.dVp, V, 1, 0, x.dVb, V);  // dVb = Tinvᵀ·dV'
    for (int64_t c = tid; c < K; c += nt) {
        T acc = 0;
        for (int64_t v = 0; v < V; ++v) acc += x.dSn[c * V + v] * Sn[c * V + v];
        x.dgamma[c] = acc;
    }
    __syncthreads();
    block_mm<T>(s.bf16, C, C, K, 1, x.dW, K, 1, x.Kb, 1, K, 1, x.dT, C);
    block_mm<T>(s.bf16, C, K, C, 1, x.Tinv, 1, C, x.dW, K, 1, 0, x.dKb, K);  // dKb = Tinvᵀ·dW
    __syncthreads();
    block_mm<T>(s.bf16, C, C, C, 1, x.dT, C, 1, x.Tinv, 1, C, 0, x.tmp, C);  // tmp = dT·Tinvᵀ
    for (int64_t e = tid; e < C * K; e += nt) {
        const T d = x.dKb[e];
        x.dK[e] = x.beta[e / K] * x.eG[e] * d;
        x.dG[e] = d * x.Kb[e];
    }
    for (int64_t r = tid; r < C; r += nt) {
        T db = 0;
        for (int64_t v = 0; v < V; ++v) db += x.dVb[r * V + v] * x.Vc[r * V + v];
        for (int64_t c = 0; c < K; ++c) db += x.dKb[r * K + c] * x.Kc[r * K + c] * x.eG[r * K + c];
        x.dbeta[r] = db;
    }
    __syncthreads();
    block_mm<T>(s.bf16, C, C, C, -1, x.Tinv, 1, C, x.tmp, C, 1, 0, x.dM, C,
                Part::strict);  // dL = −strict_tril(Tinvᵀ·tmp)
    __syncthreads();
    for (int64_t r = tid; r < C; r += nt) {  // dβ[r] += Σ_j dL[r, j]·M[r, j]; dM = Diag(β)·dL
        T db = 0;
        for (int64_t j = 0; j < r; ++j) {
            db += x.dM[r * C + j] * x.M[r * C + j];
            x.dM[r * C + j] *= x.beta[r];
        }
        x.dbeta[r] += db;
    }
    __syncthreads();
    // The E-weighted terms of Aqk and M at (r, c): the row side Σ_j dX[r, j]·Kc[j]·E[r, j] (Rq from dAqk, Rk from dM)
    // and the column side Σ_m (dM[m, r]·Kc[m] + dAqk[m, r]·Q[m])·E[m, r] (Ck). E[r, r] = 1 terms go to dq and dk
    // only: through dG they would enter twice with opposite signs, and that rounding dominates dg under strong decay.
    // Outside r's diagonal row block the terms are products of whole blocks (E = a[r]·Bf_n0[j]): at s.bf16 they run on
    // tensor cores first, into buffers free by now (dQ: dAqk·Bk, dW: dM·Bk, dKb: Σ_m0 Bf_m0 ⊙ (dMᵀ·Ka + dAqkᵀ·Qa)).
    if (s.bf16) {
        const auto all = [](int64_t, int64_t) { return true; };
        for (int64_t e = tid; e < C * K; e += nt) x.dKb[e] = 0;
        for (int64_t n0 = kSub; n0 < C; n0 += kSub) {
            const T* bk = x.Bk + factor_row(n0) * K;
            const T* bf = x.Bf + factor_row(n0) * K;
            const int64_t rows = min(kSub, C - n0);
            block_tiles<T>(true, rows, K, n0, x.dAqk + n0 * C, C, int64_t(1), bk, K, int64_t(1), all,
                           [&](int64_t m, int64_t n, T acc) { x.dQ[(n0 + m) * K + n] = acc; });
            block_tiles<T>(true, rows, K, n0, x.dM + n0 * C, C, int64_t(1), bk, K, int64_t(1), all,
                           [&](int64_t m, int64_t n, T acc) { x.dW[(n0 + m) * K + n] = acc; });
            // the rows r < n0 of the column side, from row block n0's m
            const auto add = [&](int64_t m, int64_t n, T acc) { x.dKb[m * K + n] += bf[m * K + n] * acc; };
            block_tiles<T>(true, n0, K, rows, x.dM + n0 * C, int64_t(1), C, x.Ka + n0 * K, K, int64_t(1), all, add);
            block_tiles<T>(true, n0, K, rows, x.dAqk + n0 * C, int64_t(1), C, x.Qa + n0 * K, K, int64_t(1), all, add);
        }
        __syncthreads();
    }
    for (int64_t e = tid; e < C * K; e += nt) {
        const int64_t r = e / K, c = e % K, n0 = r / kSub * kSub;
        T rq = 0, rk = 0, ck = 0, f = 1;
        for (int64_t j = r - 1; j >= n0; --j) {
            f = flush_tiny(f * x.eg[(j + 1) * K + c]);
            const T kx = x.Kc[j * K + c] * f;
            rq += x.dAqk[r * C + j] * kx;
            rk += x.dM[r * C + j] * kx;
        }
        if (s.bf16) {
            if (n0 > 0) {
                rq += x.a[e] * x.dQ[e];
                rk += x.a[e] * x.dW[e];
            }
        } else if (n0 > 0) {
            const T* bk = x.Bk + factor_row(n0) * K + c;
            T sq = 0, sk = 0;
            for (int64_t j = 0; j < n0; ++j) {
                sq += x.dAqk[r * C + j] * bk[j * K];
                sk += x.dM[r * C + j] * bk[j * K];
            }
            rq += x.a[e] * sq;
            rk += x.a[e] * sk;
        }
        f = 1;
        for (int64_t m = r + 1; m < n0 + kSub; ++m) {
            f = flush_tiny(f * x.eg[m * K + c]);
            ck += (x.dM[m * C + r] * x.Kc[m * K + c] + x.dAqk[m * C + r] * x.Q[m * K + c]) * f;
        }
        if (s.bf16) ck += x.dKb[e];
        for (int64_t m0 = n0 + kSub; !s.bf16 && m0 < C; m0 += kSub) {
            T t = 0;
            for (int64_t m = m0; m < m0 + kSub; ++m)
                t += x.dM[m * C + r] * x.Ka[m * K + c] + x.dAqk[m * C + r] * x.Qa[m * K + c];
            ck += x.Bf[(factor_row(m0) + r) * K + c] * t;
        }
        const T diag = x.dAqk[r * C + r];
        x.dQ[e] = rq + diag * x.Kc[e];
        x.dK[e] += rk + ck + diag * x.Q[e];
        x.dG[e] += x.Kc[e] * (rk - ck) + x.Q[e] * rq;
    }
    __syncthreads();
    // through Qg = Q⊙e^G, Kend = Kc⊙e^(G[last] − G) and γ = e^G[last]; dg is the reverse cumsum of dG: a thread per
    // channel
    for (int64_t c = tid; c < K; c += nt) {
        T last = 0;
        for (int64_t r = 0; r < C; ++r) {
            const int64_t e = r * K + c;
            x.dQ[e] += x.dQg[e] * x.eG[e];
            x.dK[e] += x.dKend[e] * x.endfac[e];
            const T ke = x.dKend[e] * x.Kend[e];
            x.dG[e] += x.dQg[e] * x.Qg[e] - ke;
            last += ke;
        }
        T dg = 0;
        for (int64_t r = C - 1; r >= 0; --r) {
            const int64_t e = r * K + c;
            dg += x.dG[e] + (r == C - 1 ? last + x.dgamma[c] * x.gamma[c] : T(0));
            if (r >= at.rows) continue;
            const int64_t tok = at.t0 + r, qk = (tok * qk_heads + (qk_heads == s.HV ? at.i : at.h)) * K + c;
            if (gr.dq) gr.dq[qk] += T(s.scale) * x.dQ[e];
            if (gr.dk) gr.dk[qk] += x.dK[e];
            if (gr.dg) gr.dg[(tok * s.HV + at.i) * K + c] += dg;
        }
    }
    for (int64_t e = tid; e < at.rows * V; e += nt) {
        const int64_t r = e / V;
        if (gr.dv) gr.dv[((at.t0 + r) * s.HV + at.i) * V + e % V] += x.beta[r] * x.dVb[e];
    }
    for (int64_t r = tid; r < at.rows; r += nt)
        if (gr.dbeta) gr.dbeta[(at.t0 + r) * s.HV + at.i] += x.dbeta[r];
}

template <class F>
cudaError_t opt_in(F kernel, size_t smem) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
}

// The window's blocks: a per-chunk kernel (one block per chunk and value head) or a scan (a block per sequence,
// value head and column block; shared memory: a state column per thread).
struct Windows {
    KdaShape s;
    const KdaChunkGeometry& geo;
    unsigned chunk_blocks(int64_t c0, int64_t c1) const { return unsigned((c1 - c0) * s.HV); }
    dim3 scan_grid() const {
        return dim3(unsigned(geo.sequences * s.HV), unsigned((s.V + kScanColumns - 1) / kScanColumns));
    }
    template <class T>
    size_t scan_smem() const {
        return kda_chunk_scan_smem(s.K, s.V, sizeof(T));
    }
};

}  // namespace

int64_t kda_chunk_slot_elements(int64_t C, int64_t K, int64_t V, bool backward) {
    return slot_elements(C, K, V, backward);
}

size_t kda_chunk_scan_smem(int64_t K, int64_t, size_t elem) { return size_t(K * kScanColumns) * elem; }

template <class T>
cudaError_t launch_kda_chunk_forward(
    KdaShape s, const KdaChunkGeometry& geo, KdaTensors<T> in, T* o, T* ht, T* states, T* slots, cudaStream_t stream) {
    if (geo.sequences == 0 || s.HV == 0) return cudaSuccess;
    const Windows w{s, geo};
    cudaError_t err = opt_in(state_scan_kernel<T>, w.scan_smem<T>());
    for (int64_t c0 = 0; err == cudaSuccess && c0 < std::max<int64_t>(geo.total_chunks, 1); c0 += geo.window) {
        const int64_t c1 = std::min(geo.total_chunks, c0 + geo.window);
        if (c1 > c0)
            launch_kernel(prepare_kernel<T>, w.chunk_blocks(c0, c1), kChunkThreads, 0, stream, s, geo.seqs,
                          geo.chunk_seq, c0, in, static_cast<const T*>(nullptr), slots, false);
        launch_kernel(state_scan_kernel<T>, w.scan_grid(), kScanThreads, w.scan_smem<T>(), stream, s, geo.seqs, c0, c1,
                      in.h0, slots, states, ht, false);
        if (c1 > c0 && o)
            launch_kernel(output_kernel<T>, w.chunk_blocks(c0, c1), kChunkThreads, 0, stream, s, geo.seqs,
                          geo.chunk_seq, c0, slots, static_cast<const T*>(states), o);
        err = cudaGetLastError();
    }
    return err;
}

template <class T>
cudaError_t launch_kda_chunk_backward(KdaShape s,
                                      const KdaChunkGeometry& geo,
                                      KdaTensors<T> in,
                                      const T* dout,
                                      const T* dht,
                                      T* states,
                                      bool states_known,
                                      KdaGradPtrs<T> gr,
                                      int64_t qk_heads,
                                      T* slots,
                                      T* carry,
                                      cudaStream_t stream) {
    if (geo.sequences == 0 || s.HV == 0) return cudaSuccess;
    const Windows w{s, geo};
    const int64_t windows = std::max<int64_t>(1, (geo.total_chunks + geo.window - 1) / geo.window);
    cudaError_t err = opt_in(state_scan_kernel<T>, w.scan_smem<T>());
    if (err == cudaSuccess) err = opt_in(dstate_scan_kernel<T>, w.scan_smem<T>());
    // without the forward's states: a forward pass writes them (and, in one window, leaves its slots ready)
    for (int64_t c0 = 0; !states_known && err == cudaSuccess && c0 < geo.total_chunks; c0 += geo.window) {
        const int64_t c1 = std::min(geo.total_chunks, c0 + geo.window);
        launch_kernel(prepare_kernel<T>, w.chunk_blocks(c0, c1), kChunkThreads, 0, stream, s, geo.seqs, geo.chunk_seq,
                      c0, in, static_cast<const T*>(nullptr), slots, true);
        launch_kernel(state_scan_kernel<T>, w.scan_grid(), kScanThreads, w.scan_smem<T>(), stream, s, geo.seqs, c0, c1,
                      in.h0, slots, states, static_cast<T*>(nullptr), true);
        err = cudaGetLastError();
    }
    for (int64_t wi = windows - 1; err == cudaSuccess && wi >= 0; --wi) {
        const int64_t c0 = wi * geo.window, c1 = std::min(geo.total_chunks, c0 + geo.window);
        if (c1 > c0 && (states_known || windows > 1))
            launch_kernel(prepare_kernel<T>, w.chunk_blocks(c0, c1), kChunkThreads, 0, stream, s, geo.seqs,
                          geo.chunk_seq, c0, in, static_cast<const T*>(states), slots, true);
        launch_kernel(dstate_scan_kernel<T>, w.scan_grid(), kScanThreads, w.scan_smem<T>(), stream, s, geo.seqs, c0, c1,
                      dout, dht, slots, carry, gr.dh0);
        if (c1 > c0)
            launch_kernel(chunk_backward_kernel<T>, w.chunk_blocks(c0, c1), kChunkThreads, 0, stream, s, geo.seqs,
                          geo.chunk_seq, c0, slots, static_cast<const T*>(states), gr, qk_heads);
        err = cudaGetLastError();
    }
    return err;
}

#define TESSERA_KDA_CHUNK(T)                                                                                           \
    template cudaError_t launch_kda_chunk_forward<T>(KdaShape, const KdaChunkGeometry&, KdaTensors<T>, T*, T*, T*, T*, \
                                                     cudaStream_t);                                                    \
    template cudaError_t launch_kda_chunk_backward<T>(KdaShape, const KdaChunkGeometry&, KdaTensors<T>, const T*,      \
                                                      const T*, T*, bool, KdaGradPtrs<T>, int64_t, T*, T*,             \
                                                      cudaStream_t);
TESSERA_KDA_CHUNK(float)
TESSERA_KDA_CHUNK(double)
#undef TESSERA_KDA_CHUNK

}  // namespace tessera::ops::cuda
