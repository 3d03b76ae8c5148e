// KDA's entry points: argument checks for both backends, CUDA tensors to ops/cuda (kda.cu), workspace sizes and
// dispatch to the CPU's chunked driver (kda_chunked.cpp) or token-recurrent reference (kda_recurrent.cpp); the GVA
// head sum.
#include "ops/kda.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/backend.h"
#include "ops/cpu/kda_driver.h"
#include "ops/op_use.h"

namespace tessera::ops {

namespace {

using namespace cpu::kda;

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

WorkSizes work_sizes(const KdaParams& p, const Layout& L, bool backward, int threads, bool saved) {
    WorkSizes w;
    w.threads = threads;
    const int64_t KV = L.K * L.V;
    // per-value-head dq, dk (summed over each q/k head's group afterwards); the chunked backward
    // writes straight into dq and dk when every q/k head has one value head
    if (backward && (L.G > 1 || p.mode == KdaMode::recurrent)) w.gva = 2 * r16(L.tokens * L.HV * L.K);
    if (p.mode == KdaMode::recurrent) {
        // per thread: the running state and a [V] vector; backward adds every state of the sequence,
        // dS and S' [K, V] and two [V] vectors
        w.rec = r16(backward ? KV * (L.max_len + 3) + 2 * L.V : KV + L.V);
        return w;
    }
    const Dims d = dims(L);
    const Schedule s = schedule(L, threads);
    w.slot = r16(chunk_state_elems(d) + KV + (backward ? 2 * L.C * L.V + KV : 0));
    const int64_t lanes = s.per_unit ? threads : s.group;  // units in flight
    w.slots = s.per_unit ? threads : s.group * s.window;
    w.scratch = r16(scratch_elems(d));
    w.running = lanes * KV;
    if (backward && !saved) w.store = lanes * L.max_chunks * KV;
    return w;
}

void check_saved(const KdaParams& p, const Layout& L, const TensorView& saved, DType dtype) {
    if (!saved.defined()) return;
    TESSERA_CHECK(p.mode == KdaMode::chunk, "kda: saved states exist in chunk mode only");
    check_shape(saved, Shape{L.total_chunks, L.HV, L.K, L.V}, "kda: saved_states");
    check_dtype(saved, dtype, "kda: saved_states");
    check_contiguous(saved, "kda: saved_states");
}

template <class T>
Problem<T> problem(const KdaParams& p, const KdaInputs& in, const Layout& L, const TensorView& saved) {
    const T scale = T(p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(L.K)));
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
    w.dqv = n.gva ? p : nullptr;
    w.dkv = n.gva ? p + n.gva / 2 : nullptr;
    p += n.gva;
    w.rec = p;
    return w;  // rec: threads × n.rec
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
    note_op_use("kda");
    const Device device = op_device("kda", {in.q, in.k, in.v, in.g, in.beta, in.h0, o, ht, saved_states});
    const Layout L = check(p, in);
    check_shape(o, in.v.shape, "kda: o");
    check_dtype(o, in.q.dtype, "kda: o");
    check_contiguous(o, "kda: o");
    if (ht.defined()) {
        check_shape(ht, Shape{L.num_seqs, L.HV, L.K, L.V}, "kda: ht");
        check_dtype(ht, in.q.dtype, "kda: ht");
        check_contiguous(ht, "kda: ht");
    }
    check_saved(p, L, saved_states, in.q.dtype);
    if (device == Device::cuda) return TESSERA_ON_CUDA(kda_forward(p, in, o, ht, ws, saved_states));
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
    const Device device = op_device("kda", {in.q, in.k, in.v, in.g, in.beta, in.h0, dout, dht, saved_states});
    TESSERA_CHECK(op_device("kda", {grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, grads.dh0, in.q}) == device,
                  "kda: the gradients must be on the inputs' device");
    const Layout L = check(p, in);
    auto check_like = [&](const TensorView& g, const Shape& shape, const char* what) {
        if (!g.defined()) return;
        check_shape(g, shape, what);
        check_dtype(g, in.q.dtype, what);
        check_contiguous(g, what);
    };
    const Shape state{L.num_seqs, L.HV, L.K, L.V};
    check_like(dout, in.v.shape, "kda: do");
    check_like(dht, state, "kda: dht");
    check_like(grads.dq, in.q.shape, "kda: dq");
    check_like(grads.dk, in.k.shape, "kda: dk");
    check_like(grads.dv, in.v.shape, "kda: dv");
    check_like(grads.dg, in.g.shape, "kda: dg");
    check_like(grads.dbeta, in.beta.shape, "kda: dbeta");
    check_like(grads.dh0, state, "kda: dh0");
    check_saved(p, L, saved_states, in.q.dtype);
    if (device == Device::cuda) return TESSERA_ON_CUDA(kda_backward(p, in, dout, dht, grads, ws, saved_states));
    cpu::dispatch_float(in.q.dtype, "kda", [&]<class T>(T) {
        const Problem<T> P = problem<T>(p, in, L, saved_states);
        const Work<T> w = carve<T>(work_sizes(p, L, true, omp_get_max_threads(), saved_states.defined()), ws);
        if (w.dqv) std::fill(w.dqv, w.dqv + w.n.gva, T(0));
        const T* dO = dout.defined() ? dout.ptr<T>() : nullptr;
        const T* dS = dht.defined() ? dht.ptr<T>() : nullptr;
        if (p.mode == KdaMode::recurrent) {
            recurrent_backward(P, dO, dS, grads, w);
        } else {
            chunk_backward_all(P, dO, dS, grads, w);
        }
        if (w.dqv) {
            reduce_value_heads(L, w.dqv, grads.dq);
            reduce_value_heads(L, w.dkv, grads.dk);
        }
    });
}

double kda_forward_flops(int64_t tokens, int64_t value_heads, int64_t d, int64_t chunk_size) {
    const double D = double(d), C = double(chunk_size);
    return double(tokens) * double(value_heads) * (6.0 * D * D + 3.0 * C * D + C * C);
}

}  // namespace tessera::ops
