// Decoder model: composition of blocks, the fused chunked head + loss, parameter initialisation.
#include "model/model.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

#include "core/device.h"
#include "core/mxfp4.h"
#include "core/rng.h"
#include "core/trace.h"
#include "model/layers/attention_block.h"
#include "model/layers/kda_block.h"
#include "model/layers/mla_block.h"
#include "model/layers/mlp_block.h"
#include "model/layers/moe_block.h"
#include "model/layers/tensor_slice.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rows.h"

namespace tessera::model {

namespace {
const std::string kEmbed = "model.embed_tokens.weight";
const std::string kNormF = "model.norm.weight";
const std::string kHead = "lm_head.weight";

// who uses a parameter (its FSDP unit): a block's index, or one of these
constexpr int kEmbedOwner = -1, kHeadOwner = -2, kBetweenBlocks = -3, kVisionOwner = -4;

std::string saved_prefix(int64_t block, const Block& b) { return fmt::format("saved.{}.{}.", block, b.kind()); }
std::string shared_prefix(const Block& b) { return "recompute." + b.kind() + "."; }
std::string scratch_prefix(const Block& b) { return "scratch." + b.kind() + "."; }
}  // namespace

const char* pipeline_obstacle(const ModelConfig& c) {
    return c.tie_embeddings             ? "model.tie_embeddings (the embedding is the head)"
           : c.attn_res_block_size > 0  ? "model.attn_res_block_size (Attention Residuals mix every earlier block's "
                                          "output)"
           : c.vision.enabled()         ? "model.vision (the image tower)"
           : c.moe.global_aux_coeff > 0 ? "model.moe.global_aux_coeff (the balance loss pools every MoE layer)"
                                        : nullptr;
}

const char* tensor_obstacle(const ModelConfig& c) {
    if (c.has_layer_type("dsa") && c.mla.dsa.warmup())
        return "model.mla.dsa.stage = \"dense_warmup\" (the indexer's dense KL; the sparse stage is covered)";
    return c.lora.dropout > 0           ? "model.lora.dropout (its masks are drawn per row and column of the whole "
                                          "micro-batch)"
           : c.moe.seq_aux_coeff > 0    ? "model.moe.seq_aux_coeff (the balance loss of whole sequences)"
           : c.moe.global_aux_coeff > 0 ? "model.moe.global_aux_coeff (the balance loss pools every token)"
                                        : nullptr;
}

ModelConfig tensor_part(const ModelConfig& c, int64_t T) {
    ModelConfig p = c;
    p.head_dim = c.head_dim_or_default();
    p.n_heads = c.n_heads / T;
    p.n_kv_heads = c.n_kv_heads / T;
    p.kda.num_heads = c.kda.num_heads / T;
    p.kda.num_v_heads = c.kda.hv() / T;
    return p;
}

Model::Model(
    ModelConfig cfg, parallel::Comm* expert_group, int64_t ep_chunks, LayerRange layers, parallel::Comm* tensor_group)
    : cfg_(std::move(cfg)), layers_(layers) {
    cfg_.validate("model");
    if (layers_.last < 0) layers_.last = cfg_.n_layers;
    TESSERA_CHECK(layers_.first >= 0 && layers_.first < layers_.last && layers_.last <= cfg_.n_layers,
                  "model: a pipeline stage of layers [{}, {}) of {}", layers_.first, layers_.last, cfg_.n_layers);
    if (!first_stage() || !last_stage()) {
        const char* crossing = pipeline_obstacle(cfg_);
        TESSERA_CHECK(!crossing, "pipeline stages (parallel.pipeline) cannot split a model with {}; use one stage",
                      crossing);
    }
    if (tensor_group && tensor_group->size() > 1) {
        tensor_ = tensor_group;
        T_ = tensor_group->size();
        t_ = tensor_group->rank();
        const char* obstacle = tensor_obstacle(cfg_);
        TESSERA_CHECK(!obstacle, "tensor parallelism (parallel.tensor = {}) does not cover {}; use parallel.tensor = 1",
                      T_, obstacle);
        TESSERA_CHECK(first_stage() && last_stage(),
                      "tensor parallelism (parallel.tensor = {}) with pipeline stages is not supported yet", T_);
    }
    // an attention block over all heads (make(whole)), or with tensor parallelism one over this rank's 1/T of them
    // (make(part)) inside a TensorSlice; heads: the counts the slice divides, for the error
    auto sliced = [&](auto make, const auto& whole, const auto& part,
                      std::initializer_list<std::pair<const char*, int64_t>> heads) -> std::unique_ptr<Block> {
        sliced_.push_back(T_ > 1);
        std::unique_ptr<Block> all = make(whole);
        if (T_ == 1) return all;
        for (auto [what, n] : heads)
            TESSERA_CHECK(n % T_ == 0, "parallel.tensor = {} does not divide {} = {}", T_, what, n);
        std::unique_ptr<Block> some = make(part);  // (made last: the block that computes)
        return std::make_unique<TensorSlice>(std::move(all), std::move(some), *tensor_, cfg_.d_model);
    };
    const ModelConfig part = tensor_part(cfg_, T_);  // (its attention blocks: this rank's parts)
    const int embed_owner = cfg_.tie_embeddings ? kHeadOwner : kEmbedOwner;
    std::vector<int> owner;
    auto owned = [&](int who) { owner.resize(param_specs_.size(), who); };
    const ParamInit w = ParamInit::normal(cfg_.init_std);
    if (first_stage()) add_param(param_specs_, inits_, kEmbed, Shape{cfg_.vocab_size, cfg_.d_model}, w, true);
    owned(embed_owner);
    if (last_stage()) {
        add_param(param_specs_, inits_, kNormF, Shape{cfg_.d_model}, ParamInit::constant(1.0), false);
        if (!cfg_.tie_embeddings) add_param(param_specs_, inits_, kHead, Shape{cfg_.vocab_size, cfg_.d_model}, w, true);
    }
    owned(kHeadOwner);
    for (int64_t i = layers_.first; i < layers_.last; ++i) {
        const std::string prefix = fmt::format("model.layers.{}.", i);
        const std::string& type = cfg_.layer_type(i);
        if (type == "mla" || type == "dsa") {
            const MlaConfig m = cfg_.mla_layer(type == "dsa");
            MlaBlock* computes = nullptr;  // the block over every head, or over this rank's (its indexer whole)
            blocks_.push_back(sliced(
                [&](const MlaConfig& c) {
                    auto b = std::make_unique<MlaBlock>(c, prefix, cfg_.lora);
                    computes = b.get();
                    return b;
                },
                m, part.mla_layer(type == "dsa"), {{"model.n_heads", m.num_heads}}));
            if (T_ > 1) computes->share_heads(tensor_);
            if (type == "dsa") dsa_.push_back({i, computes, blocks_.size() - 1});
        } else if (type == "kda" || type == "gdn") {
            const KdaConfig k = cfg_.kda_layer(type == "gdn");
            blocks_.push_back(
                sliced([&](const KdaConfig& c) { return std::make_unique<KdaBlock>(c, prefix, cfg_.lora); }, k,
                       part.kda_layer(type == "gdn"), {{"kda.num_heads", k.num_heads}, {"kda.num_v_heads", k.hv()}}));
        } else {
            blocks_.push_back(sliced([&](const ModelConfig& c) { return std::make_unique<AttentionBlock>(c, prefix); },
                                     cfg_, part,
                                     {{"model.n_heads", cfg_.n_heads}, {"model.n_kv_heads", cfg_.n_kv_heads}}));
        }
        if (cfg_.moe.is_moe_layer(i)) {
            auto moe = std::make_unique<MoeBlock>(cfg_, prefix, expert_group, ep_chunks);
            moe_.push_back({i, moe.get()});
            blocks_.push_back(std::move(moe));
        } else {
            blocks_.push_back(std::make_unique<MlpBlock>(cfg_, prefix));
        }
        sliced_.push_back(false);
    }
    for (size_t j = 0; j < blocks_.size(); ++j) {
        blocks_[j]->declare_params(param_specs_, inits_);
        block_kinds_.push_back(blocks_[j]->kind());
        owned(int(j));
    }
    if (cfg_.attn_res_block_size > 0) {
        attn_res_ = std::make_unique<AttnRes>(cfg_.n_layers, cfg_.attn_res_block_size, cfg_.d_model, cfg_.norm_eps,
                                              cfg_.init_std);
        attn_res_->declare_params(param_specs_, inits_);
        owned(kBetweenBlocks);
        for (auto& b : blocks_) b->set_residual(false);
    }
    if (cfg_.vision.enabled()) {  // frozen (forward only) and whole on every rank
        vision_ = std::make_unique<VisionTower>(cfg_.vision);
        const size_t first = param_specs_.size();
        vision_->declare_params(param_specs_, inits_);
        for (size_t i = first; i < param_specs_.size(); ++i) {
            param_specs_[i].trainable = false;
            param_specs_[i].sharding = Sharding::replicated;
        }
        owned(kVisionOwner);
    }
    if (cfg_.lora.enabled()) freeze_base();
    for (auto& b : blocks_) {
        if (auto* slice = dynamic_cast<TensorSlice*>(b.get())) slice->held_as(param_specs_);
    }
    // frozen parameters first, then the flat space the optimizer trains, [replicated | data | expert]
    // (train/optimizer.h), each unit's data contiguous
    std::vector<size_t> order(param_specs_.size());
    std::iota(order.begin(), order.end(), size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        const BufferSpec &x = param_specs_[a], &y = param_specs_[b];
        return std::pair(x.trainable, x.sharding) < std::pair(y.trainable, y.sharding);
    });
    std::vector<BufferSpec> specs;
    std::vector<ParamInit> inits;
    std::vector<int> owners;
    for (size_t i : order) {
        specs.push_back(param_specs_[i]);
        inits.push_back(inits_[i]);
        owners.push_back(owner[i]);
    }
    param_specs_ = std::move(specs);
    inits_ = std::move(inits);
    frozen_ = size_t(std::count_if(param_specs_.begin(), param_specs_.end(), [](auto& s) { return !s.trainable; }));
    trained_specs_.assign(param_specs_.begin() + std::ptrdiff_t(frozen_), param_specs_.end());
    make_units(owners);
    if (indexer_warmup()) {
        for (const auto& spec : trained_specs_) trainable_mask_.push_back(trainable(spec.name));
    }
}

