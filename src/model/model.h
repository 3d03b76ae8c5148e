// The decoder-only language model: embedding -> N × (attention block: GQA or MLA/DSA; MLP or MoE block) ->
// RMSNorm -> head, with the cross-entropy loss fused into the head over chunks of tokens, so the full
// [N, V] logits never exist during training. Tensor names follow Hugging Face Llama checkpoints. With
// model.attn_res_block_size the residual stream is Kimi K3's Attention Residuals (model/attn_res.h).
//
// The model owns no memory: it declares buffer specs (parameters, activations for a step shape,
// workspace) and binds views into groups the caller allocated from one arena (see train/ and
// apps/). Activation recomputation is a switch: per-block saved activations, or one shared set per
// block kind refilled by re-running the block's forward before its backward (bitwise identical).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "model/attn_res.h"
#include "model/config.h"
#include "model/layers/block.h"
#include "model/layers/mla_block.h"
#include "model/layers/moe_block.h"
#include "model/recompute.h"
#include "model/vision.h"
#include "parallel/comm.h"

namespace tessera::model {

// The per-layer statistics of one optimizer step: MoE routing and the DSA indexer KL (layer index, stats).
struct StepStats {
    std::vector<std::pair<int64_t, MoeLayerStats>> moe;
    std::vector<std::pair<int64_t, DsaLayerStats>> dsa;
};

// FSDP (train/fsdp.h): the parameters of Sharding::data are cut into units, one per block plus the embedding
// and the head (final norm and output projection; with tied embeddings one unit holds the embedding and the
// final norm). A unit is a run of consecutive parameter specs [first, last), plus an MoE block's expert
// parameters [expert_first, expert_last) (also consecutive, in the expert region); slot: which of the gather
// buffers holds it while it is in use (0 for the embedding and head, 1 and 2 alternating over the blocks), so
// consecutive visits never share a slot.
struct ParamUnit {
    size_t first = 0, last = 0;                // its trained dense parameters (Sharding::data), or empty
    size_t expert_first = 0, expert_last = 0;  // an MoE block's experts (Sharding::expert), or empty
    size_t frozen_first = 0, frozen_last = 0;  // its frozen dense parameters (model.lora's base), or empty
    size_t frozen_expert_first = 0, frozen_expert_last = 0;  // an MoE block's frozen experts, or empty
    int slot = 0;
};
struct UnitVisit {
    int unit = 0;
    bool backward = false;  // gradients are computed during the visit
    bool operator==(const UnitVisit&) const = default;
};

// What the model tells whoever keeps its units' parameters: each pass announces its visits in order, then
// makes them (enter: the unit's parameters must be in place; leave: done with them, and after a backward
// visit its gradients are complete for this pass until the unit's next backward visit).
class ParamHooks {
  public:
    virtual ~ParamHooks() = default;
    virtual void begin(std::span<const UnitVisit> plan) = 0;
    virtual void enter(UnitVisit v) = 0;
    virtual void leave(UnitVisit v) = 0;
    virtual void end() = 0;
};

// Two keepers of the same units' parameters (FSDP's gathers of what trains and a weight budget's pages of the frozen
// base, train/): each call goes to a, then to b (either may be null).
class HooksPair final : public ParamHooks {
  public:
    HooksPair(ParamHooks* a, ParamHooks* b) : a_(a), b_(b) {}
    void begin(std::span<const UnitVisit> plan) override {
        for (ParamHooks* h : {a_, b_})
            if (h) h->begin(plan);
    }
    void enter(UnitVisit v) override {
        for (ParamHooks* h : {a_, b_})
            if (h) h->enter(v);
    }
    void leave(UnitVisit v) override {
        for (ParamHooks* h : {a_, b_})
            if (h) h->leave(v);
    }
    void end() override {
        for (ParamHooks* h : {a_, b_})
            if (h) h->end();
    }

