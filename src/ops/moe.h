// The (Latent)MoE feed-forward layer for one process (spec/moe.md §2–§5, spec/kimi_k3.md §2.3):
//   route:    u = x·W_rᵀ, s = softmax|σ(u), top-k of s + bias, gates from s (ops/router.h)
//   capacity: dropless, or at most ⌈c·N·k/E⌉ rows per expert; an overflowing (token, slot) pair is
//             re-routed to the token's best other expert with room (by s + bias, allowed groups only),
//             else dropped; pairs claim room in priority order (s + bias descending, ties by token, slot).
//             Gates are then recomputed over each token's final set.
//   latent:   z = x·W_downᵀ [N, L] (without latent_down, z = x and L = D)
//   dispatch: z rows to an expert-contiguous buffer, sorted by (expert, token, slot), each expert's
//             segment padded with zero rows to a multiple of kMoeRowAlign (the layout is a pure function
//             of routing)
//   experts:  h = [z·W_gate,eᵀ | z·W_up,eᵀ], a' = gate·act(h), y_e = a'·W_down,eᵀ   (grouped GEMMs;
//             the gate scales the activation before the down projection, spec/moe.md §5.3)
//   combine:  c[n] = Σ_j y_e(row of (n, j)), summed in slot order (no atomics)
//   latent:   y = (rmsnorm(c)·latent_norm)·W_upᵀ (Stable LatentMoE) or c·W_upᵀ; without latent, y = c
//   shared:   y += W_sd·act(W_sg x, W_su x) on the full-width x, optionally scaled per token by
//             σ(w_ss·x) (Qwen3-Next's shared_expert_gate; applied to the activation before W_sd)
// act = SwiGLU (silu(gate)·up) or SiTU-GLU (ops/situ_glu.h). Shapes: x, y [N, D]; router_w [E, D];
// router_bias [E]; w_gate, w_up [E, F, L]; w_down [E, L, F]; latent_down [L, D]; latent_up [D, L];
// latent_norm [L]; shared_gate, shared_up [FS, D]; shared_down [D, FS]; shared_scale [1, D].
// Dispatch and combine are separate steps around the expert compute, with the layout (MoeSaved's
// router and layout views) as the handle that backward reuses: the expert-parallel all-to-all goes
// between them (spec/moe.md §6).
#pragma once

#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/buffer_spec.h"
#include "ops/lora.h"
#include "ops/router.h"
#include "ops/situ_glu.h"

namespace tessera::ops {

enum class MoeOverflow : uint8_t { reroute, drop };
enum class ExpertActivation : uint8_t { swiglu, situ };

// Each expert's segment is padded with zero rows to a multiple of this. The CPU's oneDNN tiles need
// no padding (padding measured 1-5% slower at E = 64-896); GPU tile schemes set their own.
constexpr int64_t kMoeRowAlign = 1;

struct MoeParams;
struct MoeWeights;
struct MoeSaved;
struct MoeScratch;

// The expert compute between dispatch and combine when the experts are not all here: forward turns the
// dispatched rows (s.xe, s.row_gate in the layout s.offsets) into t.ye; backward turns t.ye (holding dye)
// into t.dxe, t.row_dot and the gradients of the local experts' weights. Expert parallelism implements
// it (parallel/ep.h: the all-to-all goes inside); null = moe_experts_forward / _backward, every expert here.
// A non-owning reference to the work an expert stage runs while rows travel (no allocation, unlike
// std::function with captures: the MoE forward and backward stay off the heap).
class OverlapWork {
  public:
    OverlapWork() = default;
    template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, OverlapWork>) OverlapWork(F& f)
        : ctx_(&f), fn_([](void* c) { (*static_cast<F*>(c))(); }) {}
    void operator()() const {
        if (fn_) fn_(ctx_);
    }

  private:
    void* ctx_ = nullptr;
    void (*fn_)(void*) = nullptr;
};

class MoeExpertStage {
  public:
    virtual ~MoeExpertStage() = default;
    virtual int64_t local_experts() const = 0;  // experts whose weights are here (w_gate [local, F, L])
    // Capacity over all the ranks whose rows meet the experts here: this rank's room in each expert (E values,
    // valid until the next call), from its router choices per expert (`demand`, [E] i32) and `tokens`, so that
    // no expert receives more than ⌈c·(all ranks' tokens)·k/E⌉ rows. Collective over those ranks.
    virtual const int64_t* capacity_shares(double factor, int64_t tokens, TensorView demand) const = 0;
    // overlap: the layer's work that needs neither the experts nor the exchanged rows (the shared expert), run
    // by the calling thread while the rows travel.
    virtual void forward(
        const MoeParams& p, const MoeWeights& w, const MoeSaved& s, const MoeScratch& t, OverlapWork overlap) const = 0;
    virtual void backward(const MoeParams& p,
                          const MoeWeights& w,
                          const MoeWeights& g,
                          const MoeSaved& s,
                          const MoeScratch& t,
                          OverlapWork overlap) const = 0;
};

