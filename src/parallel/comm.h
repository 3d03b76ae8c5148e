// One communication API for every backend (DESIGN.md principle 4): all-gather, all-to-all-v,
// broadcast and barrier move bytes; reduce-scatter and all-reduce sum in a fixed order on top of
// them. Implementations: MPI (real processes, parallel/comm_mpi.h) and an in-process one (ranks as
// threads of one process, parallel/comm_local.h) for fast unit tests. parallel/ knows buffers, groups
// and token layouts, never the model.
//
// Buffers may be host or GPU memory (core/device.h: device_of_pointer); one collective's are all on one
// side. Host memory travels over the communicator itself; GPU memory over its device link (NCCL:
// parallel/nccl_link.h), which a communicator gets from use_device_link and passes on to its splits. The
// reductions' sums then run on the GPU too, in the same rank order, so they give the CPU's bits.
//
// Every collective has a non-blocking form that returns a Handle at once and runs on the process's
// communication thread, so it really progresses while the calling threads compute (MPI's own
// non-blocking collectives progress only inside MPI calls). Collectives of all communicators of a
// process run in the order they were issued; every rank of a group must issue the group's
// collectives in the same order (as MPI requires). Buffers passed to a collective must stay alive
// and untouched until its handle completes.
//
// NOTES: reductions are always deterministic: reduce-scatter is an all-to-all of the chunks followed
// by a sum over the ranks' contributions in rank order, and all-reduce is reduce-scatter then
// all-gather. That moves the same bytes as a ring ((W−1)/W of the buffer per rank each way), and the
// result never depends on timing or on MPI's implementation-defined reduction order, so a run is
// bitwise repeatable and W ranks can equal 1 rank that accumulates W micro-batches in rank order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace tessera::parallel {

// A pending collective. wait() blocks until it completed and rethrows its error; the destructor waits
// too (an abandoned collective would leave the group out of step), swallowing errors.
class Handle {
  public:
    struct State;
    Handle() = default;
    explicit Handle(std::shared_ptr<State> s) : s_(std::move(s)) {}
    Handle(Handle&&) noexcept = default;
    Handle& operator=(Handle&& o) noexcept;
    ~Handle();
    void wait();
    bool done() const;  // completed (successfully or not), without blocking

  private:
    std::shared_ptr<State> s_;
};

class Comm;

// The part of a communicator that carries GPU memory (parallel/nccl_link.h). The communicator calls it on its
// communication thread, inside begin/end, except issue_point (on the thread that issues a collective).
class DeviceLink {
  public:
    virtual ~DeviceLink() = default;
    // The point of the issuing thread's stream a collective's buffers are ready at (an event recorded on it).
    virtual std::shared_ptr<void> issue_point() = 0;
    // Around one collective's device work: begin makes the link's stream wait for the issue point and returns it
    // (the communication thread's current stream until end); end waits until the stream's work is done.
    virtual void* begin(const std::shared_ptr<void>& issued) = 0;
    virtual void end() = 0;
    virtual void all_gather_v(std::span<const std::byte> send,
                              std::span<std::byte> recv,
                              std::span<const int64_t> recv_bytes) = 0;
    virtual void all_to_all_v(std::span<const std::byte> send,
                              std::span<const int64_t> send_bytes,
                              std::span<std::byte> recv,
                              std::span<const int64_t> recv_bytes) = 0;
    virtual void broadcast(std::span<std::byte> buf, int root) = 0;
    // GPU memory of at least `bytes` for a reduction's parts, the link's own (reused by the next collective).
    virtual std::span<std::byte> scratch(size_t bytes) = 0;
    // The link of a communicator split from this one's (collective over `child`'s ranks).
    virtual std::unique_ptr<DeviceLink> split(Comm& child) = 0;
};

// Per communicator, what its collectives moved: bytes this rank sent to other ranks, and the time
// the communication thread spent in them.
struct CommStats {
    int64_t calls = 0;
    int64_t bytes_sent = 0;
    double seconds = 0.0;
};

class Comm {
  public:
    virtual ~Comm();
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string backend() const = 0;  // "mpi", "local"

    // GPU buffers travel over `link` from now on, and over its splits on this communicator's splits.
    void use_device_link(std::unique_ptr<DeviceLink> link);
    bool has_device_link() const { return link_ != nullptr; }

