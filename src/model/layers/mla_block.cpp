// MLA / gated DSA block forward and backward (data flow: mla_block.h; gradients: spec/dsa.md §3.4–§3.5).
#include "model/layers/mla_block.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/attention.h"
#include "ops/decode.h"
#include "ops/dsa.h"
#include "ops/gemm.h"
#include "ops/layernorm.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace tessera::model {

namespace {
using ops::Trans;

}  // namespace

MlaBlock::MlaBlock(const MlaConfig& c, std::string param_prefix, const LoraConfig& lora)
    : cfg_(c),
      prefix_(std::move(param_prefix)),
      C_(c.d_model),
      H_(c.num_heads),
      RQ_(c.q_lora_rank),
      RKV_(c.kv_lora_rank),
      DN_(c.qk_nope_dim),
      DR_(c.qk_rope_dim),
      DV_(c.v_head_dim),
      DQ_(c.qk_head_dim()),
      DK_(c.entry_dim()),
      G_(c.gate_width()),
      HI_(c.dsa.enabled() ? c.dsa.heads : 0),
      DI_(c.dsa.enabled() ? c.dsa.head_dim : 0) {
    cfg_.validate(prefix_ + "self_attn");
    Wq_ = RQ_ > 0 ? RQ_ : H_ * DQ_;
    col_kv_ = Wq_;
    col_g_ = col_kv_ + DK_;
    Wmain_ = col_g_ + G_;
    col_ik_ = Wmain_;
    col_iw_ = col_ik_ + DI_;
    Wh_ = col_iw_ + HI_;
    const std::string a = prefix_ + "self_attn.";
    h_lora_ = LoraAdapters(
        lora, C_,  // the LM projections of h (the indexer's learn from its KL: none)
        {{a + (RQ_ > 0 ? "q_a_proj" : "q_proj"), Wq_}, {a + "kv_a_proj_with_mqa", DK_}, {a + "g_proj", G_}});
    if (RQ_ > 0) q_b_lora_ = LoraAdapters(lora, RQ_, {{a + "q_b_proj", H_ * DQ_}});
    o_lora_ = LoraAdapters(lora, H_ * DV_, {{a + "o_proj", C_}});
    kv_b_lora_ = LoraAdapters(lora, RKV_, {{a + "kv_b_proj", H_ * (DN_ + DV_)}});
    lora_ = lora.enabled();
}

void MlaBlock::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    const ParamInit w = ParamInit::normal(cfg_.init_std), one = ParamInit::constant(1.0);
    const ParamInit out = ParamInit::normal(cfg_.init_std / std::sqrt(2.0 * double(cfg_.n_layers)));
    const std::string a = prefix_ + "self_attn.";
    add_param(specs, inits, prefix_ + "input_layernorm.weight", Shape{C_}, one, false);
    // the projections of h, back to back (one GEMM)
    add_param(specs, inits, a + (RQ_ > 0 ? "q_a_proj.weight" : "q_proj.weight"), Shape{Wq_, C_}, w, true);
    add_param(specs, inits, a + "kv_a_proj_with_mqa.weight", Shape{DK_, C_}, w, true);
    if (G_ > 0) add_param(specs, inits, a + "g_proj.weight", Shape{G_, C_}, w, true);
    if (HI_ > 0) {
        add_param(specs, inits, a + "indexer.wk.weight", Shape{DI_, C_}, w, true);
        add_param(specs, inits, a + "indexer.weights_proj.weight", Shape{HI_, C_}, w, true);
    }
    fuse_last(specs, size_t(2 + (G_ > 0) + 2 * (HI_ > 0)));
    if (RQ_ > 0) {
        add_param(specs, inits, a + "q_a_layernorm.weight", Shape{RQ_}, one, false);
        add_param(specs, inits, a + "q_b_proj.weight", Shape{H_ * DQ_, RQ_}, w, true);
    }
    add_param(specs, inits, a + "kv_a_layernorm.weight", Shape{RKV_}, one, false);
    add_param(specs, inits, a + "kv_b_proj.weight", Shape{H_ * (DN_ + DV_), RKV_}, w, true);
    specs.back().narrowable = false;  // read per head by the absorbed attention, in f32
    add_param(specs, inits, a + "o_proj.weight", Shape{C_, H_ * DV_}, out, true);
    if (HI_ > 0) {
        add_param(specs, inits, a + "indexer.wq_b.weight", Shape{HI_ * DI_, RQ_ > 0 ? RQ_ : C_}, w, true);
        add_param(specs, inits, a + "indexer.k_norm.weight", Shape{DI_}, one, false);
        add_param(specs, inits, a + "indexer.k_norm.bias", Shape{DI_}, ParamInit::constant(0.0), false);
    }
    for (const LoraAdapters* l : adapters(*this)) l->declare_params(specs, inits);
}