  private:
    ParamHooks *a_, *b_;
};

// One parameter's initial values, from (seed, its name, element index) only: what Model::init_params gives it (a
// block timed alone, `tessera calibrate`, starts where training does).
void init_param(TensorView v, const ParamInit& init, uint64_t seed, std::string_view name);

struct LossResult {
    double loss = 0.0;  // mean over counted targets
    int64_t count = 0;  // targets that count (not ignore_index)
};

// What keeps a model whole on one pipeline stage (it crosses stages), or null: tied embeddings, Attention Residuals,
// the image tower, the global balance loss.
const char* pipeline_obstacle(const ModelConfig& c);
// What tensor parallelism does not cover yet (parallel.tensor, model/layers/tensor_slice.h), or null: the DSA dense
// warm-up, LoRA's dropout, the balance losses over whole sequences or every token.
const char* tensor_obstacle(const ModelConfig& c);
// The model whose attention blocks are the parts a tensor group of T ranks computes: 1/T of every head count
// (model.n_heads and n_kv_heads at the same head dim, so MLA's and DSA's heads too; kda.num_heads and num_v_heads),
// everything else as in c. Counts T does not divide come out truncated (Model checks them).
ModelConfig tensor_part(const ModelConfig& c, int64_t T);

class Model {
  public:
    static constexpr int32_t kIgnoreIndex = -100;

    // expert_group: the ranks among which each MoE layer's experts are spread (expert parallelism,
    // parallel/ep.h); null or one rank: every expert here.
    // ep_chunks: the local experts in this many groups whose exchanges overlap the previous group's compute.
    // layers: a pipeline stage's layers (all by default). A stage that is not the whole model refuses what crosses
    // stages: tied embeddings, Attention Residuals, the image tower and the global balance loss (one-line errors).
    // tensor_group: tensor parallelism (parallel.tensor; model/layers/tensor_slice.h): its ranks pass the same ids and
    // targets, each keeps 1/T of the tokens between the attention blocks (rows [t·N/T, (t+1)·N/T)) and runs 1/T of
    // each attention block's heads; the losses are the micro-batch's on every rank of it. null or one rank: none.
    explicit Model(ModelConfig cfg,
                   parallel::Comm* expert_group = nullptr,
                   int64_t ep_chunks = 1,
                   LayerRange layers = {},
                   parallel::Comm* tensor_group = nullptr);
    ~Model();

    const ModelConfig& config() const { return cfg_; }
    // Parameter specs: the frozen ones first (model.lora: the base), then the trained ones in the order
    // [replicated | data (unit by unit) | expert] of their Sharding.
    const std::vector<BufferSpec>& param_specs() const { return param_specs_; }
    // The trained parameters' specs (param_specs() after the frozen ones): the optimizer's and the gradients'
    const std::vector<BufferSpec>& trained_specs() const { return trained_specs_; }
    size_t frozen_params() const { return frozen_; }
    const std::vector<ParamUnit>& param_units() const { return units_; }
    // The unit of block j, of the embedding and of the head (the same with tied embeddings); −1: none (nothing of it
    // in the flat spaces FSDP shards). A training pass visits the embedding's, the blocks' in order, the head's
    // (forward and backward in one visit), the blocks' in reverse, the embedding's.
    int block_unit(size_t j) const { return block_unit_.at(j); }
    int embed_unit() const { return embed_unit_; }
    int head_unit() const { return head_unit_; }
    // FSDP: the hooks every training and evaluation pass calls around each unit's use (null: none). Not for
    // decoding (decode_step refuses while hooks are set).
    void set_param_hooks(ParamHooks* h) { hooks_ = h; }
    // Expert parallelism: the experts of each MoE layer whose weights are here, [first, first + count)
    // of model.moe.experts (all of them without it).
    std::pair<int64_t, int64_t> local_experts() const;
    // recompute: one-line error when it names a block kind the model does not have
    std::vector<BufferSpec> activation_specs(StepShape max, const Recompute& recompute) const;
    // train.activation_dtype: f32 (default), or bf16: the activations each block of a kind not recomputed saves for
    // its backward (those it declares narrowable: not its per-row statistics, indices, decay gates or states) are
    // rounded to bf16 after its forward, and all but the last block of each kind hold them in bf16 until their
    // backward: they compute in the last one's f32 saved set, keep a bf16 copy of it (ops::cast), and widen the copy
    // back into it before their backward. The last rounds its own set in place. Every block's backward thus reads the
    // same rounded values whichever blocks a process holds (pipeline stages: the one process's bits). Set before
    // activation_specs and bind.
    void set_activation_dtype(DType dtype);
    DType activation_dtype() const { return activation_dtype_; }
    // per block: whether it keeps its saved activations in a bf16 copy (above) under these recompute choices
    std::vector<bool> narrowed_blocks(const Recompute& recompute) const;
    size_t workspace_bytes(StepShape max, int num_threads) const;
    int64_t num_params() const;
    // train.precision = bf16 on a GPU (train/weight_copies.h): the parameters whose every reader is a GEMM that
    // rounds them to bf16, so a bf16 copy gives the same products: the trained GEMM weights (projections, experts, the
    // untied head), but the embedding (a lookup reads it whole), the replicated ones (Attention Residuals' queries),
    // the adapters and a tensor-sliced block's; parts read as one tensor all or none, and only where their copies fall
    // back to back (bf16 bytes a multiple of 64).
    std::vector<size_t> copyable_weights() const;
    // Before bind: the blocks read the parameters `copies` holds (bf16, by name) there instead (null: none).
    void set_weight_copies(const BufferGroup* copies) { weight_copies_ = copies; }

