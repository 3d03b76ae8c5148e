// The CUDA entry points of the KDA block's ops: the KDA recurrence, L2 norm, gated RMSNorm, the forget gate and the
// causal conv1d (training and the decoding step). The neutral entry points (ops/cpu/*.cpp) have checked shapes, dtypes
// and cu_seqlens already.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"
#include "ops/gemm.h"

namespace tessera::ops::cuda {

namespace {

// The geometry of a KDA call and its sequence table (host), as ops/cuda/kda.cu and kda_chunk.cu take them.
struct KdaCall {
    KdaShape s{};
    int64_t tokens = 0, units = 0, total_chunks = 0;
    std::vector<KdaSeq> seqs;
    std::vector<int64_t> chunk_seq;  // each global chunk's sequence
};

KdaCall kda_call(const KdaParams& p, const KdaInputs& in, size_t elem, bool backward) {
    KdaCall c;
    const int64_t B = in.q.size(0), T = in.q.size(1), K = in.q.size(3), V = in.v.size(3), C = p.chunk_size;
    c.s = {in.q.size(2), in.v.size(2), K, V, C, p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(K))};
    // at train.precision = bf16 the chunked algorithm's block products (GEMMs of the chunk's tiles) run on tensor cores
    c.s.bf16 = p.mode == KdaMode::chunk && in.q.dtype == DType::f32 && gemm_precision() == GemmPrecision::bf16;
    c.tokens = B * T;
    auto add = [&](int64_t first, int64_t len) {
        c.seqs.push_back({first, len, c.total_chunks});
        c.total_chunks += (len + C - 1) / C;
        c.chunk_seq.resize(size_t(c.total_chunks), int64_t(c.seqs.size()) - 1);
    };
    const auto& cu = in.cu_seqlens;
    if (cu.empty()) {
        for (int64_t b = 0; b < B; ++b) add(b * T, T);
    } else {
        for (size_t i = 0; i + 1 < cu.size(); ++i) add(cu[i], cu[i + 1] - cu[i]);
    }
    c.units = int64_t(c.seqs.size()) * c.s.HV;
    const size_t limit = max_shared_memory();
    const bool chunked = p.mode == KdaMode::chunk;
    const size_t need = chunked    ? kda_chunk_scan_smem(K, V, elem)
                        : backward ? kda_backward_smem(K, V, elem)
                                   : kda_forward_smem(K, V, elem);
    TESSERA_CHECK(chunked || !backward || V <= kKdaBackwardMaxV,
                  "kda (CUDA): recurrent backward supports value head dims up to {}, not {}", kKdaBackwardMaxV, V);
    TESSERA_CHECK(need <= limit,
                  "kda (CUDA): K = {}, V = {} need {} bytes of shared memory per block; the device allows {}", K, V,
                  need, limit);
    return c;
}

template <class T>
KdaTensors<T> kda_tensors(const KdaInputs& in) {
    return {in.q.ptr<T>(), in.k.ptr<T>(),    in.v.ptr<T>(),
            in.g.ptr<T>(), in.beta.ptr<T>(), in.h0.defined() ? in.h0.ptr<T>() : nullptr};
}

// Device memory the chunked algorithm's chunk slots may take: TESSERA_KDA_CHUNK_SCRATCH_MB, 1024 by default. More
// chunks in flight at once keep more of the GPU busy; fewer bound the scratch (docs/ops.md).
size_t chunk_scratch_budget() {
    const char* mb = std::getenv("TESSERA_KDA_CHUNK_SCRATCH_MB");
    char* end = nullptr;
    const long long v = mb ? std::strtoll(mb, &end, 10) : 0;
    TESSERA_CHECK(!mb || (end != mb && *end == '\0' && v > 0),
                  "TESSERA_KDA_CHUNK_SCRATCH_MB: '{}' is not a positive whole number of MiB", mb ? mb : "");
    return size_t(mb ? v : 1024) << 20;
}

// The device layout of a chunked call: the sequence and chunk tables, the chunks in flight at once, and the offsets of
// the scratch request's parts: states entering every chunk (unless the caller keeps them), the window's slots, and for
// backward dS carried between windows and GVA's per-value-head dq, dk.
struct ChunkPlan {
    int64_t window = 1;
    size_t seqs = 0, chunk_seq = 0, states = 0, slots = 0, carry = 0, dqv = 0, dkv = 0, total = 0;
};

ChunkPlan chunk_plan(const KdaCall& c, size_t elem, bool backward, bool states_given) {
    ChunkPlan pl;
    const KdaShape& s = c.s;
    const size_t slot_bytes = elem * size_t(kda_chunk_slot_elements(s.C, s.K, s.V, backward) * s.HV);
    pl.window = std::max<int64_t>(1, std::min<int64_t>(c.total_chunks, int64_t(chunk_scratch_budget() / slot_bytes)));
    const size_t KV = size_t(s.K * s.V), qk = c.s.HV > c.s.H ? elem * size_t(c.tokens * s.HV * s.K) : 0;
    const size_t sizes[] = {sizeof(KdaSeq) * c.seqs.size(),
                            sizeof(int64_t) * c.chunk_seq.size(),
                            states_given ? 0 : elem * size_t(c.total_chunks * s.HV) * KV,
                            slot_bytes * size_t(pl.window),
                            backward ? elem * size_t(c.units) * KV : 0,
                            backward ? qk : 0,
                            backward ? qk : 0};
    size_t* const parts[] = {&pl.seqs, &pl.chunk_seq, &pl.states, &pl.slots, &pl.carry, &pl.dqv, &pl.dkv};
    for (size_t k = 0; k < std::size(parts); ++k) {
        *parts[k] = pl.total;
        pl.total += scratch_part(sizes[k]);
    }
    return pl;
}

// GVA's dq, dk go per value head first ([tokens, HV, K], zeroed here): gr with them in place of dq and dk. Then
// sum_value_heads adds each group's heads, in order, into dq and dk.
template <class T>
KdaGradPtrs<T> per_value_head(const KdaCall& c, KdaGradPtrs<T> gr, T* dqv, T* dkv) {
    if (c.s.HV == c.s.H) return gr;
    const size_t bytes = sizeof(T) * size_t(c.tokens * c.s.HV * c.s.K);
    gr.dq = gr.dq ? dqv : nullptr;
    gr.dk = gr.dk ? dkv : nullptr;
    for (T* p : {gr.dq, gr.dk})
        if (p) device_zero(Device::cuda, p, bytes);
    return gr;
}

template <class T>
void sum_value_heads(const KdaCall& c, const KdaGradPtrs<T>& per_head, const KdaGradPtrs<T>& gr) {
    if (c.s.HV == c.s.H) return;
    const int64_t G = c.s.HV / c.s.H;
    if (gr.dq)
        check_launch(launch_kda_sum_value_heads<T>(c.tokens, c.s.H, G, c.s.K, per_head.dq, gr.dq, stream()), "kda dq");
    if (gr.dk)
        check_launch(launch_kda_sum_value_heads<T>(c.tokens, c.s.H, G, c.s.K, per_head.dk, gr.dk, stream()), "kda dk");
}

template <class T>
KdaChunkGeometry chunk_geometry(const KdaCall& c, const ChunkPlan& pl, std::byte* base) {
    return {upload(base + pl.seqs, std::span<const KdaSeq>(c.seqs)),
            upload(base + pl.chunk_seq, std::span<const int64_t>(c.chunk_seq)), int64_t(c.seqs.size()), c.total_chunks,
            pl.window};
}

}  // namespace