void Model::freeze_base() {
    // a parameter trains when a module on its path is in modules_to_save (PEFT trains such modules whole)
    auto saved = [&](const std::string& name) {
        for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
            if (LoraConfig::names(cfg_.lora.modules_to_save, name.substr(0, dot))) return true;
        }
        return false;
    };
    auto held = [](const std::string& d) {
        return d == "bf16" ? DType::bf16 : d == "mxfp4" ? DType::mxfp4 : DType::f32;
    };
    const DType base = held(cfg_.lora.base_dtype), experts = held(cfg_.lora.expert_dtype);
    for (BufferSpec& s : param_specs_) {
        if (is_vision_param(s.name)) {
            TESSERA_CHECK(!saved(s.name),
                          "model.lora.modules_to_save names {}: the image tower and projector stay frozen (their "
                          "backward is not built)",
                          s.name);
            if (s.narrowable && base == DType::bf16) s.dtype = base;  // its GEMM weights, as the base's
            continue;
        }
        s.trainable = is_adapter(s.name) || saved(s.name);
        if (s.trainable || !s.narrowable || s.sharding == Sharding::replicated) continue;
        s.dtype = s.sharding == Sharding::expert ? experts : base;
        TESSERA_CHECK(s.dtype != DType::mxfp4 || s.shape[s.shape.ndim - 1] % kMxfp4Block == 0,
                      "model.lora.expert_dtype = \"mxfp4\": the routed experts' {} has rows of {} values, not whole "
                      "blocks of 32",
                      s.name, s.shape[s.shape.ndim - 1]);
    }
    // as PEFT: an error when no name matches (a list may name modules of several families)
    const bool adapted = std::any_of(param_specs_.begin(), param_specs_.end(),
                                     [](auto& s) { return s.name.ends_with(".lora_A.weight"); });
    TESSERA_CHECK(adapted || cfg_.lora.target_modules.empty(),
                  "model.lora.target_modules: no name in {} names a projection of this model that takes adapters "
                  "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, ...: docs/model.md, LoRA)",
                  Json(cfg_.lora.target_modules).dump());
    for (const std::string& m : cfg_.lora.modules_to_save) {
        bool any = false;
        for (const BufferSpec& s : param_specs_) {
            for (size_t dot = s.name.find('.'); dot != std::string::npos && !any; dot = s.name.find('.', dot + 1))
                any = LoraConfig::names({m}, s.name.substr(0, dot));
        }
        TESSERA_CHECK(any, "model.lora.modules_to_save: \"{}\" names no module of this model", m);
    }
}