    // grads may be null (inference). The activation group must come from activation_specs(max, recompute).
    void bind(const BufferGroup& params,
              const BufferGroup* grads,
              const BufferGroup& acts,
              std::span<std::byte> workspace,
              StepShape max,
              const Recompute& recompute);
    // Initial values from (seed, parameter name, element index) only (see ParamInit), of the specs
    // [first, last) (all by default).
    void init_params(const BufferGroup& params, uint64_t seed, size_t first = 0, size_t last = SIZE_MAX) const;

    // ids, targets: [B·T] token ids. Accumulates parameter gradients of loss_scale · mean loss. On a pipeline's last
    // stage that is not also its first, stage_input() must hold the stage's input, and stage_grad() holds dL/d input
    // afterwards.
    LossResult forward_backward(StepShape s,
                                std::span<const int32_t> ids,
                                std::span<const int32_t> targets,
                                double loss_scale);
    // model.lora.dropout: the masks of the next forward_backward (and its recomputed forwards), a pure function of
    // the seed (the trainer's: run seed, step and the micro-batch's place in the step, so any layout of ranks
    // draws the same ones); 0 = no dropout. Evaluation and decoding never drop.
    void set_lora_seed(uint64_t seed) { lora_seed_ = seed; }
    LossResult forward_loss(StepShape s, std::span<const int32_t> ids, std::span<const int32_t> targets);

    // A pipeline stage that is not the last (train/pipeline.h). stage_forward: the stage's layers from the embedding of
    // ids (the first stage) or from stage_input() to stage_output(); record: a training forward (its routing and
    // indexer statistics count). stage_backward: stage_grad() holds dL/d stage_output() and stage_input() the same
    // input as that micro-batch's stage_forward; re-runs the forward (recording nothing: the same bits), then the
    // backward, accumulating parameter gradients; stage_grad() then holds dL/d stage_input() (on the first stage the
    // embedding's gradient is taken instead). loss_scale: as forward_backward's (the auxiliary losses' weight).
    // rerun = false: the backward alone, the activation group holding what that micro-batch's stage_forward left in it
    // (restored by the caller, train/pipeline.h), but for stage_grad() and the blocks' shared transients ("scratch.*",
    // which no backward reads from its forward). keep: a backward will read this forward's saved activations (no
    // re-run), so they are rounded to the activation dtype; a forward that is re-run or evaluates skips that.
    void stage_forward(StepShape s, std::span<const int32_t> ids, bool record, bool keep);
    void stage_backward(StepShape s, std::span<const int32_t> ids, double loss_scale, bool rerun = true);
    bool first_stage() const { return layers_.first == 0; }
    bool last_stage() const { return layers_.last == cfg_.n_layers; }
    LayerRange layers() const { return layers_; }
    TensorView stage_input(int64_t tokens) const { return x_.front().slice0(0, tokens); }
    TensorView stage_output(int64_t tokens) const { return x_.back().slice0(0, tokens); }
    TensorView stage_grad(int64_t tokens) const { return dres_.slice0(0, tokens); }
    // tensor parallelism: the ranks of the tensor group (1: none), and the token rows of a micro-batch of N tokens
    // this rank keeps between attention blocks (N / tensor_ranks(); the stage input, output and gradient hold those)
    int tensor_ranks() const { return int(T_); }
    int64_t local_rows(int64_t N) const { return N / T_; }
    // logits: [B·T, V] f32
    void forward_logits(StepShape s, std::span<const int32_t> ids, TensorView logits);