bool MlaBlock::is_indexer_param(const std::string& name) const {
    return HI_ > 0 && name.rfind(prefix_ + "self_attn.indexer.", 0) == 0;
}

int64_t MlaBlock::index_width(StepShape max) const {
    if (!cfg_.dsa.enabled()) return 0;
    return cfg_.dsa.warmup() ? max.seq * max.batch : cfg_.dsa.topk;  // packed rows: one sequence of B·T
}

TensorView MlaBlock::kv_b_part(TensorView w, bool value) const {
    return w.reshape(Shape{H_, DN_ + DV_, RKV_}).narrow(1, value ? DN_ : 0, value ? DV_ : DN_);
}

int64_t MlaBlock::oc_width() const { return cfg_.dsa.enabled() ? RKV_ : DK_; }

void MlaBlock::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    // narrowable: the projections' inputs and outputs (not the norms' statistics, lse, the indexer's head weights)
    auto add = [&](const char* name, Shape shape, bool narrowable = true, DType dt = DType::f32) {
        specs.push_back({.name = prefix + name, .dtype = dt, .shape = shape, .narrowable = narrowable});
    };
    add("ln", Shape{N, C_});
    add("rstd", Shape{N}, false);
    add("hp", Shape{N, Wh_});
    if (RQ_ > 0) {
        add("cq", Shape{N, RQ_});
        add("cq_rstd", Shape{N}, false);
        add("q", Shape{N, H_ * DQ_});
    }
    add("kv", Shape{N, DK_});
    add("kv_rstd", Shape{N}, false);
    add("qhat", Shape{N, H_ * DK_});
    add("oc", Shape{N, H_ * oc_width()});
    add("lse", Shape{N * H_}, false);
    add("y", Shape{N, H_ * DV_});
    if (G_ > 0) {
        add("ov", Shape{N, H_ * DV_});
        add("gate", Shape{N, G_});
    }
    if (HI_ > 0) {
        add("qi", Shape{N, HI_ * DI_});
        add("ki", Shape{N, DI_});
        add("wi", Shape{N, HI_}, false);
        add("ki_mean", Shape{N}, false);
        add("ki_rstd", Shape{N}, false);
        add("idx", Shape{N, index_width(max)}, false, DType::i32);
    }
}

void MlaBlock::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    const int64_t N = max.tokens();
    auto add = [&](const char* name, Shape shape) { specs.push_back({prefix + name, DType::f32, shape}); };
    add("dln", Shape{N, C_});
    add("dhp", Shape{N, Wh_});
    if (RQ_ > 0) {
        add("dcq", Shape{N, RQ_});
        add("dq", Shape{N, H_ * DQ_});
    }
    add("dkv", Shape{N, DK_});
    if (!cfg_.dsa.enabled()) add("dv", Shape{N, DK_});
    if (lora_) {  // every block of the kind shares the first one's scratch: declared for any adapters
        for (const LoraAdapters* l : {&h_lora_, &q_b_lora_, &o_lora_}) l->declare_scratch(specs, prefix, max);
        add("lora.kv_b", Shape{H_ * (DN_ + DV_), RKV_});
        add("lora.dkv_b", Shape{H_ * (DN_ + DV_), RKV_});
    }
    add("dqhat", Shape{N, H_ * DK_});
    add("doc", Shape{N, H_ * oc_width()});
    add("dy", Shape{N, H_ * DV_});
    if (G_ > 0) add("dov", Shape{N, H_ * DV_});
    if (HI_ > 0) {
        add("p", Shape{N, index_width(max)});  // also the indexer's selected scores in forward
        add("dqi", Shape{N, HI_ * DI_});
        add("dki", Shape{N, DI_});
        add("dwi", Shape{N, HI_});
        add("dqi_pre", Shape{N, HI_ * DI_});
        add("dki_pre", Shape{N, DI_});
    }
}

size_t MlaBlock::workspace_bytes(StepShape max, int num_threads) const {
    if (!cfg_.dsa.enabled()) return ops::attention_workspace_bytes(DType::f32, max.tokens(), DK_, num_threads);
    // the DSA ops' scratch (per-thread tiles and candidate lists, the backward slab accumulators) for either
    // layout of a step: B rows of T, or one packed row of B·T tokens (documents)
    const int64_t K = index_width(max);
    size_t ws = 0;
    for (const StepShape f : {StepShape{max.batch, max.seq}, StepShape{1, max.tokens()}}) {
        ws = std::max(
            {ws,
             ops::sparse_attention_workspace_bytes(DType::f32, sparse_params(), f.batch, f.seq, H_, DK_, K,
                                                   num_threads),
             ops::indexer_kl_workspace_bytes(DType::f32, f.batch, f.seq, HI_, DI_, K, cfg_.dsa.dk_slabs, num_threads)});
        if (!cfg_.dsa.warmup())
            ws = std::max(ws, ops::dsa_indexer_workspace_bytes(DType::f32, f.batch, f.seq, HI_, DI_, K, num_threads));
    }
    return ws;
}

