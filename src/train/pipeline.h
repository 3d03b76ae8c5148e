// Pipeline parallelism (parallel.pipeline; docs/parallel.md): one rank's part of a step as a stage of consecutive
// layers, the micro-batches scheduled one forward, one backward (1F1B; Narayanan et al., "Memory-efficient
// pipeline-parallel DNN training", arXiv 2006.09503; the non-interleaved schedule of Megatron-LM).
//
// Stage s of P with M micro-batches runs w = min(P − s − 1, M) forwards ahead, then alternates a forward and a
// backward, then the w backwards left. Every transfer is a pairwise exchange with the stage before or after
// (parallel::exchange): its activations forward, its input's gradient back, a send and a receive combined where the
// schedule has both, so each pair of neighbours makes the same exchanges in the same order and none waits on a
// third. The last stage runs each micro-batch's forward and backward together. A stage before it keeps each
// micro-batch in flight (at most w + 1 of them) in one of two ways (parallel.pipeline_rerun): a copy of the whole
// activation group as its forward left it, restored before its backward (the default: w + 1 activation sets more,
// one copy each way), or only its input, re-running the forward from it before the backward (one forward more per
// micro-batch, the activations of one). Either way a micro-batch's gradient is the whole model's bits
// (tests/model/test_model.cpp). The gradient norm adds the stages'
// sums in stage order, so with clipping its last bits may differ from one process's; without, the step is one
// process's.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/buffer_spec.h"
#include "model/model.h"
#include "parallel/mesh.h"
#include "train/telemetry.h"

namespace tessera::train {

// One stage's part of a 1F1B step, in order (one_f_one_b): what PipelineStep::run carries out and what the planner's
// simulation lays out in time (plan/plan.h). An exchange is one pairwise transfer with the stage before or after, both
// ways at once: with the next stage it sends micro-batch `send`'s output and receives the gradient of micro-batch
// `receive`'s output; with the one before, it sends the gradient of `send`'s input and receives `receive`'s input (−1:
// nothing that way). Each pair of neighbours lists the same exchanges in the same order.
struct PipelineOp {
    enum class Kind {
        load,              // read micro-batch `micro`'s data
        forward,           // its forward (a stage before the last)
        backward,          // its backward, the forward re-run first (a stage before the last)
        forward_backward,  // both at once (the last stage)
        exchange,
    };
    Kind kind = Kind::load;
    int64_t micro = -1;               // load, forward, backward, forward_backward
    bool next = false;                // exchange: with the stage after (else before)
    int64_t send = -1, receive = -1;  // exchange
    bool operator==(const PipelineOp&) const = default;
};
// Stage `stage` of `stages` over `micros` micro-batches: w = min(stages − stage − 1, micros) forwards ahead, then one
// forward and one backward in turn, then the w backwards left; micro-batch m's data is loaded just before its input
// arrives. (stages ≥ 2)
std::vector<PipelineOp> one_f_one_b(int64_t stage, int64_t stages, int64_t micros);

class PipelineStep {
  public:
    // mesh: with pp() > 1; micros: micro-batches per step (train.accumulation); max: their shape; recompute: the
    // model's (its activation group's specs); rerun: parallel.pipeline_rerun
    PipelineStep(const model::Model& model,
                 const parallel::Mesh& mesh,
                 int64_t micros,
                 model::StepShape max,
                 const model::Recompute& recompute,
                 bool rerun);
    // what keeps the micro-batches in flight (empty on the last stage): copies of the activation group and the
    // received gradient, or the inputs (not on the first stage either); the runtime allocates it
    BufferGroup& group() { return kept_; }
    // acts: the runtime's activation group, from the specs the constructor sized its copies by
    void bind(model::Model& model, const BufferGroup& acts);

    // One step's micro-batches. load(m, ids, targets): fills micro-batch m's data and returns its shape (called once
    // per micro-batch, in order); prepare(m, targets): before each pass over micro-batch m (its forward and its
    // backward), returns its loss scale; before(m) / after(m) around its backward (GradientSum). Returns the sum of
    // the micro-batches' losses on the last stage, each times its scale when weighted (0 elsewhere); the time spent
    // waiting for neighbours goes to phases.communication, load's to phases.data.
    using Load = std::function<model::StepShape(int64_t, std::span<int32_t>, std::span<int32_t>)>;
    using Prepare = std::function<double(int64_t, std::span<const int32_t>)>;
    using Around = std::function<void(int64_t)>;
    double run(const Load& load,
               const Prepare& prepare,
               const Around& before,
               const Around& after,
               bool weighted,
               StepPhases& phases);

    // Evaluation: one batch forward through the stages; the loss on the last stage, {} before it.
    model::LossResult forward_loss(model::StepShape s, std::span<const int32_t> ids, std::span<const int32_t> targets);

    // the last stage's value on every stage (a collective over the pipeline group)
    double from_last(double v);
    // every stage's layer statistics (routing, indexer KL) on every stage, in layer order (a collective over the
    // pipeline group): the metrics and alerts of rank 0 see every layer. Recycled as Model::take_step_stats' result is.
    std::shared_ptr<const model::StepStats> all_stages(const model::StepStats& mine);

    int64_t in_flight() const { return slots_; }  // micro-batches whose data this stage keeps at once
    bool reruns() const { return rerun_; }

  private:
    struct Slot {
        std::vector<int32_t> ids, targets;
        std::vector<int64_t> cu;  // document boundaries
        model::StepShape shape;
    };
    void receive(parallel::Comm* pair, std::span<std::byte> into, StepPhases& phases);
    void send(parallel::Comm* pair, std::span<const std::byte> from, StepPhases& phases);
    void send_receive(parallel::Comm* pair,
                      std::span<const std::byte> from,
                      std::span<std::byte> into,
                      StepPhases& phases);
    std::span<std::byte> bytes(TensorView v) const { return {static_cast<std::byte*>(v.data), v.nbytes()}; }

    model::Model* model_ = nullptr;
    parallel::Comm *pipeline_, *prev_, *next_;
    int64_t micros_, slots_;
    std::vector<PipelineOp> ops_;  // this stage's schedule
    model::StepShape max_;
    int64_t d_model_;
    bool rerun_;
    size_t acts_bytes_ = 0;  // the activation group's
    const BufferGroup* acts_ = nullptr;
    std::vector<std::pair<size_t, size_t>> runs_;  // (offset, bytes): what a copy of the group holds of it
    size_t kept_bytes_ = 0;                        // Σ bytes of runs_: one copy's
    // rerun: "pipeline.inputs" [slots·N, C] (stages between the first and the last); else "pipeline.activations"
    // [slots, bytes of the activation group] (u8) and "pipeline.grad" [N, C], the gradient received for the next
    // backward
    BufferGroup kept_;
    TensorView inputs_, sets_, grad_;  // its buffers (bind; undefined where it has none)
    std::vector<Slot> data_;
    std::vector<int64_t> tokens_;            // each micro-batch's tokens (from its load)
    std::vector<double> packed_, gathered_;  // all_stages' buffers
    std::vector<int64_t> sizes_;
    std::shared_ptr<model::StepStats> all_;  // all_stages' last result
};

}  // namespace tessera::train
