// The process mesh (see mesh.h).
#include "parallel/mesh.h"

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
    std::unique_ptr<Comm> split(int, int) override { refuse(); }

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

// Whether the layout has shard groups smaller than the world (HSDP); one-line errors for a layout that does not fit.
bool check_layout(int W, int ep, int shard) {
    TESSERA_CHECK(ep >= 1 && W % ep == 0,
                  "parallel.ep = {} does not divide the {} ranks (world size must be a multiple)", ep, W);
    TESSERA_CHECK(shard == 0 || (shard >= 2 && W % shard == 0),
                  "parallel.shard = {} does not divide the {} ranks into groups of at least 2", shard, W);
    return shard != 0 && shard < W;
}
}  // namespace

Mesh::Mesh(Comm& world, int ep, int shard) : world_(world), ep_(ep) {
    const int W = world_.size(), r = world_.rank();
    const bool hsdp = check_layout(W, ep, shard);
    expert_ = world_.split(expert_data_rank(r, ep), expert_rank(r, ep));
    expert_data_ = world_.split(expert_rank(r, ep), expert_data_rank(r, ep));
    if (!hsdp) return;
    shard_ = world_.split(r / shard, r % shard);
    replicas_ = world_.split(r % shard, r / shard);
}

Mesh::Mesh(std::unique_ptr<Comm> world, std::unique_ptr<Comm> expert, std::unique_ptr<Comm> expert_data, int ep)
    : owned_world_(std::move(world)),
      world_(*owned_world_),
      expert_(std::move(expert)),
      expert_data_(std::move(expert_data)),
      ep_(ep) {}

std::unique_ptr<Mesh> Mesh::layout(int world_size, int rank, int ep, int shard) {
    const bool hsdp = check_layout(world_size, ep, shard);
    TESSERA_CHECK(rank >= 0 && rank < world_size, "layout: rank {} of {} ranks", rank, world_size);
    std::unique_ptr<Mesh> m(new Mesh(std::make_unique<LayoutComm>(rank, world_size),
                                     std::make_unique<LayoutComm>(expert_rank(rank, ep), ep),
                                     std::make_unique<LayoutComm>(expert_data_rank(rank, ep), world_size / ep), ep));
    if (hsdp) {
        m->shard_ = std::make_unique<LayoutComm>(rank % shard, shard);
        m->replicas_ = std::make_unique<LayoutComm>(rank / shard, world_size / shard);
    }
    return m;
}

}  // namespace tessera::parallel