ops::SparseAttentionParams MlaBlock::sparse_params() const {
    return {.scale = cfg_.scale(), .dv = RKV_, .dkv_slabs = cfg_.dsa.dk_slabs};
}

void MlaBlock::bind_weights(const BufferGroup& g, Weights& w, bool grad) const {
    auto v = [&](const std::string& name) { return param_view(g, name, grad); };
    const std::string a = prefix_ + "self_attn.";
    std::vector<TensorView> h{v(a + (RQ_ > 0 ? "q_a_proj.weight" : "q_proj.weight")),
                              v(a + "kv_a_proj_with_mqa.weight")};
    if (G_ > 0) h.push_back(v(a + "g_proj.weight"));
    if (HI_ > 0) {
        h.push_back(v(a + "indexer.wk.weight"));
        h.push_back(v(a + "indexer.weights_proj.weight"));
    }
    w.norm = v(prefix_ + "input_layernorm.weight");
    w.h_proj = adjacent(h, C_, prefix_ + "self_attn projections of h");
    if (RQ_ > 0) {
        w.q_norm = v(a + "q_a_layernorm.weight");
        w.q_b = v(a + "q_b_proj.weight");
    }
    w.kv_norm = v(a + "kv_a_layernorm.weight");
    w.kv_b = v(a + "kv_b_proj.weight");
    w.o = v(a + "o_proj.weight");
    if (HI_ > 0) {
        w.iq = v(a + "indexer.wq_b.weight");
        w.ik_norm_w = v(a + "indexer.k_norm.weight");
        w.ik_norm_b = v(a + "indexer.k_norm.bias");
    }
}

void MlaBlock::set_pass(const PassOptions& o) {
    pass_ = o;
    for (LoraAdapters* l : adapters(*this)) l->set_seed(o.lora_seed);  // the training pass's dropout masks
}

void MlaBlock::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    bind_weights(params, w_, false);
    has_grads_ = grads != nullptr;
    if (grads) bind_weights(*grads, g_, true);
    for (LoraAdapters* l : adapters(*this)) l->bind_params(params, grads);
    kv_b_ = w_.kv_b;
}

void MlaBlock::bind_saved(const BufferGroup& acts, const std::string& prefix) {
    auto v = [&](const char* name) {
        return acts.index_of(prefix + name) >= 0 ? acts.view(prefix + name) : TensorView();
    };
    a_ = Acts{v("ln"),      v("rstd"), v("hp"), v("cq"),      v("cq_rstd"), v("q"),    v("kv"),
              v("kv_rstd"), v("qhat"), v("oc"), v("lse"),     v("ov"),      v("gate"), v("y"),
              v("qi"),      v("ki"),   v("wi"), v("ki_mean"), v("ki_rstd"), v("idx")};
}

void MlaBlock::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    auto v = [&](const char* name) {
        return acts.index_of(prefix + name) >= 0 ? acts.view(prefix + name) : TensorView();
    };
    d_ = Scratch{v("dln"), v("dhp"), v("dcq"), v("dq"),  v("dkv"), v("dv"),  v("dqhat"),   v("doc"),
                 v("dy"),  v("dov"), v("p"),   v("dqi"), v("dki"), v("dwi"), v("dqi_pre"), v("dki_pre")};
    kv_b_merged_ = v("lora.kv_b");
    dkv_b_ = v("lora.dkv_b");
    for (LoraAdapters* l : adapters(*this)) l->bind_scratch(acts, prefix);
}

StepShape MlaBlock::flat(StepShape s) const {
    return s.cu_seqlens.empty() ? s : StepShape{1, s.tokens(), s.cu_seqlens};
}

TensorView MlaBlock::q_rows(const Acts& a, int64_t N) const {
    return RQ_ > 0 ? a.q.slice0(0, N) : a.hp.slice0(0, N).columns(0, H_ * DQ_);
}