void kda_forward(
    const KdaParams& p, const KdaInputs& in, TensorView o, TensorView ht, std::span<std::byte>, TensorView saved) {
    dispatch_float(in.q.dtype, "kda", [&]<class T>(T) {
        const KdaCall c = kda_call(p, in, sizeof(T), false);
        if (p.mode == KdaMode::chunk) {
            const ChunkPlan pl = chunk_plan(c, sizeof(T), false, saved.defined());
            auto* base = static_cast<std::byte*>(scratch(pl.total));
            T* states = saved.defined() ? saved.ptr<T>() : reinterpret_cast<T*>(base + pl.states);
            check_launch(launch_kda_chunk_forward<T>(c.s, chunk_geometry<T>(c, pl, base), kda_tensors<T>(in),
                                                     o.ptr<T>(), ptr_or_null<T>(ht), states,
                                                     reinterpret_cast<T*>(base + pl.slots), stream()),
                         "kda");
            return;
        }
        const KdaSeq* seqs = to_scratch(std::span<const KdaSeq>(c.seqs));
        check_launch(launch_kda_forward<T>(c.s, seqs, c.units, kda_tensors<T>(in), o.ptr<T>(), ptr_or_null<T>(ht),
                                           ptr_or_null<T>(saved), stream()),
                     "kda");
    });
}

