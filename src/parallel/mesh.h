// The process mesh: which ranks share what (DESIGN.md, src/parallel/). W = EDP × EP ranks:
//   data         all W ranks: each takes its own micro-batches; ZeRO shards the replicated parameters' state over it
//   shard        S consecutive ranks [g·S, (g+1)·S) (S = W unless HSDP: parallel.shard): FSDP shards the dense
//                parameters, gradients and AdamW state over it
//   replica      the W / S ranks at the same place in their shard group: they hold the same dense ranges and
//                all-reduce their gradient (HSDP)
//   expert (EP)  EP consecutive ranks [g·EP, (g+1)·EP): tokens meet their experts by all-to-all here;
//                each member holds E/EP of every MoE layer's experts
//   expert-data  the EDP ranks at the same place in their expert group: they hold the same experts and
//                shard those experts' parameters among themselves
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace tessera::parallel {

class Mesh {
  public:
    // Throws a one-line error when the layout does not fit (W not a multiple of ep). world: borrowed, it
    // must outlive the mesh.
    // shard: ranks per shard group (0: every rank), a divisor of W.
    Mesh(Comm& world, int ep, int shard = 0);
    // One rank's mesh of a job that is not running (the planner, plan/memory.h): each communicator knows its
    // rank and size, and a transfer on it throws.
    static std::unique_ptr<Mesh> layout(int world_size, int rank, int ep, int shard = 0);
    // World rank r's place in its expert group and in its expert-data group (and in its shard group: r % shard).
    static int expert_rank(int r, int ep) { return r % ep; }
    static int expert_data_rank(int r, int ep) { return r / ep; }
    Comm& data() const { return world_; }
    Comm& shard() const { return shard_ ? *shard_ : world_; }
    Comm* replicas() const { return replicas_.get(); }  // null: one shard group (plain FSDP)
    Comm& expert() const { return *expert_; }
    Comm& expert_data() const { return *expert_data_; }
    int world_size() const { return world_.size(); }
    int rank() const { return world_.rank(); }
    int ep() const { return ep_; }
    int edp() const { return world_.size() / ep_; }

  private:
    Mesh(std::unique_ptr<Comm> world, std::unique_ptr<Comm> expert, std::unique_ptr<Comm> expert_data, int ep);
    std::unique_ptr<Comm> owned_world_;  // layout(): the mesh owns its world
    Comm& world_;
    std::unique_ptr<Comm> expert_, expert_data_;
    std::unique_ptr<Comm> shard_, replicas_;  // HSDP only (shard_ null: the world)
    int ep_;
};

}  // namespace tessera::parallel