void MlaBlock::indexer_forward(StepShape s, int64_t pos) {
    const int64_t N = s.tokens();
    TensorView hp = a_.hp.slice0(0, N);
    ops::linear_forward({}, RQ_ > 0 ? a_.cq.slice0(0, N) : a_.ln.slice0(0, N), w_.iq, {}, a_.qi.slice0(0, N));
    ops::layernorm_forward({.eps = cfg_.latent_eps}, hp.columns(col_ik_, DI_), w_.ik_norm_w, w_.ik_norm_b,
                           a_.ki.slice0(0, N), a_.ki_mean.slice0(0, N), a_.ki_rstd.slice0(0, N));
    const float wscale = indexer_weight_scale();
    ops::copy_rows(hp.columns(col_iw_, HI_), a_.wi.slice0(0, N), wscale);
    if (cfg_.dsa.rope_dim > 0) {  // rotate-half pairs on the first d_r^I dims (spec/dsa.md §1.2)
        const ops::RopeParams rope{.theta = cfg_.rope_theta, .offset = pos, .scaling = cfg_.rope_scaling};
        TensorView qr = heads_view(a_.qi.slice0(0, N), s, 0, HI_, DI_, cfg_.dsa.rope_dim);
        TensorView kr = heads_view(a_.ki.slice0(0, N), s, 0, 1, DI_, cfg_.dsa.rope_dim);
        ops::rope_forward(rope, qr, qr);
        ops::rope_forward(rope, kr, kr);
    }
}

void MlaBlock::select(StepShape s, std::span<std::byte> ws) {
    const int64_t N = s.tokens(), K = a_.idx.size(1);
    const StepShape f = flat(s);
    TensorView idx = a_.idx.slice0(0, N).reshape(Shape{f.batch, f.seq, K});
    if (!cfg_.dsa.warmup()) {
        TensorView scores = d_.p.slice0(0, N).reshape(Shape{f.batch, f.seq, K});
        ops::dsa_indexer_forward({.topk = K}, a_.qi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_, DI_}),
                                 a_.ki.slice0(0, N).reshape(Shape{f.batch, f.seq, DI_}),
                                 a_.wi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_}), idx, scores, ws, s.cu_seqlens);
        return;
    }
    ops::dsa_all_candidates(idx, s.cu_seqlens);
}

void MlaBlock::project(StepShape s, int64_t pos, TensorView x) {
    const int64_t N = s.tokens();
    TensorView ln = a_.ln.slice0(0, N), hp = a_.hp.slice0(0, N), kv = a_.kv.slice0(0, N);
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, x, w_.norm, ln, a_.rstd.slice0(0, N));
    ops::linear_forward({}, ln, w_.h_proj, {}, hp);
    h_lora_.forward(ln, hp);
    kv_b_ = kv_b_lora_.merged(w_.kv_b, kv_b_merged_);
    if (RQ_ > 0) {
        ops::rmsnorm_forward({.eps = cfg_.latent_eps}, hp.columns(0, RQ_), w_.q_norm, a_.cq.slice0(0, N),
                             a_.cq_rstd.slice0(0, N));
        ops::linear_forward({}, a_.cq.slice0(0, N), w_.q_b, {}, a_.q.slice0(0, N));
        q_b_lora_.forward(a_.cq.slice0(0, N), a_.q.slice0(0, N));
    }
    TensorView q = q_rows(a_, N);
    ops::rmsnorm_forward({.eps = cfg_.latent_eps}, hp.columns(col_kv_, RKV_), w_.kv_norm, kv.columns(0, RKV_),
                         a_.kv_rstd.slice0(0, N));
    ops::copy_rows(hp.columns(col_kv_ + RKV_, DR_), kv.columns(RKV_, DR_));
    if (cfg_.rope && DR_ > 0) {
        const ops::RopeParams rope{
            .theta = cfg_.rope_theta, .offset = pos, .interleaved = true, .scaling = cfg_.rope_scaling};
        TensorView qr = heads_view(q, s, DN_, H_, DQ_, DR_), kr = heads_view(kv, s, RKV_, 1, DK_, DR_);
        ops::rope_forward(rope, qr, qr);
        ops::rope_forward(rope, kr, kr);
    }
    // absorbed queries: q̂_h = [q^C_h W_UK_h | q^R_h]
    TensorView qhat = a_.qhat.slice0(0, N);
    ops::matmul_heads(Trans::N, Trans::N, 1, ops::head_matrices(q, 0, H_, DQ_, DN_), kv_b_part(kv_b_, false), 0,
                      ops::head_matrices(qhat, 0, H_, DK_, RKV_));
    for (int64_t h = 0; h < H_; ++h) ops::copy_rows(q.columns(h * DQ_ + DN_, DR_), qhat.columns(h * DK_ + RKV_, DR_));
    if (HI_ > 0) indexer_forward(s, pos);
}