void kda_backward(const KdaParams& p,
                  const KdaInputs& in,
                  TensorView dout,
                  TensorView dht,
                  const KdaGrads& grads,
                  std::span<std::byte>,
                  TensorView saved) {
    dispatch_float(in.q.dtype, "kda", [&]<class T>(T) {
        const KdaCall c = kda_call(p, in, sizeof(T), true);
        const KdaTensors<T> t = kda_tensors<T>(in);
        const KdaGradPtrs<T> gr{ptr_or_null<T>(grads.dq), ptr_or_null<T>(grads.dk),    ptr_or_null<T>(grads.dv),
                                ptr_or_null<T>(grads.dg), ptr_or_null<T>(grads.dbeta), ptr_or_null<T>(grads.dh0)};
        if (p.mode == KdaMode::chunk) {
            const ChunkPlan pl = chunk_plan(c, sizeof(T), true, saved.defined());
            auto* base = static_cast<std::byte*>(scratch(pl.total));
            T* states = saved.defined() ? saved.ptr<T>() : reinterpret_cast<T*>(base + pl.states);
            const KdaGradPtrs<T> heads =
                per_value_head(c, gr, reinterpret_cast<T*>(base + pl.dqv), reinterpret_cast<T*>(base + pl.dkv));
            check_launch(launch_kda_chunk_backward<T>(
                             c.s, chunk_geometry<T>(c, pl, base), t, ptr_or_null<T>(dout), ptr_or_null<T>(dht), states,
                             saved.defined(), heads, c.s.HV > c.s.H ? c.s.HV : c.s.H,
                             reinterpret_cast<T*>(base + pl.slots), reinterpret_cast<T*>(base + pl.carry), stream()),
                         "kda backward");
            sum_value_heads(c, heads, gr);
            return;
        }
        const int64_t KV = c.s.K * c.s.V;
        // one scratch request: the sequence table, the checkpoints (without saved states), the chunk states, and
        // dq, dk per value head (GVA)
        const size_t seq_bytes = scratch_part(sizeof(KdaSeq) * c.seqs.size());
        const size_t ckpt_bytes = saved.defined() ? 0 : scratch_part(sizeof(T) * size_t(c.total_chunks * c.s.HV * KV));
        const size_t state_bytes = scratch_part(sizeof(T) * size_t(c.units * ((c.s.C + 1) * KV + c.s.C * c.s.V)));
        const size_t head_bytes = c.s.HV > c.s.H ? scratch_part(sizeof(T) * size_t(c.tokens * c.s.HV * c.s.K)) : 0;
        auto* base = static_cast<std::byte*>(scratch(seq_bytes + ckpt_bytes + state_bytes + 2 * head_bytes));
        const KdaSeq* seqs = upload(base, std::span<const KdaSeq>(c.seqs));
        T* ckpt = saved.defined() ? saved.ptr<T>() : reinterpret_cast<T*>(base + seq_bytes);
        T* states = reinterpret_cast<T*>(base + seq_bytes + ckpt_bytes);
        T* heads_at = reinterpret_cast<T*>(base + seq_bytes + ckpt_bytes + state_bytes);
        if (!saved.defined())  // the states entering every chunk, by a forward pass that writes nothing else
            check_launch(launch_kda_forward<T>(c.s, seqs, c.units, t, nullptr, nullptr, ckpt, stream()),
                         "kda backward (checkpoints)");
        const KdaGradPtrs<T> heads =
            per_value_head(c, gr, heads_at, reinterpret_cast<T*>(reinterpret_cast<std::byte*>(heads_at) + head_bytes));
        check_launch(launch_kda_backward<T>(c.s, seqs, c.units, t, ptr_or_null<T>(dout), ptr_or_null<T>(dht), ckpt,
                                            states, heads, stream()),
                     "kda backward");
        sum_value_heads(c, heads, gr);
    });
}