    // Image input (model.vision, Kimi K3): the images of the next passes' ids, until set again. The ids hold
    // model.vision.image_token once per image token (VisionTower::tokens: an h × w grid of patches gives
    // h·w / (merge_h·merge_w)), images in order; the embedding rows there are replaced by the tower's output rows,
    // in order (spec/kimi_k3.md §6: the placeholder expanded). patches: [Σ h·w, patch_dim] f32 on the host (copied
    // to the model's device each pass), alive until the passes ran. rows: per image, the rows the ids hold (a
    // training window may cut an image at either end; the tower still sees the whole image); empty: all of them.
    // The tower is frozen and runs forward only; no grids: text only. Decoding (decode_step) places the images'
    // rows in the order their image tokens are decoded, from the first row at each pos = 0.
    bool has_vision() const { return vision_ != nullptr; }
    bool has_images() const { return !image_grids_.empty(); }
    // the tower's forward FLOPs over images of these grids (0 without a tower)
    double image_forward_flops(std::span<const ops::PatchGrid> grids) const {
        return vision_ ? vision_->forward_flops(grids) : 0.0;
    }
    void set_images(std::span<const ops::PatchGrid> grids,
                    TensorView patches,
                    std::span<const ops::ImageRows> rows = {});

    // Incremental decoding (docs/model.md): the caches for `batch` sequences of up to `max_len` tokens
    // (a buffer group the caller allocates, e.g. as an extra group of the runtime, then binds), and one
    // step: ids [batch] at position pos of every sequence (pos = 0 starts new sequences) -> logits
    // [batch, V]. KV and indexer-key caches grow with pos; KDA/GDN layers keep a fixed-size state.
    std::vector<BufferSpec> cache_specs(int64_t batch, int64_t max_len) const;
    void bind_cache(const BufferGroup& cache);
    void decode_step(int64_t pos, std::span<const int32_t> ids, TensorView logits);
    // The device the runtime bound the model's buffers on (decoding's logits live there too).
    Device device() const { return ids_.device; }

    // Model FLOPs per token: forward, and training (recompute not counted): the forward, the input gradients (as many
    // FLOPs) and the weight gradients of the parameters that train (a matmul weight's as many as its forward product:
    // 3 × forward when everything trains; a frozen base, model.lora, skips its own).
    // (A pipeline stage: its layers, and the head on the last.)
    double forward_flops_per_token(int64_t seq) const;
    double train_flops_per_token(int64_t seq) const;
    // The blocks (two per layer: attention or linear attention, then the feed-forward) by kind ("kda", "gdn",
    // "attention", "mla", "dsa", "mlp", "moe") and forward FLOPs per token; the rest of forward_flops_per_token is the
    // embedding and head's. The planner's compute per op class (plan/plan.h).
    const std::vector<std::string>& block_kinds() const { return block_kinds_; }
    // Under train.recompute, whether block j re-runs its forward before its backward: every block of a kind it covers
    // but the last of the kind, whose saved set (one shared set per kind) still holds its own activations
    // (model/recompute.h). The planner prices the same.
    std::vector<bool> recomputed_blocks(const Recompute& recompute) const;
    Block& block(size_t j) { return *blocks_.at(j); }  // `tessera calibrate` times one block of each kind
    double block_forward_flops_per_token(size_t block, int64_t seq) const;
    // what this rank computes of block j per token of the micro-batch: the whole block's FLOPs, or with tensor
    // parallelism a sliced block's part (1/T of its heads, and what every rank of the group computes whole: input norm,
    // latent down-projections, the DSA indexer) and 1/T of any other block's (it runs 1/T of the tokens)
    double block_rank_flops_per_token(size_t block, int64_t seq) const;