void MlaBlock::finish(int64_t N, TensorView x, TensorView x_out) {
    const int64_t OC = oc_width();
    TensorView oc = a_.oc.slice0(0, N);
    // o_h = W_UV_h o^C_h
    TensorView o = G_ > 0 ? a_.ov.slice0(0, N) : a_.y.slice0(0, N);
    ops::matmul_heads(Trans::N, Trans::T, 1, ops::head_matrices(oc, 0, H_, OC, RKV_), kv_b_part(kv_b_, true), 0,
                      ops::head_matrices(o, 0, H_, DV_, DV_));
    if (G_ > 0)
        ops::output_gate_forward(a_.hp.slice0(0, N).columns(col_g_, G_), o, a_.gate.slice0(0, N), a_.y.slice0(0, N));
    start_output(x, x_out, N);
    ops::linear_forward({.accumulate = true}, a_.y.slice0(0, N), w_.o, {}, x_out.slice0(0, N));
    o_lora_.forward(a_.y.slice0(0, N), x_out.slice0(0, N));
}

void MlaBlock::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = s.tokens();
    TensorView x = x_in.slice0(0, N), kv = a_.kv.slice0(0, N), qhat = a_.qhat.slice0(0, N), oc = a_.oc.slice0(0, N);
    project(s, 0, x);
    const StepShape f = flat(s);
    if (!cfg_.dsa.enabled()) {
        const TensorView entry = kv.reshape(Shape{f.batch, f.seq, 1, DK_});
        ops::attention_forward({.scale = cfg_.scale()}, qhat.reshape(Shape{f.batch, f.seq, H_, DK_}), entry, entry,
                               oc.reshape(Shape{f.batch, f.seq, H_, DK_}), a_.lse.prefix(Shape{f.batch, H_, f.seq}), ws,
                               s.cu_seqlens);
    } else {
        select(s, ws);
        ops::sparse_attention_forward(
            sparse_params(), qhat.reshape(Shape{f.batch, f.seq, H_, DK_}), kv.reshape(Shape{f.batch, f.seq, DK_}),
            a_.idx.slice0(0, N).reshape(Shape{f.batch, f.seq, a_.idx.size(1)}),
            oc.reshape(Shape{f.batch, f.seq, H_, RKV_}), a_.lse.prefix(Shape{f.batch, f.seq, H_}), ws);
    }
    finish(N, x, x_out);
}

void MlaBlock::declare_cache(std::vector<BufferSpec>& specs,
                             const std::string& prefix,
                             int64_t batch,
                             int64_t max_len) const {
    specs.push_back({prefix + "entries", DType::f32, Shape{batch, max_len, DK_}});
    if (HI_ == 0) return;
    specs.push_back({prefix + "index_keys", DType::f32, Shape{batch, max_len, DI_}});
    specs.push_back({prefix + "rows", DType::i32, Shape{batch, cfg_.dsa.topk}});  // each step's selection
}

void MlaBlock::bind_cache(const BufferGroup& cache, const std::string& prefix) {
    entries_ = cache.view(prefix + "entries");
    if (HI_ == 0) return;
    index_keys_ = cache.view(prefix + "index_keys");
    rows_ = cache.view(prefix + "rows");
}

void MlaBlock::step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte>) {
    const int64_t L = entries_.size(1), OC = oc_width();
    TESSERA_CHECK(pos < L, "{}: position {} is past the {}-token cache", prefix_, pos, L);
    TensorView x = x_in.slice0(0, batch);
    project(StepShape{batch, 1}, pos, x);
    const TensorView entries = entries_.slice0(0, batch);
    ops::copy_rows(a_.kv.slice0(0, batch), cache_rows(entries_, batch, pos));
    TensorView rows;  // the indexer's top-k over the cached keys (the same total order as dsa_indexer), or every row
    if (HI_ > 0) {
        ops::copy_rows(a_.ki.slice0(0, batch), cache_rows(index_keys_, batch, pos));
        rows = rows_.slice0(0, batch);
        ops::cached_index_topk(a_.qi.slice0(0, batch).reshape(Shape{batch, HI_, DI_}), a_.wi.slice0(0, batch),
                               index_keys_.slice0(0, batch), pos + 1, rows);
    }
    const TensorView oc = a_.oc.slice0(0, batch);
    ops::cached_attention(cfg_.scale(), a_.qhat.slice0(0, batch).reshape(Shape{batch, H_, DK_}),
                          entries.reshape(Shape{batch, L, 1, DK_}),
                          strided(entries, Shape{batch, L, 1, RKV_}, {L * DK_, DK_, DK_, 1}), rows, pos + 1,
                          strided(oc, Shape{batch, H_, RKV_}, {oc.strides[0], OC, 1}));
    finish(batch, x, x_out);
}