void Model::make_units(const std::vector<int>& owner) {
    block_unit_.assign(blocks_.size(), -1);
    embed_unit_ = head_unit_ = -1;
    for (size_t i = 0; i < param_specs_.size(); ++i) {
        if (param_specs_[i].sharding != Sharding::data || !param_specs_[i].trainable) continue;
        const int who = owner[i];
        if (!units_.empty() && units_.back().last == i && owner[units_.back().first] == who) {
            units_.back().last = i + 1;
            continue;
        }
        const int u = int(units_.size());
        int& unit = who == kEmbedOwner ? embed_unit_ : who == kHeadOwner ? head_unit_ : block_unit_.at(size_t(who));
        TESSERA_CHECK(unit == -1, "model: the parameters of one block are not adjacent ({})", param_specs_[i].name);
        unit = u;
        units_.push_back({.first = i, .last = i + 1, .slot = who >= 0 ? 1 + who % 2 : 0});
    }
    // a block's frozen dense parameters (the base under LoRA) join its unit: FSDP shards and gathers them too
    for (size_t i = 0; i < frozen_; ++i) {
        if (param_specs_[i].sharding != Sharding::data) continue;
        const int who = owner[i];
        int& unit = who == kEmbedOwner ? embed_unit_ : who == kHeadOwner ? head_unit_ : block_unit_.at(size_t(who));
        if (unit < 0) {  // nothing of it trains: a unit of frozen parameters only
            unit = int(units_.size());
            units_.push_back({.first = i, .last = i, .slot = who >= 0 ? 1 + who % 2 : 0});
        }
        ParamUnit& u = units_.at(size_t(unit));
        if (u.frozen_first == u.frozen_last) u.frozen_first = u.frozen_last = i;
        TESSERA_CHECK(u.frozen_last == i, "model: the frozen parameters of one block are not adjacent ({})",
                      param_specs_[i].name);
        u.frozen_last = i + 1;
    }
    for (size_t i = 0; i < param_specs_.size(); ++i) {  // each MoE block's experts join its unit
        if (param_specs_[i].sharding != Sharding::expert || !param_specs_[i].trainable) continue;
        int& unit = block_unit_.at(size_t(owner[i]));
        if (unit < 0) {  // only its experts train (their adapters): a unit without dense parameters
            unit = int(units_.size());
            units_.push_back({.first = i, .last = i, .slot = 1 + owner[i] % 2});
        }
        ParamUnit& u = units_.at(size_t(block_unit_.at(size_t(owner[i]))));
        if (u.expert_first == u.expert_last) u.expert_first = u.expert_last = i;
        TESSERA_CHECK(u.expert_last == i, "model: the experts of one block are not adjacent ({})",
                      param_specs_[i].name);
        u.expert_last = i + 1;
    }
    for (size_t i = 0; i < frozen_; ++i) {  // and its frozen experts (FSDP cuts them over expert-data replicas)
        if (param_specs_[i].sharding != Sharding::expert) continue;
        int& unit = block_unit_.at(size_t(owner[i]));
        if (unit < 0) {  // nothing of it trains
            unit = int(units_.size());
            units_.push_back({.first = i, .last = i, .slot = 1 + owner[i] % 2});
        }
        ParamUnit& u = units_.at(size_t(unit));
        if (u.frozen_expert_first == u.frozen_expert_last) u.frozen_expert_first = u.frozen_expert_last = i;
        TESSERA_CHECK(u.frozen_expert_last == i, "model: the frozen experts of one block are not adjacent ({})",
                      param_specs_[i].name);
        u.frozen_expert_last = i + 1;
    }
    if (cfg_.tie_embeddings) embed_unit_ = head_unit_;
    // the passes' visits, in the order forward_loss / forward_backward make them (a unit -1: no parameters of its own
    // in the flat spaces FSDP shards)
    auto add = [](std::vector<UnitVisit>& plan, int unit, bool backward) {
        if (unit >= 0) plan.push_back({unit, backward});
    };
    eval_plan_.clear();
    add(eval_plan_, embed_unit_, false);
    for (int u : block_unit_) add(eval_plan_, u, false);
    train_plan_ = eval_plan_;
    add(eval_plan_, head_unit_, false);
    add(train_plan_, head_unit_, true);
    for (size_t j = blocks_.size(); j-- > 0;) add(train_plan_, block_unit_[j], true);
    add(train_plan_, embed_unit_, true);
    warmup_plan_ = eval_plan_;
    for (auto it = dsa_.rbegin(); it != dsa_.rend(); ++it) add(warmup_plan_, block_unit_[it->block], true);
    // a pipeline stage's backward without its forward re-run: the training passes' backward visits only
    backward_plan_.assign(train_plan_.begin() + long(eval_plan_.size() - (head_unit_ >= 0 ? 1 : 0)), train_plan_.end());
    warmup_backward_plan_.assign(warmup_plan_.begin() + long(eval_plan_.size()), warmup_plan_.end());
}

template <class F>
void Model::visit(int unit, bool backward, F&& f, std::string_view name, int64_t layer) {
    const bool held = hooks_ && unit >= 0;  // -1: frozen, nothing to gather
    if (held) {
        trace::Span wait("params in", "wait", layer);  // FSDP's gather, the weight budget's paging
        hooks_->enter({unit, backward});
    }
    trace::Span span(name, backward ? "backward" : "forward", layer);
    f();
    if (held) hooks_->leave({unit, backward});
}

