// KDA on CUDA (ops/kda.h): the gated delta rule as a fused token recurrence, in the spirit of fla's
// fused_recurrent kernels. The recurrence of one (sequence, value head) runs in one block; thread j owns column j
// of the state S [K, V] (in shared memory), since every step of the forward is column-local:
//   S ← Diag(e^g)·S;  u_j = v_j − Σ_c k_c·S[c, j];  S[:, j] += β·k·u_j;  o_j = Σ_c scale·q_c·S[c, j].
// The forward splits the columns over blocks as well. Backward (BPTT, the CPU's recurrent_backward) walks the
// chunks of a sequence in reverse: it recomputes the chunk's states from the state entering it (the forward's saved
// states, or checkpoints a forward pass writes to scratch) and then the tokens in reverse. dq, dk, dg and dβ are
// sums over the columns: each warp sums its 32 columns by a butterfly reduce-scatter of 32 rows at a time (lane l
// ends with row l's sum), the warps' sums are added in warp order. Every sum has one order: bitwise run-to-run.
//
// This is mode recurrent (mode chunk: ops/cuda/kda_chunk.cu); exp(g) is taken in double as on the CPU.
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {

// One butterfly step: lanes with bit O set keep the upper O values, the others the lower, each adding its
// partner's copy of the half it keeps.
template <int O, class T>
__device__ inline void scatter_step(T (&x)[32], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const T send = up ? x[i] : x[i + O], keep = up ? x[i + O] : x[i];
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

// x[0..32) of each lane → the sum over the warp's lanes of x[lane]; fixed tree, every lane takes part.
template <class T>
__device__ inline T reduce_scatter32(T (&x)[32]) {
    const int lane = threadIdx.x & 31;
    scatter_step<16>(x, lane);
    scatter_step<8>(x, lane);
    scatter_step<4>(x, lane);
    scatter_step<2>(x, lane);
    scatter_step<1>(x, lane);
    return x[0];
}

template <class T>
__global__ void forward_kernel(KdaShape s, const KdaSeq* seqs, KdaTensors<T> in, T* o, T* ht, T* saved) {
    unsigned char* smem_raw = dynamic_shared();
    const int64_t nt = blockDim.x, K = s.K, V = s.V, tid = threadIdx.x;
    T* S = reinterpret_cast<T*>(smem_raw);  // [K][nt]: column tid of this block's slice
    T* qs = S + K * nt;
    T* ks = qs + K;
    T* as = ks + K;
    T* bs = as + K;  // β
    const int64_t unit = blockIdx.x, seq = unit / s.HV, i = unit % s.HV, h = i / (s.HV / s.H);
    const int64_t j = blockIdx.y * nt + tid;
    const bool valid = j < V;
    const KdaSeq sq = seqs[seq];
    const T scale = T(s.scale);
    for (int64_t c = 0; c < K; ++c) S[c * nt + tid] = valid && in.h0 ? in.h0[((unit * K) + c) * V + j] : T(0);
    for (int64_t t = 0; t < sq.len; ++t) {
        const int64_t tok = sq.first + t;
        if (saved && t % s.C == 0 && valid) {
            T* dst = saved + ((sq.chunk0 + t / s.C) * s.HV + i) * K * V + j;
            for (int64_t c = 0; c < K; ++c) dst[c * V] = S[c * nt + tid];
        }
        __syncthreads();  // the previous token's vectors are consumed
        for (int64_t c = tid; c < K; c += nt) {
            qs[c] = scale * in.q[(tok * s.H + h) * K + c];
            ks[c] = in.k[(tok * s.H + h) * K + c];
            as[c] = T(exp(double(in.g[(tok * s.HV + i) * K + c])));
        }
        if (tid == 0) bs[0] = in.beta[tok * s.HV + i];
        __syncthreads();
        if (!valid) continue;
        T acc = 0;
        for (int64_t c = 0; c < K; ++c) {
            const T x = S[c * nt + tid] * as[c];
            S[c * nt + tid] = x;
            acc += ks[c] * x;
        }
        const T u = bs[0] * (in.v[(tok * s.HV + i) * V + j] - acc);
        T out = 0;
        for (int64_t c = 0; c < K; ++c) {
            const T x = S[c * nt + tid] + ks[c] * u;
            S[c * nt + tid] = x;
            out += qs[c] * x;
        }
        if (o) o[(tok * s.HV + i) * V + j] = out;
    }
    if (ht && valid)
        for (int64_t c = 0; c < K; ++c) ht[(unit * K + c) * V + j] = S[c * nt + tid];
}

// BPTT of one (sequence, value head) per block, thread j = column j (blockDim = V rounded up to 32).
template <class T>
__global__ void __launch_bounds__(kKdaBackwardMaxV) backward_kernel(KdaShape s,
                                                                    const KdaSeq* seqs,
                                                                    KdaTensors<T> in,
                                                                    const T* dout,
                                                                    const T* dht,
                                                                    const T* ckpt,
                                                                    T* states,
                                                                    KdaGradPtrs<T> gr) {
    unsigned char* smem_raw = dynamic_shared();
    const int64_t nt = blockDim.x, K = s.K, V = s.V, tid = threadIdx.x, KP = (K + 31) / 32 * 32;
    const int64_t warps = nt / 32, warp = tid / 32, lane = tid % 32;
    T* dS = reinterpret_cast<T*>(smem_raw);  // [K][nt]
    T* qs = dS + K * nt;
    T* ks = qs + K;
    T* as = ks + K;
    T* W = as + K;                // [4][warps][KP]: each warp's column sums
    T* red = W + 4 * warps * KP;  // [K]: k_c·Σ_j dS·u for dβ
    T* bs = red + K;
    const int64_t unit = blockIdx.x, seq = unit / s.HV, i = unit % s.HV, G = s.HV / s.H, h = i / G;
    const int64_t j = tid;
    const bool valid = j < V;
    const KdaSeq sq = seqs[seq];
    const T scale = T(s.scale);
    T* St = states + unit * ((s.C + 1) * K * V + s.C * V);  // the chunk's states: slot τ enters token τ
    T* Ut = St + (s.C + 1) * K * V;                         // then each token's u = v − S'ᵀk, [C, V]
    // dq, dk rows: per value head (summed over the group afterwards) when G > 1
    const int64_t qk_heads = G > 1 ? s.HV : s.H, qk_head = G > 1 ? i : h;
    for (int64_t c = 0; c < K; ++c) dS[c * nt + tid] = valid && dht ? dht[(unit * K + c) * V + j] : T(0);
    const int64_t chunks = (sq.len + s.C - 1) / s.C;
    for (int64_t ci = chunks - 1; ci >= 0; --ci) {
        const int64_t t0 = ci * s.C, n = min(s.C, sq.len - t0);
        if (valid) {
            const T* src = ckpt + ((sq.chunk0 + ci) * s.HV + i) * K * V + j;
            for (int64_t c = 0; c < K; ++c) St[c * V + j] = src[c * V];
        }
        for (int64_t tau = 0; tau < n; ++tau) {  // the chunk's states, as the CPU's backward recomputes them
            const int64_t tok = sq.first + t0 + tau;
            __syncthreads();
            for (int64_t c = tid; c < K; c += nt) {
                ks[c] = in.k[(tok * s.H + h) * K + c];
                as[c] = T(exp(double(in.g[(tok * s.HV + i) * K + c])));
            }
            if (tid == 0) bs[0] = in.beta[tok * s.HV + i];
            __syncthreads();
            if (!valid) continue;
            const T* Sp = St + tau * K * V + j;
            T* Sn = St + (tau + 1) * K * V + j;
            T acc = 0;
            for (int64_t c = 0; c < K; ++c) acc += ks[c] * (as[c] * Sp[c * V]);
            const T u = in.v[(tok * s.HV + i) * V + j] - acc;
            Ut[tau * V + j] = u;
            for (int64_t c = 0; c < K; ++c) Sn[c * V] = as[c] * Sp[c * V] + bs[0] * ks[c] * u;
        }
        for (int64_t tau = n - 1; tau >= 0; --tau) {
            const int64_t tok = sq.first + t0 + tau;
            __syncthreads();
            for (int64_t c = tid; c < K; c += nt) {
                qs[c] = in.q[(tok * s.H + h) * K + c];
                ks[c] = in.k[(tok * s.H + h) * K + c];
                as[c] = T(exp(double(in.g[(tok * s.HV + i) * K + c])));
            }
            if (tid == 0) bs[0] = in.beta[tok * s.HV + i];
            __syncthreads();
            const T b = bs[0];
            const T* Sprev = St + tau * K * V + j;
            const T* Scur = St + (tau + 1) * K * V + j;
            const T go = valid && dout ? dout[(tok * s.HV + i) * V + j] : T(0);
            const T u = valid ? Ut[tau * V + j] : T(0);
            // pass 1: dS += scale·q·dO; the column parts of Σ_j S·dO (dq) and Σ_j dS·u (dk, dβ); du
            T du = 0;
            for (int64_t cb = 0; cb < KP; cb += 32) {
                T x1[32], x2[32];
#pragma unroll
                for (int l = 0; l < 32; ++l) {
                    const int64_t c = cb + l;
                    x1[l] = x2[l] = 0;
                    if (valid && c < K) {
                        T d = dS[c * nt + tid];
                        if (dout) {
                            x1[l] = Scur[c * V] * go;
                            d += scale * qs[c] * go;
                            dS[c * nt + tid] = d;
                        }
                        x2[l] = d * u;
                        du += b * d * ks[c];
                    }
                }
                const T r1 = reduce_scatter32(x1), r2 = reduce_scatter32(x2);
                W[(0 * warps + warp) * KP + cb + lane] = r1;
                W[(1 * warps + warp) * KP + cb + lane] = r2;
            }
            if (valid && gr.dv) gr.dv[(tok * s.HV + i) * V + j] += du;
            // pass 2: S' = Diag(e^g)·S_prev: Σ_j S'·du (dk) and Σ_j dS'·S' (dg); dS ← Diag(e^g)·dS'
            for (int64_t cb = 0; cb < KP; cb += 32) {
                T x3[32], x4[32];
#pragma unroll
                for (int l = 0; l < 32; ++l) {
                    const int64_t c = cb + l;
                    x3[l] = x4[l] = 0;
                    if (valid && c < K) {
                        const T sp = as[c] * Sprev[c * V];
                        const T dsp = dS[c * nt + tid] - ks[c] * du;
                        x3[l] = sp * du;
                        x4[l] = dsp * sp;
                        dS[c * nt + tid] = as[c] * dsp;
                    }
                }
                const T r3 = reduce_scatter32(x3), r4 = reduce_scatter32(x4);
                W[(2 * warps + warp) * KP + cb + lane] = r3;
                W[(3 * warps + warp) * KP + cb + lane] = r4;
            }
            __syncthreads();
            for (int64_t c = tid; c < K; c += nt) {
                T sum[4] = {0, 0, 0, 0};
                for (int p = 0; p < 4; ++p)
                    for (int64_t w = 0; w < warps; ++w) sum[p] += W[(p * warps + w) * KP + c];
                const int64_t row = (tok * qk_heads + qk_head) * K + c;
                if (gr.dq && dout) gr.dq[row] += scale * sum[0];
                if (gr.dk) {
                    T x = gr.dk[row] + b * sum[1];
                    gr.dk[row] = x - sum[2];
                }
                if (gr.dg) gr.dg[(tok * s.HV + i) * K + c] += sum[3];
                red[c] = ks[c] * sum[1];
            }
            __syncthreads();
            if (tid == 0 && gr.dbeta) {
                T db = 0;
                for (int64_t c = 0; c < K; ++c) db += red[c];
                gr.dbeta[tok * s.HV + i] += db;
            }
        }
    }
    if (valid && gr.dh0)
        for (int64_t c = 0; c < K; ++c) gr.dh0[(unit * K + c) * V + j] += dS[c * nt + tid];
}

template <class T>
__global__ void reduce_heads_kernel(int64_t tokens, int64_t H, int64_t G, int64_t K, const T* src, T* dst) {
    const int64_t total = tokens * H * K;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t c = e % K, h = (e / K) % H, t = e / (K * H);
        T acc = dst[e];
        for (int64_t i = h * G; i < (h + 1) * G; ++i) acc += src[(t * H * G + i) * K + c];
        dst[e] = acc;
    }
}

int forward_threads(int64_t V) { return V <= 32 ? 32 : 64; }
int backward_threads(int64_t V) { return int((V + 31) / 32 * 32); }

template <class K>
cudaError_t opt_in(K kernel, size_t smem) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
}
}  // namespace