void MlaBlock::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) {
    TESSERA_CHECK(has_grads_, "{}: backward without gradient buffers", prefix_);
    const int64_t N = s.tokens(), OC = oc_width();
    const StepShape f = flat(s);
    TensorView d = dres.slice0(0, N), hp = a_.hp.slice0(0, N), dhp = d_.dhp.slice0(0, N);
    ops::zero_rows(d_.dy, N);
    ops::linear_backward(d, a_.y.slice0(0, N), w_.o, d_.dy.slice0(0, N), g_.o, {});
    o_lora_.backward(a_.y.slice0(0, N), d, d_.dy.slice0(0, N));
    // kv_b_proj as the forward used it (another block may have merged its own into the shared scratch since), and
    // where its gradient goes: its own buffer, the scratch its adapter's gradients come from, or nowhere (frozen)
    kv_b_ = kv_b_lora_.merged(w_.kv_b, kv_b_merged_);
    TensorView dkv_b = g_.kv_b;
    if (!kv_b_lora_.empty()) {
        dkv_b = dkv_b_.prefix(w_.kv_b.shape);
        ops::zero_rows(dkv_b, dkv_b.size(0));
    }
    ops::zero_rows(d_.dhp, N);
    TensorView dov = d_.dy.slice0(0, N);
    if (G_ > 0) {
        ops::output_gate_backward(dov, a_.ov.slice0(0, N), a_.gate.slice0(0, N), d_.dov.slice0(0, N),
                                  dhp.columns(col_g_, G_));
        dov = d_.dov.slice0(0, N);
    }
    // do^C_h = dô_h W_UV_h;  dW_UV_h += dô_hᵀ o^C_h
    TensorView oc = a_.oc.slice0(0, N), doc = d_.doc.slice0(0, N);
    ops::zero_rows(d_.doc, N);
    const TensorView dov_h = ops::head_matrices(dov, 0, H_, DV_, DV_), oc_h = ops::head_matrices(oc, 0, H_, OC, RKV_);
    ops::matmul_heads(Trans::N, Trans::N, 1, dov_h, kv_b_part(kv_b_, true), 0,
                      ops::head_matrices(doc, 0, H_, OC, RKV_));
    if (dkv_b.defined())
        ops::matmul_heads(Trans::T, Trans::N, 1, dov_h, oc_h, 1, kv_b_part(dkv_b, true));  // else frozen
    TensorView qhat = a_.qhat.slice0(0, N), dqhat = d_.dqhat.slice0(0, N), kv = a_.kv.slice0(0, N),
               dkv = d_.dkv.slice0(0, N);
    ops::zero_rows(d_.dqhat, N);
    ops::zero_rows(d_.dkv, N);
    if (!cfg_.dsa.enabled()) {
        ops::zero_rows(d_.dv, N);
        const TensorView entry = kv.reshape(Shape{f.batch, f.seq, 1, DK_});
        ops::attention_backward({.scale = cfg_.scale()}, doc.reshape(Shape{f.batch, f.seq, H_, DK_}),
                                qhat.reshape(Shape{f.batch, f.seq, H_, DK_}), entry, entry,
                                oc.reshape(Shape{f.batch, f.seq, H_, DK_}), a_.lse.prefix(Shape{f.batch, H_, f.seq}),
                                dqhat.reshape(Shape{f.batch, f.seq, H_, DK_}),
                                dkv.reshape(Shape{f.batch, f.seq, 1, DK_}),
                                d_.dv.slice0(0, N).reshape(Shape{f.batch, f.seq, 1, DK_}), ws, s.cu_seqlens);
        ops::add_rows(d_.dv.slice0(0, N), dkv);  // the entry is key and value
    } else {
        ops::sparse_attention_backward(
            sparse_params(), doc.reshape(Shape{f.batch, f.seq, H_, RKV_}), qhat.reshape(Shape{f.batch, f.seq, H_, DK_}),
            kv.reshape(Shape{f.batch, f.seq, DK_}), a_.idx.slice0(0, N).reshape(Shape{f.batch, f.seq, a_.idx.size(1)}),
            oc.reshape(Shape{f.batch, f.seq, H_, RKV_}), a_.lse.prefix(Shape{f.batch, f.seq, H_}),
            dqhat.reshape(Shape{f.batch, f.seq, H_, DK_}), dkv.reshape(Shape{f.batch, f.seq, DK_}), ws);
    }
    // q̂ -> q: dq^C_h = dq̂_h[:r_kv] W_UK_hᵀ, dW_UK_h += q^C_hᵀ dq̂_h[:r_kv], dq^R = rope⁻¹(dq̂_h[r_kv:])
    TensorView q = q_rows(a_, N);
    TensorView dq = RQ_ > 0 ? d_.dq.slice0(0, N) : dhp.columns(0, H_ * DQ_);
    if (RQ_ > 0) ops::zero_rows(d_.dq, N);
    const TensorView dqhat_h = ops::head_matrices(dqhat, 0, H_, DK_, RKV_);
    ops::matmul_heads(Trans::N, Trans::T, 1, dqhat_h, kv_b_part(kv_b_, false), 0,
                      ops::head_matrices(dq, 0, H_, DQ_, DN_));
    if (dkv_b.defined())
        ops::matmul_heads(Trans::T, Trans::N, 1, ops::head_matrices(q, 0, H_, DQ_, DN_), dqhat_h, 1,
                          kv_b_part(dkv_b, false));
    kv_b_lora_.backward_from_weight(dkv_b);
    TensorView dkr = dhp.columns(col_kv_ + RKV_, DR_);
    if (cfg_.rope && DR_ > 0) {
        const ops::RopeParams rope{.theta = cfg_.rope_theta, .interleaved = true, .scaling = cfg_.rope_scaling};
        ops::rope_backward(rope, heads_view(dqhat, s, RKV_, H_, DK_, DR_), heads_view(dq, s, DN_, H_, DQ_, DR_));
        ops::rope_backward(rope, heads_view(dkv, s, RKV_, 1, DK_, DR_), heads_view(dkr, s, 0, 1, DR_, DR_));
    } else {
        for (int64_t h = 0; h < H_; ++h)
            ops::copy_rows(dqhat.columns(h * DK_ + RKV_, DR_), dq.columns(h * DQ_ + DN_, DR_));
        ops::copy_rows(dkv.columns(RKV_, DR_), dkr);
    }
    ops::rmsnorm_backward({.eps = cfg_.latent_eps}, dkv.columns(0, RKV_), hp.columns(col_kv_, RKV_), w_.kv_norm,
                          a_.kv_rstd.slice0(0, N), dhp.columns(col_kv_, RKV_), g_.kv_norm);
    if (RQ_ > 0) {
        ops::zero_rows(d_.dcq, N);
        ops::linear_backward(dq, a_.cq.slice0(0, N), w_.q_b, d_.dcq.slice0(0, N), g_.q_b, {});
        q_b_lora_.backward(a_.cq.slice0(0, N), dq, d_.dcq.slice0(0, N));
        ops::rmsnorm_backward({.eps = cfg_.latent_eps}, d_.dcq.slice0(0, N), hp.columns(0, RQ_), w_.q_norm,
                              a_.cq_rstd.slice0(0, N), dhp.columns(0, RQ_), g_.q_norm);
    }
    // the LM loss reaches h through the main projections only; the indexer learns from its KL
    ops::zero_rows(d_.dln, N);
    auto rows_of = [&](TensorView w, int64_t r0, int64_t r1) { return w.defined() ? w.slice0(r0, r1) : TensorView{}; };
    ops::linear_backward(dhp.columns(0, Wmain_), a_.ln.slice0(0, N), rows_of(w_.h_proj, 0, Wmain_), d_.dln.slice0(0, N),
                         rows_of(g_.h_proj, 0, Wmain_), {});
    h_lora_.backward(a_.ln.slice0(0, N), dhp, d_.dln.slice0(0, N));
    if (HI_ > 0) indexer_backward(s, ws);
    start_input_grad(dres, N);
    ops::rmsnorm_backward({.eps = cfg_.norm_eps}, d_.dln.slice0(0, N), x_in.slice0(0, N), w_.norm, a_.rstd.slice0(0, N),
                          d, g_.norm);
}