void Model::begin_pass(const std::vector<UnitVisit>& plan) {
    if (hooks_) hooks_->begin(plan);
}

void Model::end_pass() {
    if (hooks_) hooks_->end();
}

Model::~Model() = default;

std::pair<int64_t, int64_t> Model::local_experts() const {
    return moe_.empty() ? std::pair{int64_t(0), cfg_.moe.experts} : moe_.front().second->local_experts();
}

int64_t Model::num_params() const {
    int64_t n = 0;
    for (auto& s : param_specs_) n += s.shape.numel();
    return n;
}

int64_t Model::head_chunk_rows(int64_t tokens) const {
    // NOTES: at most ~32M logits per chunk (128 MB), at least 128 rows for GEMM efficiency.
    return std::min<int64_t>(tokens, std::max<int64_t>(128, (int64_t(1) << 25) / cfg_.vocab_size));
}

std::vector<bool> Model::recomputed_blocks(const Recompute& recompute) const {
    std::vector<bool> out(block_kinds_.size(), false);
    std::vector<std::string> seen;  // kinds already met walking backwards: their shared set is stale
    for (size_t jj = block_kinds_.size(); jj-- > 0;) {
        const bool later = std::find(seen.begin(), seen.end(), block_kinds_[jj]) != seen.end();
        out[jj] = later && recompute.covers(block_kinds_[jj]);
        if (!later) seen.push_back(block_kinds_[jj]);
    }
    return out;
}

size_t Model::last_of_kind(size_t j) const {
    size_t last = j;
    for (size_t k = j + 1; k < block_kinds_.size(); ++k)
        if (block_kinds_[k] == block_kinds_[j]) last = k;
    return last;
}

void Model::set_activation_dtype(DType dtype) {
    TESSERA_CHECK(dtype == DType::f32 || dtype == DType::bf16, "train.activation_dtype: {} (f32 or bf16)",
                  dtype_name(dtype));
    activation_dtype_ = dtype;
}

std::vector<bool> Model::narrowed_blocks(const Recompute& recompute) const {
    std::vector<bool> out(block_kinds_.size(), false);
    if (activation_dtype_ == DType::f32) return out;
    for (size_t j = 0; j < out.size(); ++j) out[j] = !recompute.covers(block_kinds_[j]) && last_of_kind(j) != j;
    return out;
}

void Model::narrow_saved(size_t j, bool back) {
    for (const auto& [saved, copy] : narrow_[j]) {
        if (!copy.defined()) {
            if (!back) ops::round_to_bf16(saved);
        } else if (back) {
            ops::cast(copy, saved);
        } else {
            ops::cast(saved, copy);
        }
    }
}

void Model::check_split(int64_t N) const {
    TESSERA_CHECK(N % T_ == 0, "parallel.tensor = {}: a micro-batch of {} tokens does not split into {} equal parts",
                  T_, N, T_);
}

StepShape Model::block_shape(size_t j, StepShape s) const {
    return T_ == 1 || sliced_[j] ? s : StepShape{1, s.tokens() / T_};
}

std::vector<BufferSpec> Model::activation_specs(StepShape max, const Recompute& recompute) const {
    if (first_stage() && last_stage()) recompute.check(block_kinds_);  // (a stage's kinds are some of the model's)
    check_split(max.tokens());
    // (ids and targets: the whole micro-batch's; the residual stream and the head: this rank's rows)
    const int64_t N = max.tokens(), n = local_rows(N), C = cfg_.d_model, V = cfg_.vocab_size, R = head_chunk_rows(n);
    std::vector<BufferSpec> s;
    s.push_back({"ids", DType::i32, Shape{N}});
    s.push_back({"targets", DType::i32, Shape{N}});
    for (size_t j = 0; j <= blocks_.size(); ++j) s.push_back({fmt::format("x.{}", j), DType::f32, Shape{n, C}});
    std::vector<std::string> kinds;
    const std::vector<bool> narrowed = narrowed_blocks(recompute);
    for (size_t j = 0; j < blocks_.size(); ++j) {
        const Block& b = *blocks_[j];
        const StepShape bmax = block_shape(j, max);
        const bool first_of_kind = std::find(kinds.begin(), kinds.end(), b.kind()) == kinds.end();
        if (recompute.covers(b.kind())) {
            if (first_of_kind) b.declare_saved(s, shared_prefix(b), bmax);
        } else {
            const size_t first = s.size();
            b.declare_saved(s, saved_prefix(int64_t(j), b), bmax);
            if (narrowed[j])  // its copy of the kind's set
                for (size_t i = first; i < s.size(); ++i)
                    if (s[i].narrowable && s[i].dtype == DType::f32) s[i].dtype = DType::bf16;
        }
        if (first_of_kind) {
            b.declare_scratch(s, scratch_prefix(b), bmax);
            kinds.push_back(b.kind());
        }
    }
    if (last_stage()) {
        s.push_back({"ln_f", DType::f32, Shape{n, C}});
        s.push_back({"rstd_f", DType::f32, Shape{n}});
        s.push_back({"head.logits", DType::f32, Shape{R, V}});
        s.push_back({"head.dlogits", DType::f32, Shape{R, V}});
        s.push_back({"head.lse", DType::f32, Shape{R}});
        s.push_back({"scratch.dln_f", DType::f32, Shape{n, C}});
    }
    s.push_back({"scratch.dres", DType::f32, Shape{n, C}});
    if (attn_res_) attn_res_->declare_acts(s, StepShape{1, n});
    if (vision_) {
        const VisionConfig& v = cfg_.vision;
        for (BufferSpec& b : vision_->activation_specs(v.max_patches)) s.push_back(std::move(b));
        s.push_back({"vision.rows", DType::f32, Shape{v.max_patches / (v.merge_h * v.merge_w) + 1, C}});
        s.push_back({"vision.patches", DType::f32, Shape{v.max_patches, v.patch_dim()}});  // the images, on the device
    }
    return s;
}

