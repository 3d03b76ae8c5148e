// Expert parallelism (spec/moe.md §6): the E experts of an MoE layer spread over the EP ranks of the
// expert group, rank q holding experts [q·E/EP, (q+1)·E/EP). It is the MoE op's expert stage
// (ops::MoeExpertStage): the router, dispatch and combine stay on every rank for its own tokens; between
// dispatch and combine the rows travel to the rank of their expert and back:
//   forward:  segment sizes exchanged (all-to-all of E/EP counts per pair) -> rows and their gates
//             all-to-all-v'd to the owners (each destination's rows are one slab of the expert-contiguous
//             layout, sent as they lie) -> regrouped expert-major (expert, source rank, source order) ->
//             grouped GEMMs on the local experts -> back to source-major -> all-to-all-v home, into the
//             rows' own places in the layout.
//   backward: the same path with the layout the forward left (the counts are kept per layer): dye out,
//             dxe and each row's gate gradient home; the local experts' weight gradients stay here.
// The order of rows on the expert's rank is fixed by (expert, source rank, source row), so the result
// does not depend on timing. Buffers come from buffer specs like every other activation; the rows that
// can reach one rank are bounded by EP × tokens × top-k (every token of every rank choosing its experts:
// dropless worst case). parallel/ knows token layouts, never the model.
#pragma once

#include <vector>

#include "core/buffer_spec.h"
#include "ops/moe.h"
#include "parallel/comm.h"

namespace tessera::parallel {

struct EpDims {
    int64_t experts = 0, topk = 0, latent = 0, ffn = 0;
};

class ExpertParallelStage final : public ops::MoeExpertStage {
  public:
    // One-line error unless EP divides the experts.
    ExpertParallelStage(Comm& expert_group, EpDims dims);

    int64_t local_experts() const override { return local_; }
    int64_t first_expert() const { return int64_t(comm_.rank()) * local_; }
    // rows that can reach this rank when each rank routes at most `tokens` tokens
    int64_t max_rows(int64_t tokens) const { return int64_t(comm_.size()) * tokens * d_.topk; }

    // Per layer, kept for backward (the layout handle and the local rows), and shared transients; tokens: the
    // most a rank routes at once.
    void saved_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const;
    void scratch_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const;
    void bind_saved(const BufferGroup& acts, const std::string& prefix);
    void bind_scratch(const BufferGroup& acts, const std::string& prefix);

    void forward(const ops::MoeParams& p,
                 const ops::MoeWeights& w,
                 const ops::MoeSaved& s,
                 const ops::MoeScratch& t) const override;
    void backward(const ops::MoeParams& p,
                  const ops::MoeWeights& w,
                  const ops::MoeWeights& g,
                  const ops::MoeSaved& s,
                  const ops::MoeScratch& t) const override;

    // Bytes this rank sent to other ranks in the last forward's row exchange (both directions, rows and gates).
    int64_t last_forward_bytes() const { return last_bytes_; }

  private:
    // rows [.., cols] of the global layout -> the owners, regrouped expert-major into `local`
    void to_experts(const ops::MoeSaved& s, const float* rows, int64_t cols, float* local) const;
    // expert-major local rows [.., cols] -> home, into the global layout `rows`
    void from_experts(const ops::MoeSaved& s, const float* local, int64_t cols, float* rows) const;
    void exchange_counts(const ops::MoeSaved& s) const;  // forward: fills the layer's layout handle
    ops::MoeSaved local_saved() const;
    ops::MoeScratch local_scratch() const;

    Comm& comm_;
    EpDims d_;
    int64_t local_;
    // the layer's layout handle: rows from source rank r for local expert e at recv_counts[r·local + e]
    TensorView recv_counts_, offsets_, counts_;
    TensorView xe_, h_, a_, row_gate_;         // saved: the local rows, expert-major
    TensorView ye_, dh_, da_, dxe_, row_dot_;  // scratch
    TensorView stage_;                         // scratch: rows as received, source-major
    mutable std::vector<int64_t> send_bytes_, recv_bytes_, seg_send_, seg_recv_;
    mutable std::vector<int32_t> seg_;  // padded segment size per expert (sent in forward)
    mutable int64_t last_bytes_ = 0;
};

}  // namespace tessera::parallel