struct MoeParams {
    RouterParams router;
    double capacity_factor = 0.0;  // 0 = dropless
    MoeOverflow overflow = MoeOverflow::reroute;
    ExpertActivation activation = ExpertActivation::swiglu;
    SituParams situ;
    double norm_eps = 1e-6;      // latent_norm
    double seq_aux_coeff = 0.0;  // sequence-wise balance loss weight α (spec/moe.md §3.2)
    double z_loss_coeff = 0.0;   // router z-loss weight β (§3.4)
    // ∂L/∂ŝ_e of a loss pooled over layers (the global balance loss, ops/router.h), added in backward for every
    // token; empty = none. The caller computes it from every layer's router_balance_stats.
    std::span<const double> balance_grad = {};
    const MoeExpertStage* stage = nullptr;  // null: every expert's weights are here
    // the adapters' scale (MoeWeights::lora) and dropout: the shared and latent projections' (each its own stream
    // from lora.stream); the routed experts' adapters never drop (as PEFT's, which refuses dropout on them)
    LoraParams lora;
};

// LoRA adapters (ops/lora.h) of the layer's projections, each undefined (a) when that projection has none; in
// the gradient twin of MoeWeights, their gradients.
struct LoraPair {
    TensorView a, b;
};
struct MoeLora {
    LoraPair latent_down, latent_up, shared_gate, shared_up, shared_down;  // a [r, IN], b [OUT, r]
    LoraPair w_gate, w_up, w_down;  // the routed experts here: a [E, r, IN], b [E, OUT, r] (grouped GEMMs)
    int64_t rank() const;           // their common rank (0: none)
};

// The layer's weights (or their gradients); optional ones may be absent (default views).
struct MoeWeights {
    TensorView router_w, router_bias;
    TensorView w_gate, w_up, w_down;
    TensorView latent_down, latent_up, latent_norm;
    TensorView shared_gate, shared_up, shared_down;
    TensorView shared_scale = {};  // optional sigmoid gate of the shared expert's output
    MoeLora lora;
};

struct MoeDims {
    int64_t tokens = 0, d_model = 0, experts = 0, topk = 0, ffn = 0, latent = 0, shared_ffn = 0;
    bool has_latent = false, has_norm = false, has_shared = false, has_shared_scale = false;
    int64_t local_experts = 0;     // experts whose weights are here (= experts without an expert stage)
    bool expert_rows_here = true;  // the expert compute's rows (h, a and their gradients) live here, not in a stage
    int64_t lora_rank = 0;         // adapters: their rank (scratch lora_u, lora_du)
    bool lora_dropout = false;     // the shared and latent adapters drop their input (scratch lora_xd)
    int64_t max_rows() const { return tokens * topk + (kMoeRowAlign - 1) * experts; }
    int64_t capacity(double factor) const;  // rows per expert; 0 = unbounded
};
// Checks the weights' shapes against each other (errors name the tensor) and returns the sizes.
MoeDims moe_dims(const MoeParams& p, const MoeWeights& w, int64_t tokens);

// What forward keeps for backward, the layout handle included. i32 views are marked.
struct MoeSaved {
    TensorView logits, scores;  // [N, E]
    TensorView choice;          // [N, K] i32: the router's top-k (before capacity)
    TensorView expert;          // [N, K] i32: the final expert per slot, −1 = dropped
    TensorView gates;           // [N, K]: gate weights over the final set
    TensorView row;             // [N, K] i32: the slot's row in the expert buffers, −1 = dropped
    TensorView offsets;         // [E + 1] i32: padded segment starts
    TensorView counts;          // [E] i32: rows per expert (final load)
    TensorView demand;          // [E] i32: router choices per expert (for balancing)
    TensorView row_gate;        // [R]: the gate of each row (0 for padding)
    TensorView z;               // [N, L]: latent input (latent only)
    TensorView xe, h, a;        // [R, L], [R, 2F], [R, F]: dispatched rows, gate|up, gated activation
    TensorView c, rstd, n;      // [N, L], [N], [N, L]: combined, latent norm (latent only; n with the norm)
    TensorView sh, sa;          // [N, 2FS], [N, FS]: shared expert (shared only; sa scaled by ss)
    TensorView ss;              // [N]: σ(w_ss·x) (shared_scale only)
    // [E + 1] the offsets' host copy where the caller keeps one (device buffers): the CUDA layout writes it, and the
    // expert passes read it instead of reading the offsets back (each read-back waits for the stream). Null: read back.
    int32_t* offsets_host = nullptr;
};
// Transient buffers of forward and backward (may be shared between layers).
struct MoeScratch {
    TensorView ye;               // [R, L]: expert outputs, then their gradients
    TensorView dh, da, dxe;      // [R, 2F], [R, F], [R, L]
    TensorView row_dot;          // [R]
    TensorView dc, dn;           // [N, L]
    TensorView ds, du;           // [N, E]
    TensorView dg;               // [N, K]
    TensorView dsh, dsa;         // [N, 2FS], [N, FS]
    TensorView dss;              // [N] (shared_scale only)
    TensorView aux;              // [2E] f64: the sequence-wise aux loss's per-sequence f and P
    TensorView lora_u, lora_du;  // [max(N, R), r] (adapters only): their x·Aᵀ and its gradient
    TensorView lora_xd;          // [N, max(D, L, FS)] (adapters with dropout): the dropped input
};

