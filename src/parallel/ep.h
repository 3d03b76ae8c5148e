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
// can reach one rank are bounded by EP × tokens × min(top-k, E/EP) (every token of every rank choosing as many
// of its distinct experts here as it can: the dropless worst case), or with a capacity factor by the local
// experts' room. On a GPU the layout is planned on the host from counts read back, and rows move by device copies
// and NCCL. parallel/ knows token layouts, never the model.
#pragma once

#include <vector>

#include "core/buffer_spec.h"
#include "ops/moe.h"
#include "parallel/comm.h"

namespace tessera::parallel {

struct EpDims {
    int64_t experts = 0, topk = 0, latent = 0, ffn = 0;
    // Overlap: the local experts in this many groups, each group's rows exchanged on the communication thread
    // while the previous group's experts compute (dispatch(c+1) ‖ experts(c) ‖ combine(c−1), spec/moe.md §7);
    // 1 = exchange everything, then compute. The results do not depend on it.
    int64_t chunks = 1;
    // > 0: the capacity factor c of the layer; no local expert then receives more than ⌈c·EP·tokens·k/E⌉ rows
    // (capacity_shares), which bounds the receive buffers far below the dropless worst case
    double capacity_factor = 0.0;
    int64_t lora_rank = 0;  // the experts' LoRA adapters (ops::MoeLora): scratch for their rows
};

// Seconds of a layer's exchanges: how long the calling thread waited for them (exposed), and how long the
// communication thread spent in them (link delay included).
struct EpTimes {
    double exposed = 0.0, communication = 0.0;
};

class ExpertParallelStage final : public ops::MoeExpertStage {
  public:
    // One-line error unless EP divides the experts.
    ExpertParallelStage(Comm& expert_group, EpDims dims);

    int64_t local_experts() const override { return local_; }
    // Global capacity: every rank's demand and token count gathered; each expert's room
    // C = ⌈c·(Σ tokens)·k/E⌉ is shared max-min fairly (ranks wanting less than an equal share get all they want,
    // the others split the rest equally, the lower ranks taking the remainder), and room nobody wants is split
    // equally for re-routed rows. So an expert never receives more than C rows, and room one rank leaves unused
    // serves another's overflow instead of dropping it.
    const int64_t* capacity_shares(double factor, int64_t tokens, TensorView demand) const override;
    int64_t first_expert() const { return int64_t(comm_.rank()) * local_; }
    int64_t chunks() const { return int64_t(chunk_.size()) - 1; }
    // rows that can reach this rank when each rank routes at most `tokens` tokens: every token of every rank
    // choosing min(top-k, E/EP) experts here (dropless), or each local expert full (with a capacity)
    int64_t max_rows(int64_t tokens) const;

    // Per layer, kept for backward (the layout handle and the local rows), and shared transients; tokens: the
    // most a rank routes at once.
    void saved_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const;
    void scratch_specs(const std::string& prefix, int64_t tokens, std::vector<BufferSpec>& out) const;
    void bind_saved(const BufferGroup& acts, const std::string& prefix);
    void bind_scratch(const BufferGroup& acts, const std::string& prefix);

    void forward(const ops::MoeParams& p,
                 const ops::MoeWeights& w,
                 const ops::MoeSaved& s,
                 const ops::MoeScratch& t,
                 ops::OverlapWork overlap) const override;
    void backward(const ops::MoeParams& p,
                  const ops::MoeWeights& w,
                  const ops::MoeWeights& g,
                  const ops::MoeSaved& s,
                  const ops::MoeScratch& t,
                  ops::OverlapWork overlap) const override;

    // Bytes this rank sent to other ranks in the last forward's row exchange (rows and gates, out and back).
    int64_t last_forward_bytes() const { return last_bytes_; }
    // The exchanges' times since the last take (forwards, recomputed forwards and backwards).
    EpTimes take_times() const {
        const EpTimes t = times_;
        times_ = {};
        return t;
    }

  private:
    struct Buffer;
    std::vector<Buffer> buffers(bool saved, int64_t tokens) const;
    void exchange_counts(const ops::MoeSaved& s) const;  // forward: fills the layer's layout handle
    void load_layout(const ops::MoeSaved& s) const;      // backward: the handle (the forward's) back on the host
    // The expert groups' exchanges, pipelined: out(c) sends chunk c's rows of `home` (global layout, cols wide)
    // to their experts (expert-major into `local`); overlap() runs once every chunk is on its way; work(c)
    // computes; back(c) brings `local_out` rows home.
    template <class Work>
    void pipeline(const ops::MoeSaved& s,
                  const std::vector<std::pair<TensorView, TensorView>>& out,
                  const std::vector<int64_t>& out_cols,
                  ops::OverlapWork overlap,
                  Work&& work,
                  const std::vector<std::pair<TensorView, TensorView>>& back,
                  const std::vector<int64_t>& back_cols) const;
    ops::MoeSaved chunk_saved(int64_t c) const;
    ops::MoeScratch chunk_scratch(int64_t c) const;
    ops::MoeWeights chunk_weights(const ops::MoeWeights& w, int64_t c) const;

    Comm& comm_;
    EpDims d_;
    int64_t local_;
    std::vector<int64_t> chunk_;  // local experts [chunk_[c], chunk_[c + 1]) form group c
    // the layer's layout handle: rows from source rank r for local expert e at recv_counts[r·local + e]
    TensorView recv_counts_, offsets_, counts_;
    TensorView xe_, h_, a_, row_gate_;         // saved: the local rows, expert-major
    TensorView ye_, dh_, da_, dxe_, row_dot_;  // scratch
    TensorView lora_u_, lora_du_;              // scratch of the experts' adapters (LoRA only)
    TensorView stage_, pack_;                  // scratch: rows as exchanged (source-major), on either side
    TensorView chunk_offsets_;                 // scratch: one group's offsets (as moe_experts_forward reads them)
    // the layout on the host, which the pipeline reads (exchange_counts makes it, load_layout reads the layer's handle
    // back): the home offsets by expert, the rows from each source per local expert, the local offsets and counts
    struct HostLayout {
        std::vector<int32_t> off, rc, lo, cnt;
    };
    mutable HostLayout host_;
    mutable std::vector<int32_t> host_demand_;
    mutable std::vector<int64_t> seg_send_, seg_recv_;
    mutable std::vector<int32_t> seg_, chunk_offsets_host_;  // padded segment size per expert; one group's offsets
    mutable int64_t last_bytes_ = 0;
    mutable std::vector<int64_t> demand_all_, share_, fair_;  // capacity_shares (sized once)
    mutable std::vector<int> order_;
    mutable EpTimes times_;
};

}  // namespace tessera::parallel
