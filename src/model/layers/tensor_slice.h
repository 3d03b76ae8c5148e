// Tensor parallelism of an attention block (parallel.tensor = T, docs/parallel.md): the T ranks of a tensor group
// take the same micro-batch, and between attention blocks each holds 1/T of its token rows (rank t the rows
// [t·n, (t+1)·n), n = N / T; the feed-forward blocks, the embedding and the head see only those: sequence
// parallelism as in Megatron-LM, Korthikanti et al. 2022, arXiv 2205.05198). An attention block runs on every token
// but only its 1/T of the heads:
//   forward   x = all_gather(x_rows);  y_t = f_t(x) (this rank's heads);  x_out_rows = x_rows + Σ_t y_t's rows
//   backward  the same with the gradients: dy = all_gather(dres_rows), dx_t from f_t's backward,
//             dres_rows += Σ_t dx_t's rows (a reduce-scatter in rank order: deterministic)
// The wrapper holds the whole block (its parameters, as checkpoints and FSDP know them) and a block of the same kind
// built over T times fewer heads (`part`), which computes. Each parameter of the part is either the whole one (the
// same shape: read by every head, e.g. the input norm, a low-rank down-projection, the per-dimension output norm) or
// the rank's 1/T slice along the one dimension whose size differs (head-major rows of a projection, columns of o_proj,
// per-head gates). Before each pass the slices are copied into the part's parameters; after backward the part's
// gradients are added into the whole gradient there. A whole-shared parameter's gradient is then this rank's heads'
// share, and a slice's gradient is zero outside the slice, so the data-parallel gradient sum over every rank (the
// tensor group's ranks are data ranks to it) adds up to the micro-batch's gradient: nothing else changes for FSDP,
// the optimizer or checkpoints. The result equals one rank's up to the order of the sum over heads.
#pragma once

#include <memory>

#include "model/layers/block.h"
#include "parallel/comm.h"

namespace tessera::model {

class TensorSlice : public Block {
  public:
    // whole and part: the same block over all heads and over 1/T of them; group: the T ranks (borrowed).
    TensorSlice(std::unique_ptr<Block> whole, std::unique_ptr<Block> part, parallel::Comm& group, int64_t d_model);

    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const override;
    // The parameters as the model finally holds them: model.lora freezes the base (no gradient) and may hold it in
    // bf16; the part's copies follow (called once the model's specs are final, before declare_scratch).
    void held_as(const std::vector<BufferSpec>& params);
    void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const override;
    size_t workspace_bytes(StepShape max, int num_threads) const override;
    void bind_params(const BufferGroup& params, const BufferGroup* grads) override;
    void bind_saved(const BufferGroup& acts, const std::string& prefix) override;
    void bind_scratch(const BufferGroup& acts, const std::string& prefix) override;
    // s: the whole micro-batch; x_in, x_out, dres: this rank's N / T rows of it (Model checks that N splits)
    void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) override;
    void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) override;
    void step(int64_t, int64_t, TensorView, TensorView, std::span<std::byte>) override;  // refused
    double forward_flops_per_token(int64_t seq) const override { return whole_->forward_flops_per_token(seq); }
    // what one rank computes per token of the micro-batch: its 1/T of the heads and what every rank computes whole
    double part_forward_flops_per_token(int64_t seq) const { return part_->forward_flops_per_token(seq); }
    std::string kind() const override { return part_->kind(); }
    void set_pass(const PassOptions& o) override { part_->set_pass(o); }

  private:
    // One parameter of the part: the whole one (dim −1) or its slice [t·d, (t+1)·d) along dim, read as
    // [outer, T·d, inner] from the whole and [outer, d, inner] in the part.
    struct Piece {
        std::string name;
        int dim = -1;
        int64_t outer = 1, d = 0, inner = 1;
        size_t bytes = sizeof(float);  // an element's (f32, or a frozen base's bf16)
        bool once =
            false;  // every rank computes all of its gradient (Block::head_independent_gradient): rank 0 adds it
    };
    void lay_out();      // part_params_ and part_grads_ from part_specs_
    void pack_params();  // the part's parameters from the whole ones
    void add_grads();    // the part's gradients into the whole ones
    // this rank's n rows into the group's [n·T, C] in rank order; and rows += the sum over the group of each rank's
    // block of `all` for this rank (a reduce-scatter in rank order; x_ is its scratch)
    void gather_rows(TensorView rows, TensorView all, int64_t n);
    void add_scattered(TensorView all, TensorView rows, int64_t n);

    std::unique_ptr<Block> whole_, part_;
    parallel::Comm& group_;
    int64_t T_, t_, C_;
    std::vector<Piece> pieces_;
    std::vector<BufferSpec> part_specs_;                  // the part's parameters, as the pieces hold them
    std::vector<int64_t> counts_;                         // the reduce-scatter's blocks: n·C elements each
    BufferGroup part_params_, part_grads_;                // laid out in scratch ("tensor.params", "tensor.grads")
    std::vector<TensorView> whole_params_, whole_grads_;  // per piece (grads: undefined without gradients)
    std::vector<TensorView> part_grads_of_;               // per piece (undefined: frozen, or without gradients)
    bool has_grads_ = false;
    TensorView x_, y_;  // scratch [N, C]: the gathered input; the partial output, then the gathered gradient
};

}  // namespace tessera::model