    // MoE layers: after each optimizer step, move the selection biases (docs/moe.md; sum_over_ranks, when set,
    // sums each layer's expert counts and quantile histograms over the data-parallel ranks first, so every rank moves
    // them alike), then take
    // the step's statistics (routing per MoE layer, the indexer KL per DSA layer; empty lists when the model has none),
    // which clears them in the blocks. The statistics object is recycled: a take refills the last one in place when the
    // caller no longer holds it, so a training loop that drops each step's result allocates nothing here after the
    // first step; one still held is left alone (a fresh one is made).
    bool has_moe() const { return !moe_.empty(); }
    void update_moe_bias(const std::function<void(std::span<int64_t>)>& sum_over_ranks = {});
    std::shared_ptr<const StepStats> take_step_stats();
    // model.moe.global_aux_coeff: the global balance loss pooled over the MoE layers of each forward (its gradient
    // joins every layer's router in backward); its mean over this step's recorded forwards, then cleared.
    double take_global_aux_loss();

    // DSA layers (model.mla.dsa.topk > 0). In the dense warm-up stage only the indexers train (on a pipeline stage
    // without DSA layers, nothing):
    // forward_backward skips the LM backward and trainable() is false for every other parameter (the
    // optimizer leaves them alone); trainable_mask() lists trainable() per trained spec then, and is
    // empty (all trainable) otherwise.
    bool has_dsa() const { return !dsa_.empty(); }
    bool indexer_warmup() const;
    bool trainable(const std::string& param) const;
    const std::vector<bool>& trainable_mask() const { return trainable_mask_; }

  private:
    struct DsaLayer {
        int64_t layer;
        MlaBlock* mla;
        size_t block;  // index into blocks_
    };
    // keep: a backward follows (the narrowed blocks keep their copies)
    void forward_trunk(StepShape s, std::span<const int32_t> ids, bool keep);
    size_t last_of_kind(size_t j) const;  // the last block of block j's kind
    // train.activation_dtype = bf16: after block j's forward its saved set rounded into its bf16 copy (or in place),
    // before its backward (back) the copy widened into the set
    void narrow_saved(size_t j, bool back);
    // the blocks from the embedding in x[0] to the final norm's output in ln_f; run(j, x_in, x_out) runs block j
    template <class Run>
    void run_trunk(int64_t N, Run run);
    TensorView block_input(size_t j, int64_t N);  // block j's x_in (recomputes an Attention Residuals mix)
    void final_norm(int64_t N);                   // the last residual state -> ln_f
    void make_units(const std::vector<int>& owner);
    void freeze_base();  // model.lora: every parameter but the adapters and modules_to_save frozen
    // runs f between the hooks' enter and leave of the visit (f alone without hooks)
    template <class F>
    // name: the span of the visit in a step trace (core/trace.h), layer its argument
    void visit(int unit, bool backward, F&& f, std::string_view name, int64_t layer = -1);
    void begin_pass(const std::vector<UnitVisit>& plan);
    void end_pass();
    void set_pass(const PassOptions& o);
    uint64_t lora_seed_ = 0;   // set_lora_seed: the next training pass's
    void pool_balance_loss();  // after a trunk forward: the global balance loss over every MoE layer
    void splice_images(std::span<const int32_t> ids);         // after the embedding: image tokens' rows from the tower
    int64_t find_image_tokens(std::span<const int32_t> ids);  // their positions into image_pos_; how many
    TensorView run_tower();                                   // the images' rows: [tokens of image_grids_, d]
    // decoding: the image tokens among ids take the next rows of the images (the tower runs once, at the first)
    void splice_decoded_images(int64_t pos, std::span<const int32_t> ids);
    LossResult head_loss(StepShape s, std::span<const int32_t> targets, bool backward, double loss_scale);
    int64_t head_chunk_rows(int64_t tokens) const;