void l2norm_forward(const L2NormParams& p, TensorView x, TensorView y) {
    dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        check_launch(launch_l2norm_forward<T>(carg<T>(x, "l2norm: x"), marg<T>(y, "l2norm: y"), p.eps, stream()),
                     "l2norm");
    });
}

void l2norm_backward(const L2NormParams& p, TensorView dy, TensorView x, TensorView dx) {
    dispatch_float(x.dtype, "l2norm", [&]<class T>(T) {
        check_launch(launch_l2norm_backward<T>(carg<T>(dy, "l2norm: dy"), carg<T>(x, "l2norm: x"),
                                               marg<T>(dx, "l2norm: dx"), p.eps, stream()),
                     "l2norm backward");
    });
}

void gated_rmsnorm_forward(
    const GatedRmsNormParams& p, TensorView x, TensorView gate, TensorView weight, TensorView y) {
    dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        check_launch(launch_gated_rmsnorm_forward<T>(
                         carg<T>(x, "gated_rmsnorm: x"), carg<T>(gate, "gated_rmsnorm: gate"), weight.ptr<T>(),
                         marg<T>(y, "gated_rmsnorm: y"), p.eps, p.activation == GateActivation::silu, stream()),
                     "gated_rmsnorm");
    });
}

void gated_rmsnorm_backward(const GatedRmsNormParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView gate,
                            TensorView weight,
                            TensorView dx,
                            TensorView dgate,
                            TensorView dweight) {
    dispatch_float(x.dtype, "gated_rmsnorm", [&]<class T>(T) {
        const RowsArg<const T> X = carg<T>(x, "gated_rmsnorm: x");
        const RowsArg<T> none{nullptr, 0, 0, 0};
        // one scratch request: each row's rstd, then dweight's row slabs
        const size_t rstd_bytes = scratch_part(sizeof(T) * size_t(X.rows));
        auto* base =
            static_cast<std::byte*>(scratch(rstd_bytes + sizeof(T) * size_t(column_slab_elements(X.rows, X.cols, 1))));
        auto* rstd = reinterpret_cast<T*>(base);
        auto* slabs = reinterpret_cast<T*>(base + rstd_bytes);
        check_launch(launch_gated_rmsnorm_backward<T>(
                         carg<T>(dy, "gated_rmsnorm: dy"), X, carg<T>(gate, "gated_rmsnorm: gate"), weight.ptr<T>(),
                         dx.defined() ? marg<T>(dx, "gated_rmsnorm: dx") : none,
                         dgate.defined() ? marg<T>(dgate, "gated_rmsnorm: dgate") : none, ptr_or_null<T>(dweight), rstd,
                         slabs, p.eps, p.activation == GateActivation::silu, stream()),
                     "gated_rmsnorm backward");
    });
}

void kda_gate_forward(const KdaGateParams& p, TensorView f, TensorView A_log, TensorView dt_bias, TensorView g) {
    const int64_t HV = f.size(-2), K = f.size(-1);
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        check_launch(launch_kda_gate_forward<T>(f.ptr<T>(), A_log.ptr<T>(), dt_bias.ptr<T>(), g.ptr<T>(),
                                                f.numel() / (HV * K), HV, K, p.lower_bound, stream()),
                     "kda_gate");
    });
}