size_t Model::workspace_bytes(StepShape max, int num_threads) const {
    size_t ws = 0;
    for (size_t j = 0; j < blocks_.size(); ++j)
        ws = std::max(ws, blocks_[j]->workspace_bytes(block_shape(j, max), num_threads));
    if (vision_) ws = std::max(ws, vision_->workspace_bytes(cfg_.vision.max_patches, num_threads));
    return ws;
}

std::vector<size_t> Model::copyable_weights() const {
    std::set<std::string> sliced;  // (a TensorSlice copies its rows of them as the model holds them)
    for (size_t j = 0; j < blocks_.size(); ++j) {
        if (!sliced_[j]) continue;
        std::vector<BufferSpec> specs;
        std::vector<ParamInit> inits;
        blocks_[j]->declare_params(specs, inits);
        for (const BufferSpec& p : specs) sliced.insert(p.name);
    }
    auto copyable = [&](const BufferSpec& s) {
        return s.trainable && s.narrowable && s.dtype == DType::f32 && s.sharding != Sharding::replicated &&
               s.name != kEmbed && !is_adapter(s.name) && !sliced.contains(s.name);
    };
    std::vector<size_t> out;
    for (size_t i = 0; i < param_specs_.size();) {
        size_t end = i + 1;  // [i, end): one tensor's parts (fused_next)
        while (param_specs_[end - 1].fused_next && end < param_specs_.size()) ++end;
        bool all = true;
        for (size_t k = i; k < end; ++k)
            all = all && copyable(param_specs_[k]) &&
                  (k + 1 == end || dtype_bytes(DType::bf16, param_specs_[k].shape.numel()) % kBufferAlign == 0);
        for (size_t k = i; k < end && all; ++k) out.push_back(k);
        i = end;
    }
    return out;
}

void Model::bind(const BufferGroup& params_held,
                 const BufferGroup* grads,
                 const BufferGroup& acts,
                 std::span<std::byte> workspace,
                 StepShape max,
                 const Recompute& recompute) {
    max_ = max;
    has_grads_ = grads != nullptr;
    ws_ = workspace;
    // what the blocks read: the held parameters, some GEMM weights from their bf16 copies (set_weight_copies)
    const BufferGroup read = weight_copies_ ? params_held.reading(*weight_copies_) : BufferGroup{};
    const BufferGroup& params = weight_copies_ ? read : params_held;
    if (first_stage()) embed_ = params.view(kEmbed);
    if (last_stage()) {
        norm_f_ = params.view(kNormF);
        head_ = cfg_.tie_embeddings ? embed_ : params.view(kHead);
    }
    if (grads) {
        d_embed_ = grads->find(kEmbed);  // undefined: frozen (or another stage's)
        d_norm_f_ = grads->find(kNormF);
        d_head_ = cfg_.tie_embeddings ? d_embed_ : grads->find(kHead);
    }
    x_.clear();
    for (size_t j = 0; j <= blocks_.size(); ++j) x_.push_back(acts.view(fmt::format("x.{}", j)));
    recompute_block_ = recomputed_blocks(recompute);
    const std::vector<bool> narrowed = narrowed_blocks(recompute);
    narrow_.assign(blocks_.size(), {});
    for (size_t jj = blocks_.size(); jj-- > 0;) {
        Block& b = *blocks_[jj];
        b.bind_params(params, grads);
        const std::string own = saved_prefix(int64_t(jj), b),
                          kinds = saved_prefix(int64_t(last_of_kind(jj)), *blocks_[last_of_kind(jj)]);
        b.bind_saved(acts, recompute.covers(b.kind()) ? shared_prefix(b) : narrowed[jj] ? kinds : own);
        b.bind_scratch(acts, scratch_prefix(b));
        if (activation_dtype_ == DType::f32 || recompute.covers(b.kind())) continue;
        std::vector<BufferSpec> saved;
        b.declare_saved(saved, "", block_shape(jj, max));
        for (const BufferSpec& x : saved)
            if (narrowed[jj])
                narrow_[jj].emplace_back(acts.view(kinds + x.name), acts.view(own + x.name));
            else if (x.narrowable && x.dtype == DType::f32)
                narrow_[jj].emplace_back(acts.view(own + x.name), TensorView{});
    }
    ids_ = acts.view("ids");
    targets_ = acts.view("targets");
    if (last_stage()) {
        ln_f_ = acts.view("ln_f");
        rstd_f_ = acts.view("rstd_f");
        logits_ = acts.view("head.logits");
        dlogits_ = acts.view("head.dlogits");
        lse_ = acts.view("head.lse");
        dln_f_ = acts.view("scratch.dln_f");
    }
    dres_ = acts.view("scratch.dres");
    if (attn_res_) attn_res_->bind(params, grads, acts, x_);
    if (vision_) {
        const VisionConfig& v = cfg_.vision;
        const int64_t max_images = v.max_patches / (v.merge_h * v.merge_w);
        vision_->bind(params, acts, workspace, max_images);
        image_rows_ = acts.view("vision.rows");
        image_buf_ = acts.view("vision.patches");
        image_grids_.clear();
        image_grids_.reserve(size_t(max_images));
        image_keep_.clear();
        image_keep_.reserve(size_t(max_images));
        image_pos_.clear();
        image_pos_.reserve(size_t(max.tokens()));
    }
}

void init_param(TensorView dst, const ParamInit& init, uint64_t seed, std::string_view name) {
    Tensor staging;  // a device's parameter: its values made on the host, then copied
    TensorView v = dst;
    if (dst.device != Device::cpu) {
        staging = Tensor(dst.dtype, dst.shape);
        v = staging.view();
    }
    const int64_t n = v.numel();
    const RandomStream rs{seed, hash_name(name)};
    const bool uniform = init.kind != ParamInit::Kind::normal;
    const int64_t at = init.element_offset;
    auto value = [&](int64_t e) {
        const uint64_t k = uint64_t(at + e);
        return float(uniform ? init.value(rs.uniform(k), 0.0) : init.value(0.0, rs.normal(k)));
    };
    if (v.dtype == DType::mxfp4) {  // frozen experts held in MXFP4: the f32 values quantised a block at a time
        uint8_t* p = static_cast<uint8_t*>(v.data);
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < n / kMxfp4Block; ++b) {
            float block[kMxfp4Block];
            for (int64_t j = 0; j < kMxfp4Block; ++j) block[j] = value(b * kMxfp4Block + j);
            f32_to_mxfp4(block, kMxfp4Block, p + b * kMxfp4BlockBytes);
        }
    } else if (v.dtype == DType::bf16) {  // a frozen base kept in bf16: the f32 values rounded
        bf16* p = v.ptr<bf16>();
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < n; ++e) p[e] = float_to_bf16(value(e));
    } else {
        float* p = v.ptr<float>();
#pragma omp parallel for schedule(static)
        for (int64_t e = 0; e < n; ++e) p[e] = value(e);
    }
    if (v.data != dst.data) copy_bytes(dst.data, dst.device, v.data, Device::cpu, v.nbytes());
}

