// MoE router (spec/moe.md §2): scores from the full-width token, a selection-only bias, optional
// group-limited routing, top-k, and gate weights from the unbiased scores.
//   u = x·wᵀ;  s = softmax(u) or σ(u);  s̃ = s + bias (selection only)
//   groups > 1: experts form `groups` equal groups of consecutive ids; a group scores the sum of its
//   two largest s̃ when a bias is given, else its largest s; the topk_groups best groups stay
//   (ties: the lower group id)
//   top-k of s̃ over the allowed experts (ties: the lower expert id), slots in descending s̃ order
//   weights g_j = s_j (/ (Σ_{i∈S} s_i + 1e-20) when normalize) · scaling
// Shapes: x [N, D], w [E, D], bias [E] (optional), logits u and scores s [N, E] (saved for backward),
// indices [N, TOPK] (i32; −1 marks an empty slot, e.g. a dropped pair), weights [N, TOPK],
// counts [E] (i32: choices per expert).
// Backward (given dweights): through the normalisation and the score function to the logits, then
// dx += du·w, dw += duᵀ·x. The bias and the choice carry no gradient.
#pragma once

#include <span>

#include "core/tensor.h"
#include "ops/router_rows.h"

namespace tessera::ops {

enum class RouterScore : uint8_t { softmax, sigmoid };

struct RouterParams {
    int64_t topk = 2;
    RouterScore score = RouterScore::softmax;
    bool normalize = true;
    double scaling = 1.0;
    int64_t groups = 1;
    int64_t topk_groups = 1;
    void validate(int64_t experts) const;  // throws naming the bad parameter
    RouterRowParams row() const { return {topk, normalize, scaling, groups, topk_groups}; }
};

// logits = x·wᵀ, scores = f(logits)
void router_scores(const RouterParams& p, TensorView x, TensorView w, TensorView logits, TensorView scores);
// scores = f(logits) alone (router_scores' second half)
void router_score_function(const RouterParams& p, TensorView logits, TensorView scores);
// Top-k selection by s̃ within the allowed groups; weights from the chosen set; counts per expert.
void router_select(const RouterParams& p,
                   TensorView scores,
                   TensorView bias,
                   TensorView indices,
                   TensorView weights,
                   TensorView counts);
// Gate weights of the chosen set in `indices` (−1 slots get weight 0 and stay out of the normalisation).
void router_weights(const RouterParams& p, TensorView scores, TensorView indices, TensorView weights);
// Writes allowed[g] = 1 for the topk_groups best groups of one token (all ones when groups == 1).
void router_allowed_groups(const RouterParams& p, const float* s, const float* bias, int64_t E, uint8_t* allowed);
void router_allowed_groups(const RouterParams& p, const double* s, const double* bias, int64_t E, uint8_t* allowed);
inline bool router_expert_allowed(const RouterParams& p, const uint8_t* allowed, int64_t E, int64_t e) {
    return router_group_allows(p.row(), allowed, E, e);
}

// dscores [N, E] += dL/ds through the gate weights (entries outside the chosen set get nothing).
void router_weights_backward(
    const RouterParams& p, TensorView dweights, TensorView scores, TensorView indices, TensorView dscores);
// dlogits [N, E] += dL/du from dL/ds through the score function.
void router_score_backward(const RouterParams& p, TensorView scores, TensorView dscores, TensorView dlogits);

// Router auxiliary losses (spec/moe.md §3.2, §3.4); each returns its value and adds its gradient
// (when the gradient view is given).
// Sequence-wise balance loss over the sequences [starts[i], starts[i+1]) of the N tokens:
//   α · mean_seq Σ_e f_e·P_e, f_e = E/(k·T_s)·(choices of e in the sequence), P_e = mean_t s_e/Σ_j s_j.
// `indices` are the router's choices (before capacity); the gradient goes to dscores. scratch: at least
// 2·E doubles of the caller's (a sequence's f and P).
double router_seq_aux_loss(double alpha,
                           TensorView scores,
                           TensorView indices,
                           std::span<const int64_t> starts,
                           TensorView dscores,
                           std::span<double> scratch);
// Global balance loss (Switch Transformer eqs. 4–6, as transformers' load_balancing_loss_func computes it for
// Qwen3-Next): the router statistics of every MoE layer of a forward are pooled, then
//   α · E · Σ_e f_e·P_e,  f_e = c_e / R,  P_e = (Σ_rows ŝ_e) / R,  ŝ = s / Σ_j s_j (= s for softmax),
// with c_e the router choices of e over all R = tokens × layers rows (Σ_e f_e = k, unlike the sequence-wise
// loss's E/k normalisation). router_balance_stats adds one layer's c and Σ_rows ŝ; router_global_aux_loss
// returns the loss and writes grad[e] = ∂L/∂ŝ_e = α·E·c_e / R² (the same for every row of every layer);
// router_balance_backward adds Σ_rows of that gradient through ŝ = s/Σs into dscores.
void router_balance_stats(TensorView scores,
                          TensorView indices,
                          std::span<double> choices,
                          std::span<double> prob_sums);
double router_global_aux_loss(double alpha,
                              std::span<const double> choices,
                              std::span<const double> prob_sums,
                              double rows,
                              std::span<double> grad);
void router_balance_backward(std::span<const double> grad, TensorView scores, TensorView dscores);
// z-loss β·mean_t (log Σ_e exp u_{t,e})²; the gradient goes to dlogits.
double router_z_loss(double beta, TensorView logits, TensorView dlogits);

}  // namespace tessera::ops
