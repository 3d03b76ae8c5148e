// The process mesh: which ranks share what (DESIGN.md, src/parallel/). W = PP × EDP × EP ranks:
//   world        all W ranks: checkpoints number their files over it
//   pipeline     the PP ranks at the same place in their stage (pipeline parallelism, parallel.pipeline: each holds
//                a stage of consecutive layers; activations go forward to the next stage, gradients back); stage s
//                is the D = W / PP consecutive ranks [s·D, (s+1)·D), and every group below is one stage's
//   data         the D ranks of a stage: each takes its own micro-batches; ZeRO shards the replicated parameters'
//                state over it
//   shard        S consecutive ranks [g·S, (g+1)·S) (S = D unless HSDP: parallel.shard): FSDP shards the dense
//                parameters, gradients and AdamW state over it
//   replica      the D / S ranks at the same place in their shard group: they hold the same dense ranges and
//                all-reduce their gradient (HSDP)
//   expert (EP)  EP consecutive ranks [g·EP, (g+1)·EP): tokens meet their experts by all-to-all here;
//                each member holds E/EP of every MoE layer's experts
//   expert-data  the EDP ranks at the same place in their expert group: they hold the same experts and
//                shard those experts' parameters among themselves
//   tensor (TP)  TP consecutive ranks [g·TP, (g+1)·TP) (parallel.tensor): they take the same micro-batches, each
//                keeps 1/TP of its tokens between the attention blocks and runs 1/TP of each attention block's
//                heads over all of them (model/layers/tensor_slice.h); to every other group they are data ranks
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace tessera::parallel {

class Mesh {
  public:
    // Throws a one-line error when the layout does not fit (W not a multiple of pp, W / pp not of ep or tp). world:
    // borrowed, it must outlive the mesh.
    // shard: ranks per shard group (0: every rank of the stage), a divisor of W / pp. pp: pipeline stages. tp: ranks
    // per tensor group.
    Mesh(Comm& world, int ep, int shard = 0, int pp = 1, int tp = 1);
    // One rank's mesh of a job that is not running (the planner, plan/memory.h): each communicator knows its
    // rank and size, and a transfer on it throws.
    static std::unique_ptr<Mesh> layout(int world_size, int rank, int ep, int shard = 0, int pp = 1, int tp = 1);
    // World rank r's place in its expert group and in its expert-data group (and in its shard group: r % shard),
    // r counted within its stage.
    static int expert_rank(int r, int ep) { return r % ep; }
    static int expert_data_rank(int r, int ep) { return r / ep; }
    Comm& world() const { return world_; }
    Comm& data() const { return stage_ ? *stage_ : world_; }
    Comm& shard() const { return shard_ ? *shard_ : data(); }
    Comm* replicas() const { return replicas_.get(); }  // null: one shard group (plain FSDP)
    Comm& expert() const { return *expert_; }
    Comm& expert_data() const { return *expert_data_; }
    Comm* tensor() const { return tensor_.get(); }  // null: no tensor parallelism (tp = 1)
    int tp() const { return tensor_ ? tensor_->size() : 1; }
    int world_size() const { return world_.size(); }
    int rank() const { return world_.rank(); }
    int ep() const { return ep_; }
    int edp() const { return data().size() / ep_; }
    // Pipeline parallelism: this rank's stage of pp(), the pipeline group (null with one stage), and the two-rank
    // groups this stage shares with the stage before and after it (null at the ends) for exchange().
    int pp() const { return pp_; }
    int stage() const { return world_.rank() / data().size(); }
    Comm* pipeline() const { return pipeline_.get(); }
    Comm* prev() const { return prev_.get(); }
    Comm* next() const { return next_.get(); }

  private:
    Mesh(std::unique_ptr<Comm> world, std::unique_ptr<Comm> expert, std::unique_ptr<Comm> expert_data, int ep);
    std::unique_ptr<Comm> owned_world_;  // layout(): the mesh owns its world
    Comm& world_;
    std::unique_ptr<Comm> stage_, pipeline_, prev_, next_;  // pp > 1 only
    std::unique_ptr<Comm> expert_, expert_data_;
    std::unique_ptr<Comm> shard_, replicas_;  // HSDP only (shard_ null: the stage)
    std::unique_ptr<Comm> tensor_;            // tp > 1 only
    int ep_, pp_ = 1;
};

// Point to point over a two-rank group (Mesh::prev / next): sends `send` to the other member and receives `recv`
// from it (either may be empty). The other member calls it with the sizes swapped, in the same order.
Handle exchange_async(Comm& pair, std::span<const std::byte> send, std::span<std::byte> recv);
inline void exchange(Comm& pair, std::span<const std::byte> send, std::span<std::byte> recv) {
    exchange_async(pair, send, recv).wait();
}

}  // namespace tessera::parallel