void Model::init_params(const BufferGroup& params, uint64_t seed, size_t first, size_t last) const {
    for (size_t i = first; i < std::min(last, param_specs_.size()); ++i)
        init_param(params.view(param_specs_[i].name), inits_[i], seed, param_specs_[i].name);
}

template <class Run>
void Model::run_trunk(int64_t N, Run run) {
    for (size_t j = 0; j < blocks_.size(); ++j) {
        run(j, block_input(j, N), x_[j + 1]);
        if (attn_res_) attn_res_->combine(j, N);
    }
}

void Model::final_norm(int64_t N) {
    const TensorView last = attn_res_ ? attn_res_->output(N) : x_.back();
    ops::rmsnorm_forward({.eps = cfg_.norm_eps}, last.slice0(0, N), norm_f_, ln_f_.slice0(0, N), rstd_f_.slice0(0, N));
}

int64_t Model::layer_of(size_t j) const { return layers_.first + int64_t(j / 2); }

TensorView Model::block_input(size_t j, int64_t N) { return attn_res_ ? attn_res_->input(j, N) : x_[j]; }

void Model::forward_trunk(StepShape s, std::span<const int32_t> ids, bool keep) {
    const int64_t N = s.tokens();
    TESSERA_CHECK(N <= max_.tokens() && s.seq <= max_.seq, "model: step {}x{} exceeds the allocated {}x{}", s.batch,
                  s.seq, max_.batch, max_.seq);
    TESSERA_CHECK(int64_t(ids.size()) == N, "model: {} ids for {} tokens", ids.size(), N);
    check_split(N);
    const int64_t n = local_rows(N);
    copy_bytes(ids_.data, ids_.device, ids.data(), Device::cpu, size_t(N) * sizeof(int32_t));
    if (first_stage()) {  // (a later pipeline stage's input is in x[0] already)
        visit(
            embed_unit_, false,
            [&] { ops::embedding_forward(ids_.slice0(t_ * n, (t_ + 1) * n), embed_, x_[0].slice0(0, n)); },
            "embedding");
        splice_images(ids);
    }
    run_trunk(n, [&](size_t j, TensorView in, TensorView out) {
        visit(
            block_unit_[j], false,
            [&] {
                blocks_[j]->forward(block_shape(j, s), in, out, ws_);
                if (keep) narrow_saved(j, false);
            },
            block_kinds_[j], layer_of(j));
    });
    pool_balance_loss();
}

void Model::pool_balance_loss() {
    if (cfg_.moe.global_aux_coeff <= 0 || moe_.empty()) return;
    const size_t E = size_t(cfg_.moe.experts);
    bal_choices_.assign(E, 0.0);
    bal_probs_.assign(E, 0.0);
    bal_grad_.assign(E, 0.0);
    double rows = 0;
    for (auto& [layer, b] : moe_) {
        for (size_t e = 0; e < E; ++e) {
            bal_choices_[e] += b->balance_choices()[e];
            bal_probs_[e] += b->balance_prob_sums()[e];
        }
        rows += double(b->balance_rows());
    }
    const double loss =
        ops::router_global_aux_loss(cfg_.moe.global_aux_coeff, bal_choices_, bal_probs_, rows, bal_grad_);
    for (auto& [layer, b] : moe_) b->set_balance_grad(bal_grad_);
    if (!recording_) return;
    global_aux_sum_ += loss;
    ++global_aux_forwards_;
}

double Model::take_global_aux_loss() {
    const double mean = global_aux_forwards_ ? global_aux_sum_ / double(global_aux_forwards_) : 0.0;
    global_aux_sum_ = 0.0;
    global_aux_forwards_ = 0;
    return mean;
}

LossResult Model::head_loss(StepShape s, std::span<const int32_t> targets, bool backward, double loss_scale) {
    const int64_t N = s.tokens(), n = local_rows(N), R = head_chunk_rows(n);
    TESSERA_CHECK(int64_t(targets.size()) == N, "model: {} targets for {} tokens", targets.size(), N);
    copy_bytes(targets_.data, targets_.device, targets.data(), Device::cpu, size_t(N) * sizeof(int32_t));
    final_norm(n);
    int64_t total = 0;
    for (int32_t t : targets) total += t != kIgnoreIndex;
    LossResult res;
    res.count = total;
    if (backward) ops::zero_rows(dln_f_, n);
    double sum = 0.0;
    for (int64_t r0 = 0; r0 < n; r0 += R) {
        const int64_t rows = std::min(R, n - r0);
        TensorView h = ln_f_.slice0(r0, r0 + rows), logits = logits_.slice0(0, rows),
                   tgt = targets_.slice0(t_ * n + r0, t_ * n + r0 + rows);
        ops::linear_forward({}, h, head_, {}, logits);
        ops::CrossEntropyResult ce =
            ops::cross_entropy_forward({.ignore_index = kIgnoreIndex}, logits, tgt, lse_.slice0(0, rows));
        sum += ce.sum;
        if (!backward || ce.count == 0) continue;
        ops::zero_rows(dlogits_, rows);
        const double dloss = loss_scale * double(ce.count) / double(total);
        ops::cross_entropy_backward({.ignore_index = kIgnoreIndex}, dloss, logits, tgt, lse_.slice0(0, rows),
                                    dlogits_.slice0(0, rows));
        ops::linear_backward(dlogits_.slice0(0, rows), h, head_, dln_f_.slice0(r0, r0 + rows), d_head_, {});
    }
    if (tensor_) sum = tensor_->all_reduce_sum(sum);  // the micro-batch's, over its rows on the tensor group's ranks
    res.loss = total ? sum / double(total) : 0.0;
    return res;
}

