// The MoE layer on the CPU: routing with capacity and re-routing, the dispatch/combine layout,
// grouped expert GEMMs, latent projections, shared expert, and the backward of all of it (moe.h).
#include "ops/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>
#include <string_view>
#include <tuple>

#include "core/device.h"
#include "ops/backend.h"
#include "ops/cpu/glu_math.h"
#include "ops/cpu/kernel_util.h"
#include "ops/grouped_gemm.h"
#include "ops/linear.h"
#include "ops/moe_layout.h"
#include "ops/op_use.h"
#include "ops/rmsnorm.h"
#include "ops/rows.h"
#include "ops/swiglu.h"

namespace tessera::ops {

using cpu::dispatch_float;

namespace {
TensorView first(TensorView t, int64_t rows) { return t.defined() ? t.slice0(0, rows) : t; }

// The dense adapter of projection `which` (its own dropout stream)
LoraParams lora_of(const MoeParams& p, int which) {
    LoraParams q = p.lora;
    q.stream = p.lora.stream + uint64_t(which + 1) * 0x9e3779b97f4a7c15ull;
    return q;
}
// y += the adapter's output for x, when the projection has one (x, y: the N rows of a linear's input and output)
void lora_fwd(const MoeParams& p, const LoraPair& l, TensorView x, TensorView y, const MoeScratch& t, int which) {
    if (l.a.defined()) lora_forward(lora_of(p, which), x, l.a, l.b, t.lora_u, y, t.lora_xd);
}
// the routed experts' adapters over the rows of the layout g
void expert_lora_fwd(
    const MoeParams& p, const ExpertRows& g, const LoraPair& l, TensorView x, TensorView y, const MoeScratch& t) {
    if (l.a.defined()) lora_grouped_forward(p.lora, g, x, l.a, l.b, t.lora_u, y);
}
void expert_lora_bwd(const MoeParams& p,
                     const ExpertRows& g,
                     const LoraPair& l,
                     const LoraPair& gl,
                     TensorView x,
                     TensorView dy,
                     TensorView dx,
                     const MoeScratch& t) {
    if (l.a.defined()) lora_grouped_backward(p.lora, g, x, dy, l.a, l.b, t.lora_u, t.lora_du, dx, gl.a, gl.b);
}
// its backward: the adapter's gradients (gl) and dx += its input gradient
void lora_bwd(const MoeParams& p,
              const LoraPair& l,
              const LoraPair& gl,
              TensorView x,
              TensorView dy,
              TensorView dx,
              const MoeScratch& t,
              int which) {
    if (l.a.defined())
        lora_backward(lora_of(p, which), x, dy, l.a, l.b, t.lora_u, t.lora_du, dx, gl.a, gl.b, t.lora_xd);
}
std::span<double> aux_scratch(const MoeScratch& t, const MoeDims& d) {
    TESSERA_CHECK(t.aux.defined() && t.aux.numel() >= 2 * d.experts,
                  "moe: the sequence-wise aux loss needs the scratch's aux buffer of 2·E doubles");
    return {t.aux.ptr<double>(), size_t(2 * d.experts)};
}

void act_forward(const MoeParams& p, TensorView gate, TensorView up, TensorView y) {
    if (p.activation == ExpertActivation::situ) {
        situ_glu_forward(p.situ, gate, up, y);
    } else {
        swiglu_forward(gate, up, y);
    }
}
void act_backward(const MoeParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    if (p.activation == ExpertActivation::situ) {
        situ_glu_backward(p.situ, dy, gate, up, dgate, dup);
    } else {
        swiglu_backward(dy, gate, up, dgate, dup);
    }
}

// f(activation functor) for the MoE's activation
template <class T, class Fn>
void with_activation(const MoeParams& p, Fn&& f) {
    if (p.activation == ExpertActivation::situ) {
        f(cpu::SituGlu<T>(p.situ.beta, p.situ.linear_beta));
    } else {
        f(cpu::SwiGlu<T>{});
    }
}

void check_weight(const TensorView& t, const Shape& shape, std::string_view name) {
    TESSERA_CHECK(t.defined(), "moe: {} is required", name);
    check_shape(t, shape, "moe", name);
    if (!t.slices) check_contiguous(t, "moe", name);  // (experts stored apart: each contiguous)
}

// The layer's tensors on one device, its experts in the activations' dtype or, frozen, held narrow (bf16, MXFP4) in
// an f32 layer (an f64 layer runs on f64 experts): checked before anything is read.
void check_layer(const MoeWeights& w, const TensorView& x, std::initializer_list<TensorView> tensors) {
    op_device("moe", tensors);
    for (const TensorView* e : {&w.w_gate, &w.w_up, &w.w_down}) {
        const bool narrow = e->dtype == DType::bf16 || e->dtype == DType::mxfp4;
        TESSERA_CHECK(!e->defined() || e->dtype == x.dtype || (narrow && x.dtype == DType::f32),
                      "moe: expert weights in {} but the layer in {} (experts held in bf16 or mxfp4 need an f32 layer)",
                      dtype_name(e->dtype), dtype_name(x.dtype));
    }
}

struct Pairs {  // the (token, slot) arrays of a layout, N·K long
    const int32_t* expert;
    const int32_t* row;
    int64_t N, K;
};
Pairs pairs_of(const MoeSaved& s, int64_t N) {
    return {s.expert.ptr<int32_t>(), s.row.ptr<int32_t>(), N, s.expert.size(1)};
}

// Capacity (moe.h): writes s.expert from s.choice (s.row and s.counts as scratch); uniform: ⌈c·N·k/E⌉ rows per expert,
// or share: each expert's room for this rank's rows (expert parallelism). Returns (rerouted, dropped). (The names and
// signatures of these helpers are their CUDA entry points': ops/backend.h.)
std::pair<int64_t, int64_t> moe_apply_capacity(
    const MoeParams& p, const MoeSaved& s, int64_t N, int64_t uniform, TensorView bias, const int64_t* share) {
    if (op_device("moe", {s.scores, s.choice, s.expert, bias}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_apply_capacity(p, s, N, uniform, bias, share));
    std::pair<int64_t, int64_t> r;
    dispatch_float(s.scores.dtype, "moe", [&]<class T>(T) {
        r = moe_capacity_rows<T>(p, N, s.scores.size(1), s.choice.size(1), uniform, s.scores.ptr<T>(),
                                 s.choice.ptr<int32_t>(), bias.defined() ? bias.ptr<T>() : nullptr, share,
                                 s.expert.ptr<int32_t>(), s.row.ptr<int32_t>(), s.counts.ptr<int32_t>());
    });
    return r;
}

// The gate gradient of each (token, slot) from its row's: dg[i] = row_dot[row(i)], 0 for a dropped pair
void moe_gate_grads(const MoeSaved& s, TensorView row_dot, TensorView dg, int64_t N) {
    if (op_device("moe", {s.row, row_dot, dg}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_gate_grads(s, row_dot, dg, N));
    const int32_t* row = s.row.ptr<int32_t>();
    const int64_t K = s.row.size(1);
    dispatch_float(dg.dtype, "moe", [&]<class T>(T) {
        const T* dot = row_dot.ptr<T>();
        T* g = dg.ptr<T>();
        for (int64_t i = 0; i < N * K; ++i) g[i] = row[i] >= 0 ? dot[row[i]] : T(0);
    });
}
}  // namespace

int64_t MoeDims::capacity(double factor) const {
    if (factor <= 0) return 0;
    return int64_t(std::ceil(factor * double(tokens) * double(topk) / double(experts)));
}

MoeDims moe_dims(const MoeParams& p, const MoeWeights& w, int64_t tokens) {
    MoeDims d;
    TESSERA_CHECK(w.router_w.defined() && w.router_w.ndim() == 2, "moe: router_w must be [E, D]");
    d.tokens = tokens;
    d.experts = w.router_w.size(0);
    d.d_model = w.router_w.size(1);
    d.topk = p.router.topk;
    p.router.validate(d.experts);
    TESSERA_CHECK(p.capacity_factor >= 0 && std::isfinite(p.capacity_factor),
                  "moe: capacity_factor must be >= 0 (0 = dropless), not {}", p.capacity_factor);
    if (w.router_bias.defined()) check_weight(w.router_bias, Shape{d.experts}, "router_bias");
    TESSERA_CHECK(w.w_gate.defined() && w.w_gate.ndim() == 3, "moe: w_gate must be [E, F, L]");
    d.ffn = w.w_gate.size(1);
    d.has_latent = w.latent_down.defined();
    d.latent = d.has_latent ? w.latent_down.size(0) : d.d_model;
    d.local_experts = p.stage ? p.stage->local_experts() : d.experts;
    d.expert_rows_here = p.stage == nullptr;
    check_weight(w.w_gate, Shape{d.local_experts, d.ffn, d.latent}, "w_gate");
    check_weight(w.w_up, Shape{d.local_experts, d.ffn, d.latent}, "w_up");
    check_weight(w.w_down, Shape{d.local_experts, d.latent, d.ffn}, "w_down");
    if (d.has_latent) {
        check_weight(w.latent_down, Shape{d.latent, d.d_model}, "latent_down");
        check_weight(w.latent_up, Shape{d.d_model, d.latent}, "latent_up");
    } else {
        TESSERA_CHECK(!w.latent_up.defined() && !w.latent_norm.defined(),
                      "moe: latent_up and latent_norm need latent_down");
    }
    d.has_norm = w.latent_norm.defined();
    if (d.has_norm) check_weight(w.latent_norm, Shape{d.latent}, "latent_norm");
    d.has_shared = w.shared_gate.defined() || w.shared_up.defined() || w.shared_down.defined();
    if (d.has_shared) {
        TESSERA_CHECK(w.shared_gate.defined() && w.shared_gate.ndim() == 2, "moe: shared_gate must be [FS, D]");
        d.shared_ffn = w.shared_gate.size(0);
        check_weight(w.shared_gate, Shape{d.shared_ffn, d.d_model}, "shared_gate");
        check_weight(w.shared_up, Shape{d.shared_ffn, d.d_model}, "shared_up");
        check_weight(w.shared_down, Shape{d.d_model, d.shared_ffn}, "shared_down");
    }
    d.has_shared_scale = w.shared_scale.defined();
    if (d.has_shared_scale) {
        TESSERA_CHECK(d.has_shared, "moe: shared_scale needs a shared expert");
        check_weight(w.shared_scale, Shape{1, d.d_model}, "shared_scale");
    }
    TESSERA_CHECK(d.max_rows() < (int64_t(1) << 31), "moe: {} expert rows exceed the i32 layout", d.max_rows());
    d.lora_rank = w.lora.rank();
    const MoeLora& l = w.lora;
    d.lora_dropout =
        p.lora.dropout > 0 && (l.latent_down.a.defined() || l.latent_up.a.defined() || l.shared_gate.a.defined() ||
                               l.shared_up.a.defined() || l.shared_down.a.defined());
    return d;
}

int64_t MoeLora::rank() const {
    int64_t r = 0;
    for (const LoraPair* p :
         {&latent_down, &latent_up, &shared_gate, &shared_up, &shared_down, &w_gate, &w_up, &w_down}) {
        if (!p->a.defined()) continue;
        TESSERA_CHECK(r == 0 || p->a.size(-2) == r, "moe: adapters of ranks {} and {} in one layer", r, p->a.size(-2));
        r = p->a.size(-2);
    }
    return r;
}

void moe_saved_specs(const MoeDims& d, DType dt, const std::string& prefix, std::vector<BufferSpec>& out) {
    const int64_t N = d.tokens, E = d.experts, K = d.topk, R = d.max_rows(), L = d.latent, F = d.ffn;
    // narrowable: the experts' rows and hidden activations, the latent and shared expert's (not the routing, the
    // gates or the norm's statistics)
    auto add = [&](const char* name, DType t, Shape s) {
        static const std::set<std::string_view> rows = {"xe", "h", "a", "z", "c", "n", "sh", "sa"};
        out.push_back({.name = prefix + name, .dtype = t, .shape = s, .narrowable = rows.contains(name)});
    };
    add("logits", dt, Shape{N, E});
    add("scores", dt, Shape{N, E});
    add("choice", DType::i32, Shape{N, K});
    add("expert", DType::i32, Shape{N, K});
    add("gates", dt, Shape{N, K});
    add("row", DType::i32, Shape{N, K});
    add("offsets", DType::i32, Shape{E + 1});
    add("counts", DType::i32, Shape{E});
    add("demand", DType::i32, Shape{E});
    add("row_gate", dt, Shape{R});
    add("xe", dt, Shape{R, L});
    if (d.expert_rows_here) {
        add("h", dt, Shape{R, 2 * F});
        add("a", dt, Shape{R, F});
    }
    if (d.has_latent) {
        add("z", dt, Shape{N, L});
        add("c", dt, Shape{N, L});
    }
    if (d.has_norm) {
        add("rstd", dt, Shape{N});
        add("n", dt, Shape{N, L});
    }
    if (d.has_shared) {
        add("sh", dt, Shape{N, 2 * d.shared_ffn});
        add("sa", dt, Shape{N, d.shared_ffn});
    }
    if (d.has_shared_scale) add("ss", dt, Shape{N});
}

void moe_scratch_specs(const MoeDims& d, DType dt, const std::string& prefix, std::vector<BufferSpec>& out) {
    const int64_t N = d.tokens, E = d.experts, K = d.topk, R = d.max_rows(), L = d.latent, F = d.ffn;
    auto add = [&](const char* name, Shape s) { out.push_back({prefix + name, dt, s}); };
    add("ye", Shape{R, L});
    if (d.expert_rows_here) {
        add("dh", Shape{R, 2 * F});
        add("da", Shape{R, F});
    }
    add("dxe", Shape{R, L});
    add("row_dot", Shape{R});
    add("ds", Shape{N, E});
    add("du", Shape{N, E});
    add("dg", Shape{N, K});
    if (d.has_latent) {
        add("dc", Shape{N, L});
        add("dn", Shape{N, L});
    }
    if (d.has_shared) {
        add("dsh", Shape{N, 2 * d.shared_ffn});
        add("dsa", Shape{N, d.shared_ffn});
    }
    if (d.has_shared_scale) add("dss", Shape{N});
    if (d.lora_rank > 0) {
        add("lora_u", Shape{std::max(N, R), d.lora_rank});
        add("lora_du", Shape{std::max(N, R), d.lora_rank});
    }
    if (d.lora_dropout) add("lora_xd", Shape{N, std::max({d.d_model, L, d.shared_ffn})});
    out.push_back({prefix + "aux", DType::f64, Shape{2 * E}});
}

MoeSaved moe_bind_saved(const MoeDims& d, const BufferGroup& g, const std::string& prefix) {
    auto v = [&](const char* name) { return g.view(prefix + name); };
    MoeSaved s;
    s.logits = v("logits");
    s.scores = v("scores");
    s.choice = v("choice");
    s.expert = v("expert");
    s.gates = v("gates");
    s.row = v("row");
    s.offsets = v("offsets");
    s.counts = v("counts");
    s.demand = v("demand");
    s.row_gate = v("row_gate");
    s.xe = v("xe");
    if (d.expert_rows_here) {
        s.h = v("h");
        s.a = v("a");
    }
    if (d.has_latent) {
        s.z = v("z");
        s.c = v("c");
    }
    if (d.has_norm) {
        s.rstd = v("rstd");
        s.n = v("n");
    }
    if (d.has_shared) {
        s.sh = v("sh");
        s.sa = v("sa");
    }
    if (d.has_shared_scale) s.ss = v("ss");
    return s;
}

MoeBuffers moe_buffers(const MoeDims& d, DType dtype, Device device) {
    std::vector<BufferSpec> specs;
    moe_saved_specs(d, dtype, "", specs);
    moe_scratch_specs(d, dtype, "", specs);
    MoeBuffers b{.group = BufferGroup("moe", std::move(specs))};
    b.group.allocate(std::make_shared<Arena>(predict_arena_bytes({&b.group}, 256), 256, device));
    b.saved = moe_bind_saved(d, b.group, "");
    b.scratch = moe_bind_scratch(d, b.group, "");
    return b;
}

MoeScratch moe_bind_scratch(const MoeDims& d, const BufferGroup& g, const std::string& prefix) {
    auto v = [&](const char* name) { return g.view(prefix + name); };
    MoeScratch t;
    t.ye = v("ye");
    if (d.expert_rows_here) {
        t.dh = v("dh");
        t.da = v("da");
    }
    t.dxe = v("dxe");
    t.row_dot = v("row_dot");
    t.ds = v("ds");
    t.du = v("du");
    t.dg = v("dg");
    if (d.has_latent) {
        t.dc = v("dc");
        t.dn = v("dn");
    }
    if (d.has_shared) {
        t.dsh = v("dsh");
        t.dsa = v("dsa");
    }
    if (d.has_shared_scale) t.dss = v("dss");
    t.aux = v("aux");
    if (d.lora_rank > 0) {
        t.lora_u = v("lora_u");
        t.lora_du = v("lora_du");
    }
    if (d.lora_dropout) t.lora_xd = v("lora_xd");
    return t;
}

MoeStats moe_route(const MoeParams& p,
                   const MoeWeights& w,
                   TensorView x,
                   const MoeSaved& s,
                   const MoeScratch& t,
                   std::span<const int64_t> seq_starts) {
    const Device device =
        op_device("moe", {x, w.router_w, w.router_bias, s.logits, s.scores, s.choice, s.expert, s.gates, s.row});
    const int64_t N = x.size(0);
    const MoeDims d = moe_dims(p, w, N);
    TESSERA_CHECK(x.ndim() == 2 && x.size(1) == d.d_model, "moe: x must be [N, D = {}], not {}", d.d_model,
                  x.shape.str());
    TESSERA_CHECK(N <= s.logits.size(0), "moe: {} tokens but buffers for {}", N, s.logits.size(0));
    MoeStats st;
    TensorView scores = first(s.scores, N), logits = first(s.logits, N), choice = first(s.choice, N);
    router_scores(p.router, x, w.router_w, logits, scores);
    router_select(p.router, scores, w.router_bias, choice, first(s.gates, N), s.demand);
    copy_bytes(s.expert.data, device, s.choice.data, device, size_t(N * d.topk) * sizeof(int32_t));
    if (p.capacity_factor > 0) {
        const int64_t* share = p.stage ? p.stage->capacity_shares(p.capacity_factor, N, s.demand) : nullptr;
        std::tie(st.rerouted, st.dropped) =
            moe_apply_capacity(p, s, N, d.capacity(p.capacity_factor), w.router_bias, share);
        router_weights(p.router, scores, first(s.expert, N), first(s.gates, N));
    }
    moe_build_layout(s, N);
    const int64_t whole[2] = {0, N};
    if (seq_starts.empty()) seq_starts = whole;
    if (p.seq_aux_coeff > 0)
        st.seq_aux_loss = router_seq_aux_loss(p.seq_aux_coeff, scores, choice, seq_starts, {}, aux_scratch(t, d));
    if (p.z_loss_coeff > 0) st.z_loss = router_z_loss(p.z_loss_coeff, logits, {});
    return st;
}

void moe_build_layout(const MoeSaved& s, int64_t tokens) {
    if (op_device("moe", {s.expert, s.gates, s.row, s.offsets, s.counts, s.row_gate}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_build_layout(s, tokens));
    const int64_t E = s.counts.size(0), K = s.expert.size(1);
    const int32_t* row = s.row.ptr<int32_t>();
    const int32_t* off = s.offsets.ptr<int32_t>();
    moe_layout_rows(tokens, K, E, s.expert.ptr<int32_t>(), s.row.ptr<int32_t>(), s.counts.ptr<int32_t>(),
                    s.offsets.ptr<int32_t>());
    dispatch_float(s.gates.dtype, "moe", [&]<class T>(T) {  // each row's gate (0 for padding)
        T* rg = s.row_gate.ptr<T>();
        const T* gates = s.gates.ptr<T>();
        std::fill(rg, rg + off[E], T(0));
        for (int64_t i = 0; i < tokens * K; ++i) {
            if (row[i] >= 0) rg[row[i]] = gates[i];
        }
    });
}

void moe_dispatch(const MoeSaved& s, TensorView src, TensorView rows) {
    const int64_t N = src.size(0), W = src.size(1), E = s.counts.size(0);
    TESSERA_CHECK(rows.ndim() == 2 && rows.size(1) == W, "moe dispatch: rows must be [R, {}]", W);
    if (op_device("moe", {src, rows, s.row, s.offsets, s.counts}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_dispatch(s, src, rows));
    const Pairs pr = pairs_of(s, N);
    dispatch_float(src.dtype, "moe dispatch", [&]<class T>(T) {
        cpu::Rows<T> S = cpu::rows_of<T>(src, "moe dispatch: src");
        T* out = rows.ptr<T>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            for (int64_t j = 0; j < pr.K; ++j) {
                const int32_t r = pr.row[n * pr.K + j];
                if (r >= 0) std::memcpy(out + r * W, S.row(n), size_t(W) * sizeof(T));
            }
        }
        const int32_t* off = s.offsets.ptr<int32_t>();
        const int32_t* cnt = s.counts.ptr<int32_t>();
        for (int64_t e = 0; e < E; ++e) {
            std::fill(out + (off[e] + cnt[e]) * W, out + off[e + 1] * W, T(0));
        }
    });
}

void moe_combine(const MoeSaved& s, TensorView rows, TensorView dst, bool accumulate) {
    const int64_t N = dst.size(0), W = dst.size(1);
    TESSERA_CHECK(rows.ndim() == 2 && rows.size(1) == W, "moe combine: rows must be [R, {}]", W);
    if (op_device("moe", {rows, dst, s.row}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_combine(s, rows, dst, accumulate));
    const Pairs pr = pairs_of(s, N);
    dispatch_float(dst.dtype, "moe combine", [&]<class T>(T) {
        cpu::Rows<T> D = cpu::rows_of<T>(dst, "moe combine: dst");
        const T* in = rows.ptr<T>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            T* o = D.row(n);
            if (!accumulate) std::fill(o, o + W, T(0));
            for (int64_t j = 0; j < pr.K; ++j) {  // slot order
                const int32_t r = pr.row[n * pr.K + j];
                if (r < 0) continue;
                const T* y = in + r * W;
#pragma omp simd
                for (int64_t c = 0; c < W; ++c) o[c] += y[c];
            }
        }
    });
}

namespace {
// The M-grouped GEMM with the experts' weight w stored in T, or held narrow (bf16, MXFP4: frozen; ops/grouped_gemm.h)
template <class T>
void expert_gemm(Trans tb,
                 const ExpertRows& g,
                 int64_t N,
                 int64_t K,
                 const T* A,
                 int64_t lda,
                 const TensorView& w,
                 int64_t b_stride,
                 int64_t ldb,
                 T beta,
                 T* C,
                 int64_t ldc) {
    cpu::with_weight<T>(w, "moe",
                        [&](auto B) { grouped_gemm(tb, g, N, K, A, lda, B, b_stride, ldb, beta, C, ldc, w.slices); });
}
}  // namespace

void moe_experts_forward(const MoeParams& p, const MoeWeights& w, const MoeSaved& s, const MoeScratch& t) {
    if (op_device("moe", {w.w_gate, w.w_up, w.w_down, s.offsets, s.row_gate, s.xe, s.h, s.a, t.ye}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_experts_forward(p, w, s, t));
    const int64_t E = s.counts.size(0), R = s.offsets.ptr<int32_t>()[E], F = w.w_gate.size(1), L = w.w_gate.size(2);
    const ExpertRows g{s.offsets.ptr<int32_t>(), E};
    dispatch_float(s.xe.dtype, "moe", [&]<class T>(T) {
        T* h = s.h.ptr<T>();
        expert_gemm(Trans::T, g, F, L, s.xe.ptr<T>(), L, w.w_gate, F * L, L, T(0), h, 2 * F);
        expert_gemm(Trans::T, g, F, L, s.xe.ptr<T>(), L, w.w_up, F * L, L, T(0), h + F, 2 * F);
        const TensorView xe = first(s.xe, R), hr = first(s.h, R);
        expert_lora_fwd(p, g, w.lora.w_gate, xe, hr.slice0(0, R).columns(0, F), t);
        expert_lora_fwd(p, g, w.lora.w_up, xe, hr.slice0(0, R).columns(F, F), t);
        T* a = s.a.ptr<T>();
        const T* rg = s.row_gate.ptr<T>();
        with_activation<T>(p, [&](const auto& act) {  // a' = gate · act(h), one pass
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < R; ++r) {
                const T* hg = h + r * 2 * F;
                const T* hu = hg + F;
                T* ar = a + r * F;
                const T gr = rg[r];
#pragma omp simd
                for (int64_t f = 0; f < F; ++f) ar[f] = gr * act.value(hg[f], hu[f]);
            }
        });
        expert_gemm(Trans::T, g, L, F, a, F, w.w_down, L * F, F, T(0), t.ye.ptr<T>(), L);
        expert_lora_fwd(p, g, w.lora.w_down, first(s.a, R), first(t.ye, R), t);
    });
}

void moe_experts_backward(
    const MoeParams& p, const MoeWeights& w, const MoeWeights& g, const MoeSaved& s, const MoeScratch& t) {
    if (op_device("moe", {w.w_gate, w.w_up, w.w_down, g.w_gate, g.w_up, g.w_down, s.offsets, s.row_gate, s.xe, s.h, s.a,
                          t.ye, t.da, t.dh, t.dxe, t.row_dot}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_experts_backward(p, w, g, s, t));
    const int64_t E = s.counts.size(0), R = s.offsets.ptr<int32_t>()[E], F = w.w_gate.size(1), L = w.w_gate.size(2);
    const ExpertRows eg{s.offsets.ptr<int32_t>(), E};
    dispatch_float(s.xe.dtype, "moe", [&]<class T>(T) {
        const T* dye = t.ye.ptr<T>();
        T* da = t.da.ptr<T>();
        expert_gemm(Trans::N, eg, F, L, dye, L, w.w_down, L * F, F, T(0), da, F);
        if (g.w_down.defined())  // absent: frozen experts
            grouped_gemm_wgrad(eg, L, F, dye, L, s.a.ptr<T>(), F, g.w_down.ptr<T>(), L * F, F);
        expert_lora_bwd(p, eg, w.lora.w_down, g.lora.w_down, first(s.a, R), first(t.ye, R), first(t.da, R), t);
        // one pass per row: the row's gate gradient <act(h), da'>, then dh = gate·da' ⊙ ∂act/∂h
        const T* h = s.h.ptr<T>();
        T* dh = t.dh.ptr<T>();
        T* dot = t.row_dot.ptr<T>();
        const T* rg = s.row_gate.ptr<T>();
        with_activation<T>(p, [&](const auto& act) {
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < R; ++r) {
                const T* hg = h + r * 2 * F;
                const T* hu = hg + F;
                const T* dar = da + r * F;
                T acc = 0;
#pragma omp simd reduction(+ : acc)
                for (int64_t f = 0; f < F; ++f) acc += act.value(hg[f], hu[f]) * dar[f];
                dot[r] = acc;
                const T gr = rg[r];
                T* dhg = dh + r * 2 * F;
                T* dhu = dhg + F;
#pragma omp simd
                for (int64_t f = 0; f < F; ++f) {
                    T pg, pu;
                    act.partials(hg[f], hu[f], pg, pu);
                    dhg[f] = gr * dar[f] * pg;
                    dhu[f] = gr * dar[f] * pu;
                }
            }
        });
        T* dxe = t.dxe.ptr<T>();
        expert_gemm(Trans::N, eg, L, F, dh, 2 * F, w.w_gate, F * L, L, T(0), dxe, L);
        expert_gemm(Trans::N, eg, L, F, dh + F, 2 * F, w.w_up, F * L, L, T(1), dxe, L);
        if (g.w_gate.defined()) grouped_gemm_wgrad(eg, F, L, dh, 2 * F, s.xe.ptr<T>(), L, g.w_gate.ptr<T>(), F * L, L);
        if (g.w_up.defined()) grouped_gemm_wgrad(eg, F, L, dh + F, 2 * F, s.xe.ptr<T>(), L, g.w_up.ptr<T>(), F * L, L);
        const TensorView xe = first(s.xe, R), dhr = first(t.dh, R), dxer = first(t.dxe, R);
        expert_lora_bwd(p, eg, w.lora.w_gate, g.lora.w_gate, xe, dhr.slice0(0, R).columns(0, F), dxer, t);
        expert_lora_bwd(p, eg, w.lora.w_up, g.lora.w_up, xe, dhr.slice0(0, R).columns(F, F), dxer, t);
    });
}

namespace {
// ss = σ(ss) in place, then sa ← ss·sa per token
void moe_shared_scale_forward(TensorView ss, TensorView sa) {
    if (op_device("moe", {ss, sa}) == Device::cuda) return TESSERA_ON_CUDA(moe_shared_scale_forward(ss, sa));
    const int64_t N = sa.size(0), FS = sa.size(1);
    dispatch_float(sa.dtype, "moe", [&]<class T>(T) {
        T *g = ss.ptr<T>(), *a = sa.ptr<T>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            g[n] = T(1.0 / (1.0 + std::exp(-double(g[n]))));
            for (int64_t f = 0; f < FS; ++f) a[n * FS + f] *= g[n];
        }
    });
}

// With sa' = ss·act saved and dsa' = dL/dsa': du = (1 − ss)·⟨dsa', sa'⟩ (= ss(1 − ss)·⟨dsa', act⟩, no division) and
// dsa ← ss·dsa' (the gradient of act)
void moe_shared_scale_backward(TensorView ss, TensorView sa, TensorView dsa, TensorView du) {
    if (op_device("moe", {ss, sa, dsa, du}) == Device::cuda)
        return TESSERA_ON_CUDA(moe_shared_scale_backward(ss, sa, dsa, du));
    const int64_t N = sa.size(0), FS = sa.size(1);
    dispatch_float(sa.dtype, "moe", [&]<class T>(T) {
        const T *g = ss.ptr<T>(), *a = sa.ptr<T>();
        T *d = dsa.ptr<T>(), *u = du.ptr<T>();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            double dot = 0;
            for (int64_t f = 0; f < FS; ++f) dot += double(d[n * FS + f]) * double(a[n * FS + f]);
            u[n] = T((1.0 - double(g[n])) * dot);
            for (int64_t f = 0; f < FS; ++f) d[n * FS + f] *= g[n];
        }
    });
}

// Qwen3-Next's shared-expert gate: ss = σ(x·w_ssᵀ) per token, then sa ← ss·sa (the scaled activation feeds the down
// projection, which equals scaling the shared output)
void shared_scale_forward(TensorView x, TensorView w_ss, TensorView ss, TensorView sa) {
    linear_forward({}, x, w_ss, {}, ss.reshape(Shape{x.size(0), 1}));
    moe_shared_scale_forward(ss, sa);
}

// ... and its backward: the above, then dx += du·w_ss, dw_ss += Σ du·x
void shared_scale_backward(TensorView x,
                           TensorView w_ss,
                           TensorView ss,
                           TensorView sa,
                           TensorView dsa,
                           TensorView du,
                           TensorView dx,
                           TensorView dw_ss) {
    moe_shared_scale_backward(ss, sa, dsa, du);
    linear_backward(du.reshape(Shape{x.size(0), 1}), x, w_ss, dx, dw_ss, {});
}
}  // namespace

MoeStats moe_forward(const MoeParams& p,
                     const MoeWeights& w,
                     TensorView x,
                     TensorView y,
                     bool accumulate,
                     const MoeSaved& s,
                     const MoeScratch& t,
                     std::span<const int64_t> seq_starts) {
    note_op_use("moe");
    check_layer(w, x, {x, y, w.router_w, w.w_gate, w.w_up, w.w_down, s.scores, s.xe, t.ye});
    const int64_t N = x.size(0);
    const MoeDims d = moe_dims(p, w, N);
    check_shape(y, x.shape, "moe: y");
    MoeStats st = moe_route(p, w, x, s, t, seq_starts);
    const int64_t FS = d.shared_ffn;
    TensorView src = x;
    if (d.has_latent) {
        src = first(s.z, N);
        linear_forward({}, x, w.latent_down, {}, src);
        lora_fwd(p, w.lora.latent_down, x, src, t, 0);
    }
    moe_dispatch(s, src, s.xe);
    // the shared expert's input side needs no routed rows: under expert parallelism it runs while they travel
    auto shared_in = [&] {
        if (!d.has_shared) return;
        linear_forward({}, x, w.shared_gate, {}, s.sh.slice0(0, N).columns(0, FS));
        linear_forward({}, x, w.shared_up, {}, s.sh.slice0(0, N).columns(FS, FS));
        lora_fwd(p, w.lora.shared_gate, x, s.sh.slice0(0, N).columns(0, FS), t, 2);
        lora_fwd(p, w.lora.shared_up, x, s.sh.slice0(0, N).columns(FS, FS), t, 3);
        act_forward(p, s.sh.slice0(0, N).columns(0, FS), s.sh.slice0(0, N).columns(FS, FS), first(s.sa, N));
        if (d.has_shared_scale) shared_scale_forward(x, w.shared_scale, first(s.ss, N), first(s.sa, N));
    };
    if (p.stage) {
        p.stage->forward(p, w, s, t, shared_in);
    } else {
        shared_in();
        moe_experts_forward(p, w, s, t);
    }
    if (d.has_latent) {
        TensorView c = first(s.c, N);
        moe_combine(s, t.ye, c, false);
        if (d.has_norm) {
            rmsnorm_forward({.eps = p.norm_eps}, c, w.latent_norm, first(s.n, N), first(s.rstd, N));
            c = first(s.n, N);
        }
        linear_forward({.accumulate = accumulate}, c, w.latent_up, {}, y);
        lora_fwd(p, w.lora.latent_up, c, y, t, 1);
    } else {
        moe_combine(s, t.ye, y, accumulate);
    }
    if (d.has_shared) {
        linear_forward({.accumulate = true}, first(s.sa, N), w.shared_down, {}, y);
        lora_fwd(p, w.lora.shared_down, first(s.sa, N), y, t, 4);
    }
    return st;
}

void moe_backward(const MoeParams& p,
                  const MoeWeights& w,
                  TensorView x,
                  TensorView dy,
                  TensorView dx,
                  const MoeWeights& g,
                  const MoeSaved& s,
                  const MoeScratch& t,
                  std::span<const int64_t> seq_starts) {
    check_layer(w, x,
                {x, dy, dx, w.router_w, w.w_gate, w.w_up, w.w_down, g.router_w, g.w_gate, g.w_up, g.w_down, s.scores,
                 s.xe, t.ye, t.dxe});
    const int64_t N = x.size(0);
    const MoeDims d = moe_dims(p, w, N);
    check_shape(dy, x.shape, "moe: dy");
    check_shape(dx, x.shape, "moe: dx");
    const int64_t FS = d.shared_ffn;
    // the shared expert's backward needs no exchanged rows: under expert parallelism it runs while they travel
    // (its input gradient still reaches dx first, so the sum's order is the same either way)
    auto shared_backward = [&] {
        if (!d.has_shared) return;
        zero_rows(t.dsa, N);
        linear_backward(dy, first(s.sa, N), w.shared_down, first(t.dsa, N), g.shared_down, {});
        lora_bwd(p, w.lora.shared_down, g.lora.shared_down, first(s.sa, N), dy, first(t.dsa, N), t, 4);
        if (d.has_shared_scale) {
            shared_scale_backward(x, w.shared_scale, first(s.ss, N), first(s.sa, N), first(t.dsa, N), first(t.dss, N),
                                  dx, g.shared_scale);
        }
        zero_rows(t.dsh, N);
        act_backward(p, first(t.dsa, N), s.sh.slice0(0, N).columns(0, FS), s.sh.slice0(0, N).columns(FS, FS),
                     t.dsh.slice0(0, N).columns(0, FS), t.dsh.slice0(0, N).columns(FS, FS));
        linear_backward(t.dsh.slice0(0, N).columns(0, FS), x, w.shared_gate, dx, g.shared_gate, {});
        linear_backward(t.dsh.slice0(0, N).columns(FS, FS), x, w.shared_up, dx, g.shared_up, {});
        lora_bwd(p, w.lora.shared_gate, g.lora.shared_gate, x, t.dsh.slice0(0, N).columns(0, FS), dx, t, 2);
        lora_bwd(p, w.lora.shared_up, g.lora.shared_up, x, t.dsh.slice0(0, N).columns(FS, FS), dx, t, 3);
    };
    TensorView dsrc = dy;  // gradient of the combined expert output c
    if (d.has_latent) {
        zero_rows(t.dn, N);
        linear_backward(dy, first(d.has_norm ? s.n : s.c, N), w.latent_up, first(t.dn, N), g.latent_up, {});
        lora_bwd(p, w.lora.latent_up, g.lora.latent_up, first(d.has_norm ? s.n : s.c, N), dy, first(t.dn, N), t, 1);
        dsrc = first(t.dn, N);
        if (d.has_norm) {
            zero_rows(t.dc, N);
            rmsnorm_backward({.eps = p.norm_eps}, dsrc, first(s.c, N), w.latent_norm, first(s.rstd, N), first(t.dc, N),
                             g.latent_norm);
            dsrc = first(t.dc, N);
        }
    }
    moe_dispatch(s, dsrc, t.ye);  // the backward of combine: dye
    if (p.stage) {
        p.stage->backward(p, w, g, s, t, shared_backward);
    } else {
        shared_backward();
        moe_experts_backward(p, w, g, s, t);
    }
    moe_gate_grads(s, t.row_dot, t.dg, N);
    if (d.has_latent) {
        moe_combine(s, t.dxe, first(t.dc, N), false);  // the backward of dispatch: dz
        linear_backward(first(t.dc, N), x, w.latent_down, dx, g.latent_down, {});
        lora_bwd(p, w.lora.latent_down, g.lora.latent_down, x, first(t.dc, N), dx, t, 0);
    } else {
        moe_combine(s, t.dxe, dx, true);
    }
    TensorView scores = first(s.scores, N), ds = first(t.ds, N), du = first(t.du, N);
    zero_rows(t.ds, N);
    router_weights_backward(p.router, first(t.dg, N), scores, first(s.expert, N), ds);
    const int64_t whole[2] = {0, N};
    if (seq_starts.empty()) seq_starts = whole;
    if (p.seq_aux_coeff != 0)
        router_seq_aux_loss(p.seq_aux_coeff, scores, first(s.choice, N), seq_starts, ds, aux_scratch(t, d));
    if (!p.balance_grad.empty()) router_balance_backward(p.balance_grad, scores, ds);
    zero_rows(t.du, N);
    router_score_backward(p.router, scores, ds, du);
    if (p.z_loss_coeff != 0) router_z_loss(p.z_loss_coeff, first(s.logits, N), du);
    linear_backward(du, x, w.router_w, dx, g.router_w, {});
}

double moe_forward_flops_per_token(const MoeDims& d) {
    double f = 2.0 * double(d.d_model * d.experts) + double(d.topk) * 6.0 * double(d.latent * d.ffn);
    if (d.has_latent) f += 4.0 * double(d.d_model * d.latent);
    if (d.has_shared) f += 6.0 * double(d.d_model * d.shared_ffn);
    return f;
}

}  // namespace tessera::ops
