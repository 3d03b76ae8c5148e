// The CUDA entry points of the MoE layer (ops/moe.h; the neutral entry points in ops/cpu/moe.cpp have checked shapes
// and devices). Routing bookkeeping runs on the host, on the router's choices read back (ops/moe_layout.h, the CPU's
// own code: both backends lay out the same rows), and the layout is copied to the device; the rows move by the kernels
// of moe.cu; each expert product over all experts is one grouped-batched cuBLAS GEMM (grouped_rows, grouped_wgrad)
// on the expert offsets' host copy (MoeSaved::offsets_host, kept by the layer; read back where there is none; frozen
// experts held narrow: one per window of experts widened to f32). The routing's read-backs (scores, choices, bias,
// the capacity's experts), each waiting for the stream, happen once per forward; the expert passes wait for nothing.
// (The experts' adapters go to this backend's LoRA entry points directly: the layer declared their shapes.)
#include <algorithm>
#include <array>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"
#include "ops/moe_layout.h"

namespace tessera::ops::cuda {

namespace {
// The routing read back to the host: grow-only buffers of the calling thread, so a step allocates nothing here after
// its first call
struct HostRouting {
    std::vector<std::byte> scores, bias;
    std::vector<int32_t> choice, expert, order, load, row, counts, offsets;
};
HostRouting& host() {
    thread_local HostRouting h;
    return h;
}

template <class T>
T* fetch(std::vector<T>& to, const void* device, size_t n) {
    if (to.size() < n) to.resize(n);
    copy_bytes(to.data(), Device::cpu, device, Device::cuda, n * sizeof(T));
    return to.data();
}
template <class T>
const T* fetch_bytes(std::vector<std::byte>& to, const void* device, size_t n) {
    return reinterpret_cast<const T*>(fetch(to, device, n * sizeof(T)));
}
template <class T>
void put(void* device, const T* src, size_t n) {
    copy_bytes(device, Device::cuda, src, Device::cpu, n * sizeof(T));
}

// The expert offsets on the host: the layout's host copy, else read back (one synchronisation)
ExpertRows expert_rows(const MoeSaved& s) {
    const int64_t E = s.counts.size(0);
    if (s.offsets_host) return {s.offsets_host, E};
    return {fetch(host().offsets, s.offsets.data, size_t(E + 1)), E};
}

bool situ(const MoeParams& p) { return p.activation == ExpertActivation::situ; }

// The M-grouped product C[rows_e] = A[rows_e]·op(w_e) + beta·C over the experts, w [E, ...] stored in T, or frozen
// experts held narrow (bf16, MXFP4) with f32 rows: then windows of consecutive experts whose weights, widened to f32,
// fit kWidenBytes of the thread's scratch, one grouped GEMM each (a window without rows is skipped). At
// GemmPrecision::bf16 bf16 experts are read in place (one grouped GEMM) and MXFP4 ones dequantized to bf16 in the same
// windows. Each expert's product is the one on its widened f32 weight, as on the CPU (ops/grouped_gemm.h).
template <class T>
void expert_gemm(Trans tb,
                 const ExpertRows& g,
                 int64_t N,
                 int64_t K,
                 GroupOperand A,
                 int64_t lda,
                 const TensorView& w,
                 int64_t ldb,
                 T beta,
                 T* C,
                 int64_t ldc) {
    const int64_t stride = w.numel() / std::max<int64_t>(1, w.size(0));  // one expert's values
    const bool bf16 = std::is_same_v<T, float> && gemm_precision() == GemmPrecision::bf16;
    if (w.dtype == dtype_of<T>())
        return grouped_rows<T>(tb, g, N, K, T(1), A, lda, w.ptr<T>(), stride, ldb, beta, C, ldc);
    if (bf16 && w.dtype == DType::bf16)
        return grouped_rows<T>(tb, g, N, K, T(1), A, lda, held_weight(w, "moe: the experts"), stride, ldb, beta, C, ldc,
                               DType::bf16);
    if constexpr (std::is_same_v<T, float>) {
        const int64_t per = std::max<int64_t>(1, kWidenBytes / (4 * std::max<int64_t>(1, stride)));
        const DType to = bf16 ? DType::bf16 : DType::f32;
        void* wide = nullptr;
        for (int64_t e0 = 0; e0 < g.experts; e0 += per) {
            const int64_t n = std::min(per, g.experts - e0);
            if (g.offsets[e0 + n] == g.offsets[e0]) continue;
            if (!wide) wide = scratch(dtype_bytes(to, std::min(per, g.experts) * stride));
            widen(w, e0 * stride, n * stride, to, wide, "moe: widen the experts");
            grouped_rows<float>(tb, ExpertRows{g.offsets + e0, n}, N, K, 1.f, A, lda, wide, stride, ldb, beta, C, ldc,
                                to);
        }
    } else {
        TESSERA_FAIL("moe: experts held in {} run with f32 rows, not {}", dtype_name(w.dtype),
                     dtype_name(dtype_of<T>()));
    }
}

// At GemmPrecision::bf16 (T = float): x's first `count` values (rows of the experts' products) rounded to bf16 once,
// into the thread's buffer `slot`, for the several grouped GEMMs that read them (each would round its operands into
// copies of its own: the same values, per call); else x as it is. A slot holds one tensor at a time.
template <class T>
GroupOperand rounded_once(const T* x, int64_t count, int slot) {
    if constexpr (std::is_same_v<T, float>) {
        if (gemm_precision() == GemmPrecision::bf16 && count > 0) {
            thread_local std::array<GrowBuffer, 3> buffers;
            auto* dst = static_cast<uint16_t*>(buffers[size_t(slot)].reserve(2 * size_t(count)));
            check_launch(launch_narrow_bf16(x, count, dst, stream()), "moe: expert rows to bf16");
            return {dst, DType::bf16};
        }
    }
    return x;
}

void expert_lora_forward(
    const MoeParams& p, const ExpertRows& g, const LoraPair& l, TensorView x, TensorView y, const MoeScratch& t) {
    if (l.a.defined()) cuda::lora_grouped_forward(p.lora, g, x, l.a, l.b, t.lora_u, y);
}
void expert_lora_backward(const MoeParams& p,
                          const ExpertRows& g,
                          const LoraPair& l,
                          const LoraPair& gl,
                          TensorView x,
                          TensorView dy,
                          TensorView dx,
                          const MoeScratch& t) {
    if (l.a.defined()) cuda::lora_grouped_backward(p.lora, g, x, dy, l.a, l.b, t.lora_u, t.lora_du, dx, gl.a, gl.b);
}
}  // namespace

std::pair<int64_t, int64_t> moe_apply_capacity(
    const MoeParams& p, const MoeSaved& s, int64_t N, int64_t uniform, TensorView bias, const int64_t* share) {
    HostRouting& h = host();
    const int64_t E = s.scores.size(1), K = s.choice.size(1);
    std::pair<int64_t, int64_t> r;
    dispatch_float(s.scores.dtype, "moe", [&]<class T>(T) {
        const T* S = fetch_bytes<T>(h.scores, s.scores.data, size_t(N * E));
        const T* b = bias.defined() ? fetch_bytes<T>(h.bias, bias.data, size_t(E)) : nullptr;
        const int32_t* choice = fetch(h.choice, s.choice.data, size_t(N * K));
        h.expert.resize(std::max(h.expert.size(), size_t(N * K)));
        h.order.resize(std::max(h.order.size(), size_t(N * K)));
        h.load.resize(std::max(h.load.size(), size_t(E)));
        r = moe_capacity_rows<T>(p, N, E, K, uniform, S, choice, b, share, h.expert.data(), h.order.data(),
                                 h.load.data());
        put(s.expert.data, h.expert.data(), size_t(N * K));
    });
    return r;
}

void moe_build_layout(const MoeSaved& s, int64_t tokens) {
    static_assert(kMoeRowAlign == 1, "the CUDA dispatch writes no padding rows");
    HostRouting& h = host();
    const int64_t E = s.counts.size(0), K = s.expert.size(1), pairs = tokens * K;
    const int32_t* expert = fetch(h.expert, s.expert.data, size_t(pairs));
    h.row.resize(std::max(h.row.size(), size_t(pairs)));
    h.counts.resize(std::max(h.counts.size(), size_t(E)));
    h.offsets.resize(std::max(h.offsets.size(), size_t(E + 1)));
    moe_layout_rows(tokens, K, E, expert, h.row.data(), h.counts.data(), h.offsets.data());
    put(s.row.data, h.row.data(), size_t(pairs));
    put(s.counts.data, h.counts.data(), size_t(E));
    put(s.offsets.data, h.offsets.data(), size_t(E + 1));
    if (s.offsets_host) std::copy_n(h.offsets.data(), E + 1, s.offsets_host);
    dispatch_float(s.gates.dtype, "moe", [&]<class T>(T) {
        check_launch(launch_moe_row_gate<T>(s.row.ptr<int32_t>(), s.gates.ptr<T>(), pairs, s.row_gate.ptr<T>(),
                                            h.offsets[size_t(E)], stream()),
                     "moe layout");
    });
}

void moe_dispatch(const MoeSaved& s, TensorView src, TensorView rows) {
    dispatch_float(src.dtype, "moe dispatch", [&]<class T>(T) {
        check_launch(launch_moe_dispatch<T>(carg<T>(src, "moe dispatch: src"), s.row.ptr<int32_t>(), s.row.size(1),
                                            rows.ptr<T>(), stream()),
                     "moe dispatch");
    });
}

void moe_combine(const MoeSaved& s, TensorView rows, TensorView dst, bool accumulate) {
    dispatch_float(dst.dtype, "moe combine", [&]<class T>(T) {
        check_launch(launch_moe_combine<T>(rows.ptr<T>(), s.row.ptr<int32_t>(), s.row.size(1),
                                           marg<T>(dst, "moe combine: dst"), accumulate, stream()),
                     "moe combine");
    });
}

void moe_experts_forward(const MoeParams& p, const MoeWeights& w, const MoeSaved& s, const MoeScratch& t) {
    const ExpertRows g = expert_rows(s);
    const int64_t R = g.offsets[g.experts], F = w.w_gate.size(1), L = w.w_gate.size(2);
    dispatch_float(s.xe.dtype, "moe", [&]<class T>(T) {
        const GroupOperand xe = rounded_once(s.xe.ptr<T>(), R * L, 0);  // (read by two products)
        T *h = s.h.ptr<T>(), *a = s.a.ptr<T>();
        expert_gemm<T>(Trans::T, g, F, L, xe, L, w.w_gate, L, T(0), h, 2 * F);
        expert_gemm<T>(Trans::T, g, F, L, xe, L, w.w_up, L, T(0), h + F, 2 * F);
        const TensorView xr = s.xe.slice0(0, R), hr = s.h.slice0(0, R);
        expert_lora_forward(p, g, w.lora.w_gate, xr, hr.columns(0, F), t);
        expert_lora_forward(p, g, w.lora.w_up, xr, hr.columns(F, F), t);
        check_launch(launch_moe_gated_act<T>(situ(p), p.situ.beta, p.situ.linear_beta, h, s.row_gate.ptr<T>(), a, R, F,
                                             stream()),
                     "moe experts");
        expert_gemm<T>(Trans::T, g, L, F, a, F, w.w_down, F, T(0), t.ye.ptr<T>(), L);
        expert_lora_forward(p, g, w.lora.w_down, s.a.slice0(0, R), t.ye.slice0(0, R), t);
    });
}

void moe_experts_backward(
    const MoeParams& p, const MoeWeights& w, const MoeWeights& gw, const MoeSaved& s, const MoeScratch& t) {
    const ExpertRows g = expert_rows(s);
    const int64_t R = g.offsets[g.experts], F = w.w_gate.size(1), L = w.w_gate.size(2);
    dispatch_float(s.xe.dtype, "moe", [&]<class T>(T) {
        // at bf16, dye, dh and xe rounded once each for the products that read them (two, four, two)
        const GroupOperand dye = rounded_once(t.ye.ptr<T>(), R * L, 0);
        T *da = t.da.ptr<T>(), *dh = t.dh.ptr<T>(), *dxe = t.dxe.ptr<T>();
        expert_gemm<T>(Trans::N, g, F, L, dye, L, w.w_down, F, T(0), da, F);
        if (gw.w_down.defined())  // absent: frozen experts
            grouped_wgrad<T>(g, L, F, dye, L, s.a.ptr<T>(), F, gw.w_down.ptr<T>(), L * F, F);
        expert_lora_backward(p, g, w.lora.w_down, gw.lora.w_down, s.a.slice0(0, R), t.ye.slice0(0, R),
                             t.da.slice0(0, R), t);
        check_launch(launch_moe_gated_act_backward<T>(situ(p), p.situ.beta, p.situ.linear_beta, s.h.ptr<T>(), da,
                                                      s.row_gate.ptr<T>(), t.row_dot.ptr<T>(), dh, R, F, stream()),
                     "moe experts backward");
        const GroupOperand dh16 = rounded_once(static_cast<const T*>(dh), R * 2 * F, 1);
        expert_gemm<T>(Trans::N, g, L, F, dh16, 2 * F, w.w_gate, L, T(0), dxe, L);
        expert_gemm<T>(Trans::N, g, L, F, dh16.at(F), 2 * F, w.w_up, L, T(1), dxe, L);
        if (gw.w_gate.defined() || gw.w_up.defined()) {
            const GroupOperand xe = rounded_once(s.xe.ptr<T>(), R * L, 2);
            if (gw.w_gate.defined()) grouped_wgrad<T>(g, F, L, dh16, 2 * F, xe, L, gw.w_gate.ptr<T>(), F * L, L);
            if (gw.w_up.defined()) grouped_wgrad<T>(g, F, L, dh16.at(F), 2 * F, xe, L, gw.w_up.ptr<T>(), F * L, L);
        }
        const TensorView xr = s.xe.slice0(0, R), dhr = t.dh.slice0(0, R), dxr = t.dxe.slice0(0, R);
        expert_lora_backward(p, g, w.lora.w_gate, gw.lora.w_gate, xr, dhr.columns(0, F), dxr, t);
        expert_lora_backward(p, g, w.lora.w_up, gw.lora.w_up, xr, dhr.columns(F, F), dxr, t);
    });
}

void moe_gate_grads(const MoeSaved& s, TensorView row_dot, TensorView dg, int64_t N) {
    dispatch_float(dg.dtype, "moe", [&]<class T>(T) {
        check_launch(
            launch_moe_gate_grads<T>(s.row.ptr<int32_t>(), row_dot.ptr<T>(), dg.ptr<T>(), N * s.row.size(1), stream()),
            "moe gate gradients");
    });
}

void moe_shared_scale_forward(TensorView ss, TensorView sa) {
    dispatch_float(sa.dtype, "moe", [&]<class T>(T) {
        check_launch(launch_moe_shared_scale_forward<T>(ss.ptr<T>(), sa.ptr<T>(), sa.size(0), sa.size(1), stream()),
                     "moe shared expert gate");
    });
}

void moe_shared_scale_backward(TensorView ss, TensorView sa, TensorView dsa, TensorView du) {
    dispatch_float(sa.dtype, "moe", [&]<class T>(T) {
        check_launch(launch_moe_shared_scale_backward<T>(ss.ptr<T>(), sa.ptr<T>(), dsa.ptr<T>(), du.ptr<T>(),
                                                         sa.size(0), sa.size(1), stream()),
                     "moe shared expert gate backward");
    });
}

double routing_entropy_sum(TensorView scores) {
    double sum = 0;
    dispatch_float(scores.dtype, "routing entropy", [&]<class T>(T) {
        const RowsArg<const T> S = carg<T>(scores, "routing entropy: scores");
        auto* per_token = static_cast<double*>(scratch(8 * size_t(S.rows)));
        check_launch(launch_routing_entropy<T>(S, per_token, stream()), "routing entropy");
        for (const double h : download(per_token, size_t(S.rows))) sum += h;  // token order, as the CPU adds them
    });
    return sum;
}

}  // namespace tessera::ops::cuda