LossResult Model::forward_backward(StepShape s,
                                   std::span<const int32_t> ids,
                                   std::span<const int32_t> targets,
                                   double loss_scale) {
    TESSERA_CHECK(has_grads_, "model: forward_backward needs gradient buffers");
    TESSERA_CHECK(last_stage(), "model: forward_backward on a pipeline stage before the last (stage_forward)");
    const int64_t N = local_rows(s.tokens());
    const bool warmup = indexer_warmup();
    begin_pass(warmup ? warmup_plan_ : train_plan_);
    set_pass({.record = true, .loss_scale = loss_scale, .lora_seed = lora_seed_});
    forward_trunk(s, ids, true);
    set_pass({.record = false, .loss_scale = loss_scale, .lora_seed = lora_seed_});  // recompute: no recording
    LossResult res;
    if (warmup) {  // the trunk is frozen: no LM backward, only each indexer's KL (spec/dsa.md §3.1)
        visit(
            head_unit_, false, [&] { res = head_loss(s, targets, false, loss_scale); }, "head + loss");
        indexer_backward(s);
        end_pass();
        return res;
    }
    visit(
        head_unit_, true,
        [&] {
            res = head_loss(s, targets, true, loss_scale);
            if (attn_res_) {  // dL/dh, then through the output mix
                TensorView dh = attn_res_->dmix(N);
                ops::zero_rows(dh, N);
                ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln_f_.slice0(0, N), attn_res_->output(N), norm_f_,
                                      rstd_f_.slice0(0, N), dh, d_norm_f_);
                attn_res_->output_backward(dres_, N);
            } else {
                ops::zero_rows(dres_, N);
                ops::rmsnorm_backward({.eps = cfg_.norm_eps}, dln_f_.slice0(0, N), x_.back().slice0(0, N), norm_f_,
                                      rstd_f_.slice0(0, N), dres_.slice0(0, N), d_norm_f_);
            }
        },
        "head + loss");
    backward_blocks(s);
    end_pass();
    return res;
}

void Model::backward_blocks(StepShape s) {
    const int64_t N = local_rows(s.tokens());
    for (size_t j = blocks_.size(); j-- > 0;) {
        const TensorView in = block_input(j, N);
        TensorView d = dres_;
        if (attn_res_) {
            attn_res_->begin_backward(dres_, N);
            d = attn_res_->dmix(N);
        }
        visit(
            block_unit_[j], true,
            [&] {
                const StepShape bs = block_shape(j, s);
                if (recompute_block_[j]) blocks_[j]->forward(bs, in, x_[j + 1], ws_);
                narrow_saved(j, true);
                blocks_[j]->backward(bs, in, d, ws_);
            },
            block_kinds_[j], layer_of(j));
        if (attn_res_) attn_res_->end_backward(j, dres_, N);
    }
    if (!first_stage()) return;  // dres holds dL/d the stage's input
    visit(
        embed_unit_, true,
        [&] {
            if (!d_embed_.defined()) return;
            if (!image_pos_.empty()) ops::zero_rows_at(dres_, image_pos_);  // image rows: not the token's embedding
            ops::embedding_backward(dres_.slice0(0, N), ids_.slice0(t_ * N, (t_ + 1) * N), d_embed_);
        },
        "embedding");
}

void Model::indexer_backward(StepShape s) {
    const int64_t N = s.tokens();
    for (auto it = dsa_.rbegin(); it != dsa_.rend(); ++it) {  // backwards: the shared recompute set is the last's
        const DsaLayer& d = *it;
        visit(
            block_unit_[d.block], true,
            [&] {
                if (recompute_block_[d.block])
                    blocks_[d.block]->forward(s, block_input(d.block, N), x_[d.block + 1], ws_);
                narrow_saved(d.block, true);
                d.mla->indexer_backward(s, ws_);
            },
            "indexer", layer_of(d.block));
    }
}

void Model::check_whole(std::string_view what) const {
    TESSERA_CHECK(first_stage() && last_stage(),
                  "model: {} needs the whole model, not the pipeline stage of layers "
                  "[{}, {})",
                  what, layers_.first, layers_.last);
}

void Model::stage_forward(StepShape s, std::span<const int32_t> ids, bool record, bool keep) {
    TESSERA_CHECK(!last_stage(), "model: stage_forward on the last pipeline stage (forward_backward takes the loss)");
    begin_pass(eval_plan_);
    set_pass({.record = record, .lora_seed = record ? lora_seed_ : 0});
    forward_trunk(s, ids, keep);
    end_pass();
}

void Model::stage_backward(StepShape s, std::span<const int32_t> ids, double loss_scale, bool rerun) {
    TESSERA_CHECK(has_grads_ && !last_stage(),
                  "model: stage_backward needs gradient buffers and a stage before the "
                  "last");
    const bool warmup = indexer_warmup();  // (the indexers' KL needs no gradient from later stages)
    if (rerun)
        begin_pass(warmup ? warmup_plan_ : train_plan_);
    else
        begin_pass(warmup ? warmup_backward_plan_ : backward_plan_);
    set_pass({.record = false, .loss_scale = loss_scale, .lora_seed = lora_seed_});  // (recomputed: not recorded)
    if (rerun) {
        forward_trunk(s, ids, true);
    } else {  // the group holds a copy of this micro-batch's forward; the blocks' host-side copies are a later one's
        for (auto& b : blocks_) b->saved_replaced();
    }
    if (warmup)
        indexer_backward(s);
    else
        backward_blocks(s);
    end_pass();
}

LossResult Model::forward_loss(StepShape s, std::span<const int32_t> ids, std::span<const int32_t> targets) {
    TESSERA_CHECK(last_stage(), "model: forward_loss on a pipeline stage before the last (stage_forward)");
    begin_pass(eval_plan_);
    set_pass({});
    forward_trunk(s, ids, false);
    LossResult res;
    visit(
        head_unit_, false, [&] { res = head_loss(s, targets, false, 1.0); }, "head + loss");
    end_pass();
    return res;
}