void kda_gate_backward(const KdaGateParams& p,
                       TensorView dg,
                       TensorView f,
                       TensorView A_log,
                       TensorView dt_bias,
                       TensorView df,
                       TensorView dA_log,
                       TensorView ddt_bias) {
    const int64_t HV = f.size(-2), K = f.size(-1), N = f.numel() / (HV * K);
    dispatch_float(f.dtype, "kda_gate", [&]<class T>(T) {
        double* slabs = dA_log.defined() || ddt_bias.defined()
                            ? static_cast<double*>(scratch(sizeof(double) * size_t(column_slab_elements(N, HV * K, 2))))
                            : nullptr;
        check_launch(launch_kda_gate_backward<T>(dg.ptr<T>(), f.ptr<T>(), A_log.ptr<T>(), dt_bias.ptr<T>(),
                                                 ptr_or_null<T>(df), ptr_or_null<T>(dA_log), ptr_or_null<T>(ddt_bias),
                                                 N, HV, K, p.lower_bound, slabs, stream()),
                     "kda_gate backward");
    });
}

namespace {
// cu_seqlens_device: the device copy of cu (null when cu is empty)
ConvShape conv_shape(const CausalConv1dParams& p,
                     const TensorView& x,
                     const TensorView& w,
                     std::span<const int64_t> cu,
                     const int64_t* cu_seqlens_device) {
    return {.tokens = x.size(0) * x.size(1),
            .T = x.size(1),
            .C = x.size(2),
            .W = w.size(1),
            .cu = cu_seqlens_device,
            .segments = cu.empty() ? x.size(0) : int64_t(cu.size()) - 1,
            .silu = p.activation == Activation::silu};
}
}  // namespace

void causal_conv1d_forward(
    const CausalConv1dParams& p, TensorView x, TensorView w, TensorView y, std::span<const int64_t> cu_seqlens) {
    const ConvShape s = conv_shape(p, x, w, cu_seqlens, cu_seqlens.empty() ? nullptr : to_scratch(cu_seqlens));
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        check_launch(launch_conv1d_forward<T>(s, x.ptr<T>(), w.ptr<T>(), y.ptr<T>(), stream()), "causal_conv1d");
    });
}

void causal_conv1d_backward(const CausalConv1dParams& p,
                            TensorView dy,
                            TensorView x,
                            TensorView w,
                            TensorView dx,
                            TensorView dw,
                            std::span<const int64_t> cu_seqlens) {
    TESSERA_CHECK(w.size(1) <= kConvMaxWidth, "causal_conv1d (CUDA): backward supports widths up to {}, not {}",
                  kConvMaxWidth, w.size(1));
    dispatch_float(x.dtype, "causal_conv1d", [&]<class T>(T) {
        // one scratch request: the device copy of cu_seqlens, then dw's token slabs
        const int64_t tokens = x.size(0) * x.size(1);
        const size_t cu_bytes = scratch_part(cu_seqlens.size_bytes());
        const size_t slab_bytes =
            dw.defined() ? sizeof(T) * size_t(column_slab_elements(tokens, x.size(2), w.size(1))) : 0;
        auto* base = static_cast<std::byte*>(scratch(cu_bytes + slab_bytes));
        const ConvShape s = conv_shape(p, x, w, cu_seqlens, cu_seqlens.empty() ? nullptr : upload(base, cu_seqlens));
        check_launch(launch_conv1d_backward<T>(s, dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(), ptr_or_null<T>(dx),
                                               ptr_or_null<T>(dw), reinterpret_cast<T*>(base + cu_bytes), stream()),
                     "causal_conv1d backward");
    });
}

void causal_conv1d_step(const CausalConv1dParams& p, TensorView x, TensorView w, TensorView window, TensorView y) {
    check_launch(launch_conv1d_step(x.size(0), x.size(1), w.size(1), p.activation == Activation::silu, x.ptr<float>(),
                                    w.ptr<float>(), window.ptr<float>(), y.ptr<float>(), stream()),
                 "causal_conv1d step");
}

}  // namespace tessera::ops::cuda