// (the rows and hidden activations narrowable: model/model.h, train.activation_dtype)
void moe_saved_specs(const MoeDims& d, DType dtype, const std::string& prefix, std::vector<BufferSpec>& out);
void moe_scratch_specs(const MoeDims& d, DType dtype, const std::string& prefix, std::vector<BufferSpec>& out);
MoeSaved moe_bind_saved(const MoeDims& d, const BufferGroup& g, const std::string& prefix);
MoeScratch moe_bind_scratch(const MoeDims& d, const BufferGroup& g, const std::string& prefix);
// A layer's saved and scratch buffers in a group of their own on `device`, bound (the op's CLI binding, tests and
// benches; a model declares them among its activations instead).
struct MoeBuffers {
    BufferGroup group;
    MoeSaved saved;
    MoeScratch scratch;
};
MoeBuffers moe_buffers(const MoeDims& d, DType dtype, Device device);

struct MoeStats {
    int64_t rerouted = 0, dropped = 0;
    double seq_aux_loss = 0.0, z_loss = 0.0;  // values of the enabled router losses
};

// Route + capacity + layout (fills the router and layout views of `s`; t.aux is needed with seq_aux_coeff).
MoeStats moe_route(const MoeParams& p,
                   const MoeWeights& w,
                   TensorView x,
                   const MoeSaved& s,
                   const MoeScratch& t,
                   std::span<const int64_t> seq_starts);
// The layout from given final experts and gates (s.expert, s.gates of the first `tokens` tokens):
// counts, padded offsets, rows, row gates. moe_route ends with it.
void moe_build_layout(const MoeSaved& s, int64_t tokens);
// Dispatch: rows[row(n, j)] = src[n]; padding rows zeroed. Combine: dst[n] (+)= Σ_j rows[row(n, j)].
void moe_dispatch(const MoeSaved& s, TensorView src, TensorView rows);
void moe_combine(const MoeSaved& s, TensorView rows, TensorView dst, bool accumulate);

// The expert compute between dispatch and combine: s.xe -> s.h, s.a -> t.ye; and backward:
// t.ye (holding dye) -> t.da, t.dh, t.dxe, t.row_dot (the gate gradient of each row), weight gradients.
void moe_experts_forward(const MoeParams& p, const MoeWeights& w, const MoeSaved& s, const MoeScratch& t);
void moe_experts_backward(
    const MoeParams& p, const MoeWeights& w, const MoeWeights& g, const MoeSaved& s, const MoeScratch& t);

// y (+)= moe(x). seq_starts: sequence boundaries over the N tokens for the sequence-wise aux loss
// (empty = one sequence).
MoeStats moe_forward(const MoeParams& p,
                     const MoeWeights& w,
                     TensorView x,
                     TensorView y,
                     bool accumulate,
                     const MoeSaved& s,
                     const MoeScratch& t,
                     std::span<const int64_t> seq_starts = {});
// Gradients accumulate into dx and every defined view of `g` (the router bias gets none); the
// enabled router losses add their gradients.
void moe_backward(const MoeParams& p,
                  const MoeWeights& w,
                  TensorView x,
                  TensorView dy,
                  TensorView dx,
                  const MoeWeights& g,
                  const MoeSaved& s,
                  const MoeScratch& t,
                  std::span<const int64_t> seq_starts = {});

// Forward FLOPs per token: router, latent projections, k routed experts and the shared expert.
double moe_forward_flops_per_token(const MoeDims& d);

}  // namespace tessera::ops
