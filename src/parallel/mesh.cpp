// The process mesh (see mesh.h).
#include "parallel/mesh.h"

#include <array>

#include "core/check.h"

namespace tessera::parallel {

namespace {
// A communicator of `size` ranks seen from `rank`, for building a rank's state without running the job: every
// transfer (and split) refused.
class LayoutComm final : public Comm {
  public:
    LayoutComm(int rank, int size) : rank_(rank), size_(size) {}
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string backend() const override { return "layout"; }
    std::unique_ptr<Comm> do_split(int, int) override { refuse(); }

  protected:
    [[noreturn]] static void refuse() { throw Error("layout: a planned rank's communicator cannot communicate"); }
    void do_all_gather_v(std::span<const std::byte>, std::span<std::byte>, std::span<const int64_t>) override {
        refuse();
    }
    void do_all_to_all_v(std::span<const std::byte>,
                         std::span<const int64_t>,
                         std::span<std::byte>,
                         std::span<const int64_t>) override {
        refuse();
    }
    void do_broadcast(std::span<std::byte>, int) override { refuse(); }
    void do_barrier() override { refuse(); }
    Handle submit(std::function<void()>) override { refuse(); }

  private:
    int rank_, size_;
};

// Whether the layout has shard groups smaller than a stage (HSDP); one-line errors for a layout that does not fit.
bool check_layout(int W, int ep, int shard, int pp, int tp) {
    TESSERA_CHECK(pp >= 1 && W % pp == 0, "parallel.pipeline = {} does not divide the {} ranks into stages", pp, W);
    const int D = W / pp;
    TESSERA_CHECK(ep >= 1 && D % ep == 0,
                  "parallel.ep = {} does not divide the {} ranks{} (world size must be a multiple)", ep, D,
                  pp > 1 ? " of a pipeline stage" : "");
    TESSERA_CHECK(shard == 0 || (shard >= 2 && D % shard == 0),
                  "parallel.shard = {} does not divide the {} ranks{} into groups of at least 2", shard, D,
                  pp > 1 ? " of a pipeline stage" : "");
    TESSERA_CHECK(tp >= 1 && D % tp == 0, "parallel.tensor = {} does not divide the {} ranks{} into tensor groups", tp,
                  D, pp > 1 ? " of a pipeline stage" : "");
    return shard != 0 && shard < D;
}
}  // namespace

Mesh::Mesh(Comm& world, int ep, int shard, int pp, int tp) : world_(world), ep_(ep), pp_(pp) {
    const int W = world_.size();
    const bool hsdp = check_layout(W, ep, shard, pp, tp);
    if (pp > 1) {
        const int D = W / pp, s = world_.rank() / D;
        stage_ = world_.split(s, world_.rank());
        pipeline_ = world_.split(world_.rank() % D, s);
        // the stage pairs (0,1), (2,3), ... then (1,2), (3,4), ...; a stage at either end is alone in one of them
        std::unique_ptr<Comm> even = pipeline_->split(s / 2, s), odd = pipeline_->split((s + 1) / 2, s);
        std::unique_ptr<Comm>&after = s % 2 == 0 ? even : odd, &before = s % 2 == 0 ? odd : even;
        if (s + 1 < pp) next_ = std::move(after);
        if (s > 0) prev_ = std::move(before);
    }
    Comm& d = data();
    const int r = d.rank();
    expert_ = d.split(expert_data_rank(r, ep), expert_rank(r, ep));
    expert_data_ = d.split(expert_rank(r, ep), expert_data_rank(r, ep));
    if (tp > 1) tensor_ = d.split(r / tp, r % tp);
    if (!hsdp) return;
    shard_ = d.split(r / shard, r % shard);
    replicas_ = d.split(r % shard, r / shard);
}

Mesh::Mesh(std::unique_ptr<Comm> world, std::unique_ptr<Comm> expert, std::unique_ptr<Comm> expert_data, int ep)
    : owned_world_(std::move(world)),
      world_(*owned_world_),
      expert_(std::move(expert)),
      expert_data_(std::move(expert_data)),
      ep_(ep) {}

std::unique_ptr<Mesh> Mesh::layout(int world_size, int rank, int ep, int shard, int pp, int tp) {
    const bool hsdp = check_layout(world_size, ep, shard, pp, tp);
    TESSERA_CHECK(rank >= 0 && rank < world_size, "layout: rank {} of {} ranks", rank, world_size);
    const int D = world_size / pp, r = rank % D, s = rank / D;
    std::unique_ptr<Mesh> m(new Mesh(std::make_unique<LayoutComm>(rank, world_size),
                                     std::make_unique<LayoutComm>(expert_rank(r, ep), ep),
                                     std::make_unique<LayoutComm>(expert_data_rank(r, ep), D / ep), ep));
    m->pp_ = pp;
    if (pp > 1) {
        m->stage_ = std::make_unique<LayoutComm>(r, D);
        m->pipeline_ = std::make_unique<LayoutComm>(s, pp);
        if (s > 0) m->prev_ = std::make_unique<LayoutComm>(1, 2);
        if (s + 1 < pp) m->next_ = std::make_unique<LayoutComm>(0, 2);
    }
    if (tp > 1) m->tensor_ = std::make_unique<LayoutComm>(r % tp, tp);
    if (hsdp) {
        m->shard_ = std::make_unique<LayoutComm>(r % shard, shard);
        m->replicas_ = std::make_unique<LayoutComm>(r / shard, D / shard);
    }
    return m;
}

Handle exchange_async(Comm& pair, std::span<const std::byte> send, std::span<std::byte> recv) {
    TESSERA_CHECK(pair.size() == 2, "exchange: a group of {} ranks, not a pair", pair.size());
    const size_t peer = size_t(1 - pair.rank());
    std::array<int64_t, 2> send_bytes{}, recv_bytes{};
    send_bytes[peer] = int64_t(send.size());
    recv_bytes[peer] = int64_t(recv.size());
    // (the counts are copied: the collective runs later on the communication thread)
    return pair.all_to_all_v_async(send, send_bytes, recv, recv_bytes);
}

}  // namespace tessera::parallel