double MlaBlock::indexer_backward(StepShape s, std::span<std::byte> ws) {
    TESSERA_CHECK(has_grads_ && HI_ > 0, "{}: indexer_backward needs an indexer and gradient buffers", prefix_);
    const int64_t N = s.tokens(), K = a_.idx.size(1);
    const StepShape f = flat(s);
    TensorView idx = a_.idx.slice0(0, N).reshape(Shape{f.batch, f.seq, K});
    TensorView p = d_.p.slice0(0, N).reshape(Shape{f.batch, f.seq, K});
    // teacher: the head mean of this layer's attention probabilities over the same support (constant)
    ops::sparse_attention_probs(sparse_params(), a_.qhat.slice0(0, N).reshape(Shape{f.batch, f.seq, H_, DK_}),
                                a_.kv.slice0(0, N).reshape(Shape{f.batch, f.seq, DK_}), idx,
                                a_.lse.prefix(Shape{f.batch, f.seq, H_}), p, ws);
    if (head_group_) {  // this rank's heads' mean -> the mean over the group's (equal head counts), in rank order
        head_group_->all_reduce(DType::f32, p.data, N * K);
        const TensorView rows = p.reshape(Shape{N, K});
        ops::copy_rows(rows, rows, float(1.0 / head_group_->size()));
    }
    ops::zero_rows(d_.dqi, N);
    ops::zero_rows(d_.dki, N);
    ops::zero_rows(d_.dwi, N);
    const ops::IndexerKlResult r = ops::indexer_kl(
        a_.qi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_, DI_}),
        a_.ki.slice0(0, N).reshape(Shape{f.batch, f.seq, DI_}), a_.wi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_}),
        p, idx, s.cu_seqlens, cfg_.dsa.kl_coeff * pass_.loss_scale,
        d_.dqi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_, DI_}),
        d_.dki.slice0(0, N).reshape(Shape{f.batch, f.seq, DI_}),
        d_.dwi.slice0(0, N).reshape(Shape{f.batch, f.seq, HI_}), ws, cfg_.dsa.dk_slabs);
    stats_.kl += r.loss;
    stats_.passes += 1;
    // undo the rotation on the first d_r^I dims; the rest passes through
    TensorView dqi = d_.dqi.slice0(0, N), dki = d_.dki.slice0(0, N);
    TensorView dqi_pre = d_.dqi_pre.slice0(0, N), dki_pre = d_.dki_pre.slice0(0, N);
    ops::copy_rows(dqi, dqi_pre);
    ops::copy_rows(dki, dki_pre);
    const int64_t RI = cfg_.dsa.rope_dim;
    if (RI > 0) {
        const ops::RopeParams rope{.theta = cfg_.rope_theta, .scaling = cfg_.rope_scaling};
        for (int64_t j = 0; j < HI_; ++j) ops::zero_rows(dqi_pre.columns(j * DI_, RI), N);
        ops::zero_rows(dki_pre.columns(0, RI), N);
        ops::rope_backward(rope, heads_view(dqi, s, 0, HI_, DI_, RI), heads_view(dqi_pre, s, 0, HI_, DI_, RI));
        ops::rope_backward(rope, heads_view(dki, s, 0, 1, DI_, RI), heads_view(dki_pre, s, 0, 1, DI_, RI));
    }
    // inputs detached: only weight gradients
    TensorView hp = a_.hp.slice0(0, N), dhp = d_.dhp.slice0(0, N), ln = a_.ln.slice0(0, N);
    ops::linear_backward(dqi_pre, RQ_ > 0 ? a_.cq.slice0(0, N) : ln, w_.iq, {}, g_.iq, {});
    TensorView dk_raw = dhp.columns(col_ik_, DI_), dw_raw = dhp.columns(col_iw_, HI_);
    ops::zero_rows(dk_raw, N);
    ops::layernorm_backward({.eps = cfg_.latent_eps}, dki_pre, hp.columns(col_ik_, DI_), w_.ik_norm_w,
                            a_.ki_mean.slice0(0, N), a_.ki_rstd.slice0(0, N), dk_raw, g_.ik_norm_w, g_.ik_norm_b);
    const float wscale = indexer_weight_scale();
    ops::copy_rows(d_.dwi.slice0(0, N), dw_raw, wscale);
    const TensorView wrows = w_.h_proj.slice0(Wmain_, Wh_);
    const TensorView grows = g_.h_proj.defined() ? g_.h_proj.slice0(Wmain_, Wh_) : TensorView{};  // frozen
    ops::linear_backward(dhp.columns(Wmain_, Wh_ - Wmain_), ln, wrows, {}, grows, {});
    return r.loss;
}