    void check_whole(std::string_view what) const;  // one-line error on a pipeline stage
    void backward_blocks(StepShape s);              // the blocks' backward from dres_, then the embedding's
    void indexer_backward(StepShape s);             // the DSA warm-up: each indexer's KL only
    int64_t layer_of(size_t j) const;               // block j's layer in the whole model

    // block j's shape of a micro-batch: the whole one for a sliced attention block, this rank's rows for the rest
    StepShape block_shape(size_t j, StepShape s) const;
    void check_split(int64_t N) const;  // one-line error unless the tensor group's ranks split N tokens evenly

    ModelConfig cfg_;
    LayerRange layers_;                 // (last resolved)
    parallel::Comm* tensor_ = nullptr;  // tensor parallelism's group (null: none)
    int64_t T_ = 1, t_ = 0;             // its size and this rank's place
    std::vector<bool> sliced_;          // per block: a TensorSlice (an attention block over 1/T of its heads)
    DType activation_dtype_ = DType::f32;
    // per block, under activation dtype bf16: (saved buffer, the block's copy of it) for each of a narrowed block's
    // saved buffers; (narrowable buffer, undefined: rounded in place) for the last of a kind; empty otherwise
    std::vector<std::vector<std::pair<TensorView, TensorView>>> narrow_;
    std::vector<std::unique_ptr<Block>> blocks_;
    std::vector<std::string> block_kinds_;            // blocks_[j]->kind(), for step traces
    std::vector<std::pair<int64_t, MoeBlock*>> moe_;  // (layer, block) of the MoE layers
    std::vector<DsaLayer> dsa_;
    std::unique_ptr<AttnRes> attn_res_;                  // null: the plain residual stream
    std::unique_ptr<VisionTower> vision_;                // null: text only
    std::vector<ops::PatchGrid> image_grids_;            // set_images (capacity reserved at bind)
    std::vector<ops::ImageRows> image_keep_;             // each image's rows the ids hold, as rows of the
                                                         // tower's output over all the images (same)
    int64_t image_kept_ = 0, image_rows_total_ = 0;      // Σ kept rows; the tower's output rows
    TensorView image_patches_, image_rows_, image_buf_;  // set_images' host patches; the tower's rows; patches there
    std::vector<int64_t> image_pos_;  // the last forward's image token positions (capacity reserved at bind)
    int64_t image_next_ = 0;          // decoding: the next image row to place; its rows are in image_rows_ once
    bool image_rows_ready_ = false;   // the tower ran for these images
    bool decoding_ = false;           // decoding caches bound
    std::vector<BufferSpec> param_specs_;
    const BufferGroup* weight_copies_ = nullptr;  // set_weight_copies
    std::vector<ParamInit> inits_;
    std::vector<bool> trainable_mask_;  // empty: every parameter trains
    std::vector<BufferSpec> trained_specs_;
    size_t frozen_ = 0;
    std::vector<ParamUnit> units_;
    std::vector<int> block_unit_;         // the unit of each block
    int embed_unit_ = 0, head_unit_ = 0;  // the same unit with tied embeddings
    std::vector<UnitVisit> eval_plan_, train_plan_, warmup_plan_, backward_plan_, warmup_backward_plan_;
    ParamHooks* hooks_ = nullptr;
    std::shared_ptr<StepStats> stats_;  // the last take_step_stats() result, refilled when no one else holds it
    StepShape max_;
    bool has_grads_ = false;
    std::vector<bool> recompute_block_;  // re-run forward before backward
    // parameters and gradients
    TensorView embed_, norm_f_, head_, d_embed_, d_norm_f_, d_head_;
    // activations: residual stream x[0..2L] ([N, C] each; with Attention Residuals the P states), final norm,
    // head chunk buffers
    std::vector<TensorView> x_;
    TensorView ids_, targets_, ln_f_, rstd_f_, logits_, dlogits_, lse_, dln_f_, dres_;
    std::span<std::byte> ws_;
    bool recording_ = false;
    std::vector<double> bal_choices_, bal_probs_, bal_grad_;  // pooled statistics (sized once)
    double global_aux_sum_ = 0.0;
    int64_t global_aux_forwards_ = 0;
};

}  // namespace tessera::model