size_t kda_forward_smem(int64_t K, int64_t V, size_t elem) { return size_t(K * forward_threads(V) + 3 * K + 1) * elem; }
size_t kda_backward_smem(int64_t K, int64_t V, size_t elem) {
    const int64_t nt = backward_threads(V), KP = (K + 31) / 32 * 32;
    return size_t(K * nt + 3 * K + 4 * (nt / 32) * KP + K + 1) * elem;
}

template <class T>
cudaError_t launch_kda_forward(
    KdaShape s, const KdaSeq* seqs, int64_t units, KdaTensors<T> in, T* o, T* ht, T* saved, cudaStream_t stream) {
    if (units == 0) return cudaSuccess;
    const int nt = forward_threads(s.V);
    const size_t smem = kda_forward_smem(s.K, s.V, sizeof(T));
    cudaError_t err = opt_in(forward_kernel<T>, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid(unsigned(units), unsigned((s.V + nt - 1) / nt));
    launch_kernel(forward_kernel<T>, grid, nt, smem, stream, s, seqs, in, o, ht, saved);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_kda_backward(KdaShape s,
                                const KdaSeq* seqs,
                                int64_t units,
                                KdaTensors<T> in,
                                const T* dout,
                                const T* dht,
                                const T* ckpt,
                                T* states,
                                KdaGradPtrs<T> gr,
                                cudaStream_t stream) {
    if (units == 0) return cudaSuccess;
    const size_t smem = kda_backward_smem(s.K, s.V, sizeof(T));
    const cudaError_t err = opt_in(backward_kernel<T>, smem);
    if (err != cudaSuccess) return err;
    launch_kernel(backward_kernel<T>, unsigned(units), backward_threads(s.V), smem, stream, s, seqs, in, dout, dht,
                  ckpt, states, gr);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_kda_sum_value_heads(
    int64_t tokens, int64_t H, int64_t G, int64_t K, const T* src, T* dst, cudaStream_t stream) {
    const int64_t n = tokens * H * K;
    if (n == 0) return cudaSuccess;
    launch_kernel(reduce_heads_kernel<T>, grid_for(n), kBlock, 0, stream, tokens, H, G, K, src, dst);
    return cudaGetLastError();
}

#define TESSERA_KDA(T)                                                                                               \
    template cudaError_t launch_kda_forward<T>(KdaShape, const KdaSeq*, int64_t, KdaTensors<T>, T*, T*, T*,          \
                                               cudaStream_t);                                                        \
    template cudaError_t launch_kda_backward<T>(KdaShape, const KdaSeq*, int64_t, KdaTensors<T>, const T*, const T*, \
                                                const T*, T*, KdaGradPtrs<T>, cudaStream_t);                         \
    template cudaError_t launch_kda_sum_value_heads<T>(int64_t, int64_t, int64_t, int64_t, const T*, T*, cudaStream_t);
TESSERA_KDA(float)
TESSERA_KDA(double)
#undef TESSERA_KDA

}  // namespace tessera::ops::cuda