    // recv holds size() blocks of send.size() bytes, rank order.
    Handle all_gather_async(std::span<const std::byte> send, std::span<std::byte> recv);
    // recv holds size() consecutive blocks, recv_bytes[r] from rank r (the same counts on every rank; send holds
    // recv_bytes[rank()] bytes). FSDP gathers a block's parameters from the ranks' uneven pieces this way.
    Handle all_gather_v_async(std::span<const std::byte> send,
                              std::span<std::byte> recv,
                              std::span<const int64_t> recv_bytes);
    // send: blocks of send_bytes[r] bytes for rank r, consecutive; recv: blocks of recv_bytes[r] from rank r.
    // The counts must agree pairwise (send_bytes[r] on rank q = recv_bytes[q] on rank r); exchange them
    // first with all_gather or an all-to-all of fixed-size counts.
    Handle all_to_all_v_async(std::span<const std::byte> send,
                              std::span<const int64_t> send_bytes,
                              std::span<std::byte> recv,
                              std::span<const int64_t> recv_bytes);
    Handle broadcast_async(std::span<std::byte> buf, int root);
    // send holds size() chunks of `count` elements; recv = Σ_r chunk[rank()] of rank r, summed in rank
    // order (f32, f64, i32, i64). scratch: size()·count elements of the dtype, or empty to allocate.
    // send_count: the elements send really holds when fewer (≥ 0; the missing tail counts as zeros, so a
    // buffer need not be padded to size()·count); −1 = size()·count.
    Handle reduce_scatter_async(DType dtype,
                                const void* send,
                                void* recv,
                                int64_t count,
                                std::span<std::byte> scratch = {},
                                int64_t send_count = -1);
    // The uneven form: send holds size() consecutive blocks, send_counts[r] elements for rank r (so rank r's
    // block must have rank r's recv_count elements); recv (recv_count elements) = Σ_r rank r's block for this
    // rank, in rank order. accumulate: the blocks are added to recv's values in rank order (recv + b_0 + b_1
    // + ...) instead of replacing them, so summing micro-batch after micro-batch this way gives the bits of one
    // rank adding every micro-batch in turn. send_offsets (one per rank): rank r's block starts at element
    // send_offsets[r] of send instead (the communication thread packs the blocks). scratch: recv_count·size()
    // elements, and Σ send_counts more with offsets, or empty to allocate.
    Handle reduce_scatter_v_async(DType dtype,
                                  const void* send,
                                  std::span<const int64_t> send_counts,
                                  void* recv,
                                  int64_t recv_count,
                                  bool accumulate,
                                  std::span<std::byte> scratch = {},
                                  std::span<const int64_t> send_offsets = {});
    // In place, summed in rank order. count need not divide by size() (the last chunk is padded).
    Handle all_reduce_async(DType dtype, void* buf, int64_t count);
    void barrier();

    // blocking forms
    void all_gather(std::span<const std::byte> send, std::span<std::byte> recv) { all_gather_async(send, recv).wait(); }
    void all_gather_v(std::span<const std::byte> send, std::span<std::byte> recv, std::span<const int64_t> recv_bytes) {
        all_gather_v_async(send, recv, recv_bytes).wait();
    }
    void all_to_all_v(std::span<const std::byte> send,
                      std::span<const int64_t> send_bytes,
                      std::span<std::byte> recv,
                      std::span<const int64_t> recv_bytes) {
        all_to_all_v_async(send, send_bytes, recv, recv_bytes).wait();
    }
    void broadcast(std::span<std::byte> buf, int root) { broadcast_async(buf, root).wait(); }
    void reduce_scatter(DType dtype, const void* send, void* recv, int64_t count, int64_t send_count = -1) {
        reduce_scatter_async(dtype, send, recv, count, {}, send_count).wait();
    }
    void all_reduce(DType dtype, void* buf, int64_t count) { all_reduce_async(dtype, buf, count).wait(); }
    template <class T>
    void all_reduce(std::span<T> v) {
        all_reduce(dtype_of<T>(), v.data(), int64_t(v.size()));
    }
    template <class T>
    T all_reduce_sum(T v) {
        all_reduce(std::span<T>(&v, 1));
        return v;
    }

    // Root's text on every rank (its length first, then its bytes). Collective.
    std::string broadcast_text(const std::string& text, int root);

    // The ranks with the same color form a new communicator, ordered by key (then by rank here), with a device link
    // when this one has one. Collective over this communicator.
    std::unique_ptr<Comm> split(int color, int key);

    // Test and bench option: after every transfer, the communication thread also waits
    // bytes × seconds_per_byte, as a slower link would (0 = off).
    void set_link_delay(double seconds_per_byte) { link_delay_ = seconds_per_byte; }
    CommStats stats() const {
        std::lock_guard lock(stats_mu_);
        return stats_;
    }

  protected:
    // The byte-moving primitives, run on the communication thread (blocking there).
    // recv: recv_bytes[r] bytes from rank r, consecutive
    virtual void do_all_gather_v(std::span<const std::byte> send,
                                 std::span<std::byte> recv,
                                 std::span<const int64_t> recv_bytes) = 0;
    virtual void do_all_to_all_v(std::span<const std::byte> send,
                                 std::span<const int64_t> send_bytes,
                                 std::span<std::byte> recv,
                                 std::span<const int64_t> recv_bytes) = 0;
    virtual void do_broadcast(std::span<std::byte> buf, int root) = 0;
    virtual void do_barrier() = 0;
    // Queues a job on this rank's communication thread.
    virtual Handle submit(std::function<void()> job) = 0;
    virtual std::unique_ptr<Comm> do_split(int color, int key) = 0;

    // bookkeeping for a transfer that sent `bytes` to other ranks and started at `t0`
    void account(int64_t bytes, double t0);

  private:
    // The side of a collective's buffers (null ones aside): one-line error for a mix, or GPU memory without a link.
    Device side_of(const char* what, std::initializer_list<const void*> buffers) const;
    // Queues a job for buffers on `side`: on the GPU, inside the link's begin and end.
    Handle submit_on(Device side, std::function<void()> job);
    void all_to_all_v_now(Device side,
                          std::span<const std::byte> send,
                          std::span<const int64_t> send_bytes,
                          std::span<std::byte> recv,
                          std::span<const int64_t> recv_bytes);
    void all_gather_now(Device side,
                        std::span<const std::byte> send,
                        std::span<std::byte> recv,
                        std::span<const int64_t> recv_bytes);
    std::unique_ptr<DeviceLink> link_;
    double link_delay_ = 0.0;
    mutable std::mutex stats_mu_;  // written on the communication thread, read by callers
    CommStats stats_;
};

// Runs jobs in order on one thread; each job's handle completes when it has run.
class ProgressThread {
  public:
    ProgressThread();
    ~ProgressThread();
    ProgressThread(const ProgressThread&) = delete;
    ProgressThread& operator=(const ProgressThread&) = delete;
    Handle submit(std::function<void()> job);

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// Seconds since an arbitrary fixed point (steady clock).
double now_seconds();

}  // namespace tessera::parallel