DsaLayerStats MlaBlock::take_stats() {
    DsaLayerStats out = stats_;
    if (out.passes > 0) out.kl /= double(out.passes);
    stats_ = {};
    return out;
}

double MlaBlock::lora_flops() const {
    double f = 0;  // kv_b_proj's merge is per step, not per token: not counted
    for (const LoraAdapters* l : {&h_lora_, &q_b_lora_, &o_lora_}) f += l->forward_flops_per_token();
    return f;
}

double MlaBlock::forward_flops_per_token(int64_t seq) const {
    const double proj = 2.0 * double(C_) * double(Wh_) + 2.0 * double(RQ_) * double(H_ * DQ_) +
                        2.0 * double(H_) * double(DN_ + DV_) * double(RKV_) + 2.0 * double(H_ * DV_) * double(C_) +
                        (HI_ > 0 ? 2.0 * double(RQ_ > 0 ? RQ_ : C_) * double(HI_ * DI_) : 0.0) + lora_flops();
    if (!cfg_.dsa.enabled()) {  // MQA over the entries: scores D_k and values D_k (the last d_r discarded)
        return proj + ops::attention_forward_flops(1, seq, H_, DK_, true) / double(seq);
    }
    // selected pairs per query averaged over the sequence, plus the indexer's causal scoring
    const double k = double(cfg_.dsa.warmup() ? seq : std::min(cfg_.dsa.topk, seq));
    const double pairs = cfg_.dsa.warmup() ? (double(seq) + 1) / 2 : k - k * (k - 1) / (2.0 * double(seq));
    const double scoring = cfg_.dsa.warmup() ? 0.0 : double(HI_ * DI_) * (double(seq) + 1);
    return proj + ops::sparse_attention_flops(1, H_, DK_, RKV_) * pairs + scoring;
}

}  // namespace tessera::model
