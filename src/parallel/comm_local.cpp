// In-process communicator (see comm_local.h).
#include "parallel/comm_local.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/check.h"

namespace tessera::parallel {

namespace {
// A barrier that can be broken: when a rank fails, run_local breaks every barrier of its ranks' communicators, and a
// rank waiting at one (or arriving later) throws instead of waiting for a member that will never come.
class Barrier {
  public:
    explicit Barrier(int n) : n_(n) {}
    void arrive_and_wait() {
        std::unique_lock lock(mu_);
        const uint64_t generation = generation_;
        if (!broken_ && ++waiting_ == n_) {
            waiting_ = 0;
            ++generation_;
            cv_.notify_all();
            return;
        }
        cv_.wait(lock, [&] { return broken_ || generation_ != generation; });
        TESSERA_CHECK(generation_ != generation, "in-process ranks: another rank failed");
    }
    void break_all() {
        std::lock_guard lock(mu_);
        broken_ = true;
        cv_.notify_all();
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    const int n_;
    int waiting_ = 0;
    uint64_t generation_ = 0;
    bool broken_ = false;
};

// Every barrier of one run_local's communicators (the world and its splits), to break them all when a rank fails.
struct Barriers {
    std::mutex mu;
    std::vector<std::weak_ptr<Barrier>> all;
    std::shared_ptr<Barrier> make(int n) {
        auto b = std::make_shared<Barrier>(n);
        std::lock_guard lock(mu);
        all.push_back(b);
        return b;
    }
    void break_all() {
        std::lock_guard lock(mu);
        for (const std::weak_ptr<Barrier>& w : all)
            if (const std::shared_ptr<Barrier> b = w.lock()) b->break_all();
    }
};

// What the members of one communicator share: a barrier and one slot per member for a collective's
// arguments (posted, read by the others between two barriers).
struct Group {
    Group(int n, std::shared_ptr<Barriers> registry)
        : size(n), barriers(std::move(registry)), sync(barriers->make(n)), slots(size_t(n)) {}
    struct Slot {
        const std::byte* send = nullptr;
        const int64_t* send_bytes = nullptr;
        std::byte* recv = nullptr;
        int color = 0, key = 0;
    };
    int size;
    std::shared_ptr<Barriers> barriers;
    std::shared_ptr<Barrier> sync;
    std::vector<Slot> slots;
    std::mutex mu;                                  // guards splits
    std::map<int, std::shared_ptr<Group>> splits;   // color -> the new group, during a split
    std::map<int, std::vector<int>> split_members;  // color -> members (ranks here) in new-rank order
};

class LocalComm final : public Comm {
  public:
    LocalComm(std::shared_ptr<Group> g, int rank, std::shared_ptr<ProgressThread> thread)
        : g_(std::move(g)), rank_(rank), thread_(std::move(thread)) {}
    int rank() const override { return rank_; }
    int size() const override { return g_->size; }
    std::string backend() const override { return "local"; }

    std::unique_ptr<Comm> do_split(int color, int key) override {
        std::unique_ptr<Comm> out;
        submit([&] {
            Group::Slot& me = g_->slots[size_t(rank_)];
            me.color = color;
            me.key = key;
            g_->sync->arrive_and_wait();
            if (rank_ == 0) {                                              // one member forms every new group
                std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
                for (int r = 0; r < g_->size; ++r)
                    by_color[g_->slots[size_t(r)].color].push_back({g_->slots[size_t(r)].key, r});
                for (auto& [c, members] : by_color) {
                    std::sort(members.begin(), members.end());
                    g_->splits[c] = std::make_shared<Group>(int(members.size()), g_->barriers);
                    for (auto& m : members) g_->split_members[c].push_back(m.second);
                }
            }
            g_->sync->arrive_and_wait();
            const std::vector<int>& members = g_->split_members.at(color);
            const int new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
            out = std::make_unique<LocalComm>(g_->splits.at(color), new_rank, thread_);
            g_->sync->arrive_and_wait();
            if (rank_ == 0) {
                g_->splits.clear();
                g_->split_members.clear();
            }
        }).wait();
        return out;
    }

  protected:
    Handle submit(std::function<void()> job) override { return thread_->submit(std::move(job)); }

    void do_all_gather_v(std::span<const std::byte> send,
                         std::span<std::byte> recv,
                         std::span<const int64_t> recv_bytes) override {
        g_->slots[size_t(rank_)].send = send.data();
        g_->sync->arrive_and_wait();
        size_t at = 0;
        for (int r = 0; r < g_->size; ++r) {
            const size_t n = size_t(recv_bytes[size_t(r)]);
            if (n) std::memcpy(recv.data() + at, g_->slots[size_t(r)].send, n);
            at += n;
        }
        g_->sync->arrive_and_wait();  // nobody reuses a send buffer before every member read it
    }

    void do_all_to_all_v(std::span<const std::byte> send,
                         std::span<const int64_t> send_bytes,
                         std::span<std::byte> recv,
                         std::span<const int64_t> recv_bytes) override {
        g_->slots[size_t(rank_)].send = send.data();
        g_->slots[size_t(rank_)].send_bytes = send_bytes.data();
        g_->sync->arrive_and_wait();
        std::string error;
        int64_t at = 0;
        for (int r = 0; r < g_->size; ++r) {
            const Group::Slot& from = g_->slots[size_t(r)];
            int64_t offset = 0;
            for (int q = 0; q < rank_; ++q) offset += from.send_bytes[q];
            const int64_t n = from.send_bytes[rank_];
            if (n != recv_bytes[size_t(r)]) {
                error = fmt::format("all_to_all_v: rank {} sends {} bytes to rank {}, which expects {}", r, n, rank_,
                                    recv_bytes[size_t(r)]);
            } else {
                std::memcpy(recv.data() + at, from.send + offset, size_t(n));
            }
            at += recv_bytes[size_t(r)];
        }
        g_->sync->arrive_and_wait();
        TESSERA_CHECK(error.empty(), "{}", error);
    }

    void do_broadcast(std::span<std::byte> buf, int root) override {
        if (rank_ == root) g_->slots[size_t(rank_)].send = buf.data();
        g_->sync->arrive_and_wait();
        if (rank_ != root) std::memcpy(buf.data(), g_->slots[size_t(root)].send, buf.size());
        g_->sync->arrive_and_wait();
    }

    void do_barrier() override { g_->sync->arrive_and_wait(); }

  private:
    std::shared_ptr<Group> g_;
    int rank_;
    std::shared_ptr<ProgressThread> thread_;
};
}  // namespace

void run_local(int ranks, const std::function<void(Comm&)>& fn) {
    TESSERA_CHECK(ranks >= 1, "run_local: {} ranks", ranks);
    auto barriers = std::make_shared<Barriers>();
    auto world = std::make_shared<Group>(ranks, barriers);
    std::mutex mu;
    std::exception_ptr first;  // the first rank's error to arrive: the cause, not a peer's "another rank failed"
    {
        std::vector<std::jthread> threads;
        for (int r = 0; r < ranks; ++r) {
            threads.emplace_back([&, r] {
                try {
                    LocalComm comm(world, r, std::make_shared<ProgressThread>());
                    fn(comm);
                } catch (...) {
                    {
                        std::lock_guard lock(mu);
                        if (!first) first = std::current_exception();
                    }
                    barriers->break_all();
                }
            });
        }
    }
    if (first) std::rethrow_exception(first);
}

}  // namespace tessera::parallel