void Model::forward_logits(StepShape s, std::span<const int32_t> ids, TensorView logits) {
    const int64_t N = s.tokens();
    check_whole("forward_logits");
    TESSERA_CHECK(!tensor_, "model: forward_logits with tensor parallelism is not supported (run it on one rank)");
    check_shape(logits, Shape{N, cfg_.vocab_size}, "model: logits");
    begin_pass(eval_plan_);
    set_pass({});
    forward_trunk(s, ids, false);
    visit(
        head_unit_, false,
        [&] {
            final_norm(N);
            ops::linear_forward({}, ln_f_.slice0(0, N), head_, {}, logits);
        },
        "head");
    end_pass();
}

std::vector<BufferSpec> Model::cache_specs(int64_t batch, int64_t max_len) const {
    TESSERA_CHECK(batch >= 1 && max_len >= 1, "model: decoding caches need batch >= 1 and max_len >= 1");
    TESSERA_CHECK(!tensor_, "model: decoding with tensor parallelism is not supported (decode on one rank)");
    std::vector<BufferSpec> specs;
    for (size_t j = 0; j < blocks_.size(); ++j) {
        blocks_[j]->declare_cache(specs, fmt::format("cache.{}.", j), batch, max_len);
    }
    for (auto& s : specs) s.kind = BufferKind::workspace;
    return specs;
}

void Model::bind_cache(const BufferGroup& cache) {
    for (size_t j = 0; j < blocks_.size(); ++j) blocks_[j]->bind_cache(cache, fmt::format("cache.{}.", j));
    decoding_ = true;
}

void Model::decode_step(int64_t pos, std::span<const int32_t> ids, TensorView logits) {
    const int64_t B = int64_t(ids.size());
    TESSERA_CHECK(decoding_, "model: decode_step without bound caches (cache_specs, bind_cache)");
    check_whole("decoding");
    TESSERA_CHECK(!hooks_, "model: decoding with sharded parameters (FSDP) is not supported");
    TESSERA_CHECK(B >= 1 && B <= max_.tokens(), "model: {} sequences exceed the {} tokens the runtime holds", B,
                  max_.tokens());
    check_shape(logits, Shape{B, cfg_.vocab_size}, "model: logits");
    set_pass({});
    copy_bytes(ids_.data, ids_.device, ids.data(), Device::cpu, size_t(B) * sizeof(int32_t));
    ops::embedding_forward(ids_.slice0(0, B), embed_, x_[0].slice0(0, B));
    splice_decoded_images(pos, ids);
    run_trunk(B, [&](size_t j, TensorView in, TensorView out) { blocks_[j]->step(B, pos, in, out, ws_); });
    final_norm(B);
    ops::linear_forward({}, ln_f_.slice0(0, B), head_, {}, logits);
}

void Model::set_pass(const PassOptions& o) {
    recording_ = o.record;
    for (auto& b : blocks_) b->set_pass(o);
}

void Model::update_moe_bias(const std::function<void(std::span<int64_t>)>& sum_over_ranks) {
    for (auto& [layer, b] : moe_) b->update_bias(sum_over_ranks);
}

std::shared_ptr<const StepStats> Model::take_step_stats() {
    if (!stats_ || stats_.use_count() > 1) {  // first take, or the caller still holds the last one
        stats_ = std::make_shared<StepStats>();
        for (auto& [layer, b] : moe_) stats_->moe.emplace_back(layer, MoeLayerStats{});
        for (auto& d : dsa_) stats_->dsa.emplace_back(d.layer, DsaLayerStats{});
    }
    for (size_t i = 0; i < moe_.size(); ++i) moe_[i].second->take_stats(stats_->moe[i].second);
    for (size_t i = 0; i < dsa_.size(); ++i) stats_->dsa[i].second = dsa_[i].mla->take_stats();
    return stats_;
}

bool Model::indexer_warmup() const {
    // the whole model's stage, not this pipeline stage's: a stage without a DSA layer trains nothing in the warm-up
    if (!cfg_.mla.dsa.warmup()) return false;
    for (int64_t l = 0; l < cfg_.n_layers; ++l)
        if (cfg_.layer_type(l) == "dsa") return true;
    return false;
}

bool Model::trainable(const std::string& param) const {
    if (!indexer_warmup()) return true;
    for (auto& d : dsa_) {
        if (d.mla->is_indexer_param(param)) return true;
    }
    return false;
}

double Model::block_forward_flops_per_token(size_t block, int64_t seq) const {
    return blocks_.at(block)->forward_flops_per_token(seq);
}

double Model::block_rank_flops_per_token(size_t block, int64_t seq) const {
    if (sliced_.at(block)) return static_cast<const TensorSlice&>(*blocks_[block]).part_forward_flops_per_token(seq);
    return blocks_[block]->forward_flops_per_token(seq) / double(T_);
}

double Model::forward_flops_per_token(int64_t seq) const {
    double f = last_stage() ? 2.0 * double(cfg_.d_model) * double(cfg_.vocab_size) : 0.0;  // head
    for (auto& b : blocks_) f += b->forward_flops_per_token(seq);
    return f;
}

double Model::train_flops_per_token(int64_t seq) const {
    // a frozen matmul weight's gradient is not computed: 2 FLOPs per weight it applies per token (routed experts
    // [E_local, out, in]: top-k of them per token, whatever this rank holds); vectors (norms, biases, gates) count
    // nothing, nor does the embedding's lookup
    double skipped = 0;
    for (const BufferSpec& s : param_specs_) {
        if (s.trainable || s.shape.ndim < 2 || (s.name == kEmbed && !cfg_.tie_embeddings)) continue;
        const bool expert = s.name.find(".mlp.experts.") != std::string::npos;
        const double applied = expert ? double(s.shape.numel() / s.shape[0] * cfg_.moe.topk) : double(s.shape.numel());
        skipped += 2.0 * applied;
    }
    return 3.0 * forward_flops_per_token(seq) - skipped;
}

}  // namespace tessera::model
