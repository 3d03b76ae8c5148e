// The communication API's shared parts (see comm.h): handles, the communication thread, and the
// fixed-order reductions built on the byte-moving primitives.
#include "parallel/comm.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "core/device.h"
#include "core/trace.h"
#if TESSERA_WITH_CUDA
#include "ops/cuda/cuda_ops.h"
#endif

namespace tessera::parallel {

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Handle::State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
};

Handle& Handle::operator=(Handle&& o) noexcept {
    if (this != &o) {
        try {
            if (s_) wait();
        } catch (...) {
        }
        s_ = std::move(o.s_);
    }
    return *this;
}

Handle::~Handle() {
    try {
        if (s_) wait();
    } catch (...) {
    }
}

void Handle::wait() {
    if (!s_) return;
    std::shared_ptr<State> s = std::move(s_);
    std::unique_lock lock(s->mu);
    s->cv.wait(lock, [&] { return s->done; });
    if (s->error) std::rethrow_exception(s->error);
}

bool Handle::done() const {
    if (!s_) return true;
    std::lock_guard lock(s_->mu);
    return s_->done;
}

struct ProgressThread::Impl {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<std::function<void()>, std::shared_ptr<Handle::State>>> queue;
    bool stop = false;
    std::thread worker;

    void run() {
        trace::name_thread("communication");
        for (;;) {
            std::pair<std::function<void()>, std::shared_ptr<Handle::State>> item;
            {
                std::unique_lock lock(mu);
                cv.wait(lock, [&] { return stop || !queue.empty(); });
                if (queue.empty()) return;  // stop requested and nothing left
                item = std::move(queue.front());
                queue.pop_front();
            }
            std::exception_ptr error;
            try {
                item.first();
            } catch (...) {
                error = std::current_exception();
            }
            std::lock_guard lock(item.second->mu);
            item.second->error = error;
            item.second->done = true;
            item.second->cv.notify_all();
        }
    }
};

ProgressThread::ProgressThread() : impl_(std::make_unique<Impl>()) {
    impl_->worker = std::thread([this] { impl_->run(); });
}

ProgressThread::~ProgressThread() {
    {
        std::lock_guard lock(impl_->mu);
        impl_->stop = true;
    }
    impl_->cv.notify_all();
    impl_->worker.join();
}

Handle ProgressThread::submit(std::function<void()> job) {
    auto state = std::make_shared<Handle::State>();
    {
        std::lock_guard lock(impl_->mu);
        TESSERA_CHECK(!impl_->stop, "communication thread: submit after shutdown");
        impl_->queue.emplace_back(std::move(job), state);
    }
    impl_->cv.notify_one();
    return Handle(state);
}

namespace {
// out[i] = Σ_r parts[r·count + i], r = 0, 1, ... in order (accumulate: out[i] + parts[i] + ...)
template <class T>
void sum_in_rank_order(const std::byte* parts, int ranks, int64_t count, void* out, bool accumulate) {
    const T* p = reinterpret_cast<const T*>(parts);
    T* o = static_cast<T*>(out);
    if (accumulate) {
        for (int64_t i = 0; i < count; ++i) o[i] += p[i];
    } else {
        std::memcpy(o, p, size_t(count) * sizeof(T));
    }
    for (int r = 1; r < ranks; ++r) {
        const T* q = p + int64_t(r) * count;
        for (int64_t i = 0; i < count; ++i) o[i] += q[i];
    }
}

void sum_parts(
    Device side, DType dtype, const std::byte* parts, int ranks, int64_t count, void* out, bool accumulate = false) {
    if (side == Device::cuda) {
#if TESSERA_WITH_CUDA
        return ops::cuda::sum_blocks(dtype, parts, ranks, count, out, accumulate);
#else
        TESSERA_FAIL("reduction: GPU buffers in a build without the CUDA backend");
#endif
    }
    switch (dtype) {
        case DType::f32:
            return sum_in_rank_order<float>(parts, ranks, count, out, accumulate);
        case DType::f64:
            return sum_in_rank_order<double>(parts, ranks, count, out, accumulate);
        case DType::i32:
            return sum_in_rank_order<int32_t>(parts, ranks, count, out, accumulate);
        case DType::i64:
            return sum_in_rank_order<int64_t>(parts, ranks, count, out, accumulate);
        default:
            TESSERA_FAIL("reduction: dtype {} is not summed (f32, f64, i32, i64)", dtype_name(dtype));
    }
}
}  // namespace

Comm::~Comm() = default;

void Comm::use_device_link(std::unique_ptr<DeviceLink> link) { link_ = std::move(link); }

std::unique_ptr<Comm> Comm::split(int color, int key) {
    std::unique_ptr<Comm> child = do_split(color, key);
    if (link_) child->use_device_link(link_->split(*child));
    return child;
}

Device Comm::side_of(const char* what, std::initializer_list<const void*> buffers) const {
    bool host = false, gpu = false;
    for (const void* p : buffers) {
        if (!p) continue;
        (device_of_pointer(p) == Device::cuda ? gpu : host) = true;
    }
    TESSERA_CHECK(!(host && gpu), "{}: some buffers are in host memory and some in GPU memory", what);
    TESSERA_CHECK(!gpu || link_, "{}: the buffers are in GPU memory and this {} communicator has no device link (NCCL)",
                  what, backend());
    return gpu ? Device::cuda : Device::cpu;
}

Handle Comm::submit_on(Device side, std::function<void()> job) {
    if (side == Device::cpu) return submit(std::move(job));
    return submit([this, issued = link_->issue_point(), job = std::move(job)] {
        void* stream = link_->begin(issued);
        try {
            StreamGuard on(Stream{stream});
            job();
        } catch (...) {
            try {
                link_->end();
            } catch (...) {  // (the job's error is the one to report)
            }
            throw;
        }
        link_->end();  // the link's work is done before the handle is
    });
}

void Comm::account(int64_t bytes, double t0) {
    if (link_delay_ > 0 && bytes > 0)
        std::this_thread::sleep_for(std::chrono::duration<double>(link_delay_ * double(bytes)));
    std::lock_guard lock(stats_mu_);
    stats_.calls += 1;
    stats_.bytes_sent += bytes;
    stats_.seconds += now_seconds() - t0;
}

void Comm::all_gather_now(Device side,
                          std::span<const std::byte> send,
                          std::span<std::byte> recv,
                          std::span<const int64_t> recv_bytes) {
    TESSERA_CHECK(int(recv_bytes.size()) == size(), "all_gather: {} counts for {} ranks", recv_bytes.size(), size());
    int64_t total = 0;
    for (int64_t b : recv_bytes) {
        TESSERA_CHECK(b >= 0, "all_gather: negative count");
        total += b;
    }
    TESSERA_CHECK(int64_t(send.size()) == recv_bytes[size_t(rank())] && total <= int64_t(recv.size()),
                  "all_gather: sends {} bytes and receives {} into {}, the counts say {} and {}", send.size(), total,
                  recv.size(), recv_bytes[size_t(rank())], total);
    const double t0 = now_seconds();
    if (side == Device::cuda) {
        link_->all_gather_v(send, recv, recv_bytes);
    } else {
        do_all_gather_v(send, recv, recv_bytes);
    }
    account(int64_t(send.size()) * (size() - 1), t0);
}

void Comm::all_to_all_v_now(Device side,
                            std::span<const std::byte> send,
                            std::span<const int64_t> send_bytes,
                            std::span<std::byte> recv,
                            std::span<const int64_t> recv_bytes) {
    TESSERA_CHECK(int(send_bytes.size()) == size() && int(recv_bytes.size()) == size(),
                  "all_to_all_v: {} send and {} receive counts for {} ranks", send_bytes.size(), recv_bytes.size(),
                  size());
    int64_t total_send = 0, total_recv = 0;
    for (int r = 0; r < size(); ++r) {
        TESSERA_CHECK(send_bytes[size_t(r)] >= 0 && recv_bytes[size_t(r)] >= 0, "all_to_all_v: negative count");
        total_send += send_bytes[size_t(r)];
        total_recv += recv_bytes[size_t(r)];
    }
    TESSERA_CHECK(total_send <= int64_t(send.size()) && total_recv <= int64_t(recv.size()),
                  "all_to_all_v: counts need {} / {} bytes, the buffers hold {} / {}", total_send, total_recv,
                  send.size(), recv.size());
    const double t0 = now_seconds();
    if (side == Device::cuda) {
        link_->all_to_all_v(send, send_bytes, recv, recv_bytes);
    } else {
        do_all_to_all_v(send, send_bytes, recv, recv_bytes);
    }
    account(total_send - send_bytes[size_t(rank())], t0);
}

Handle Comm::all_gather_async(std::span<const std::byte> send, std::span<std::byte> recv) {
    TESSERA_CHECK(recv.size() == send.size() * size_t(size()), "all_gather: receive buffer of {} bytes, needs {} × {}",
                  recv.size(), size(), send.size());
    return all_gather_v_async(send, recv, std::vector<int64_t>(size_t(size()), int64_t(send.size())));
}

Handle Comm::all_gather_v_async(std::span<const std::byte> send,
                                std::span<std::byte> recv,
                                std::span<const int64_t> recv_bytes) {
    std::vector<int64_t> rb(recv_bytes.begin(), recv_bytes.end());
    const Device side = side_of("all_gather", {send.data(), recv.data()});
    return submit_on(side, [=, this, rb = std::move(rb)] {
        trace::Span span("all_gather", "comm", int64_t(recv.size()), "bytes");
        all_gather_now(side, send, recv, rb);
    });
}

Handle Comm::all_to_all_v_async(std::span<const std::byte> send,
                                std::span<const int64_t> send_bytes,
                                std::span<std::byte> recv,
                                std::span<const int64_t> recv_bytes) {
    // the counts are copied: callers often pass temporaries
    std::vector<int64_t> sb(send_bytes.begin(), send_bytes.end()), rb(recv_bytes.begin(), recv_bytes.end());
    const Device side = side_of("all_to_all_v", {send.data(), recv.data()});
    return submit_on(side, [=, this, sb = std::move(sb), rb = std::move(rb)] {
        trace::Span span("all_to_all", "comm", int64_t(send.size()), "bytes");
        all_to_all_v_now(side, send, sb, recv, rb);
    });
}

Handle Comm::broadcast_async(std::span<std::byte> buf, int root) {
    TESSERA_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank of {}", root, size());
    const Device side = side_of("broadcast", {buf.data()});
    return submit_on(side, [=, this] {
        trace::Span span("broadcast", "comm", int64_t(buf.size()), "bytes");
        const double t0 = now_seconds();
        if (side == Device::cuda) {
            link_->broadcast(buf, root);
        } else {
            do_broadcast(buf, root);
        }
        account(rank() == root ? int64_t(buf.size()) * (size() - 1) : 0, t0);
    });
}

Handle Comm::reduce_scatter_v_async(DType dtype,
                                    const void* send,
                                    std::span<const int64_t> send_counts,
                                    void* recv,
                                    int64_t recv_count,
                                    bool accumulate,
                                    std::span<std::byte> scratch,
                                    std::span<const int64_t> send_offsets) {
    const int W = size();
    TESSERA_CHECK(int(send_counts.size()) == W && recv_count >= 0 && send_counts[size_t(rank())] == recv_count,
                  "reduce_scatter: {} counts for {} ranks, {} elements kept here and {} received", send_counts.size(),
                  W, send_counts.size() == size_t(W) ? send_counts[size_t(rank())] : -1, recv_count);
    const int64_t es = int64_t(dtype_size(dtype));
    TESSERA_CHECK(send_offsets.empty() || int(send_offsets.size()) == W,
                  "reduce_scatter: {} block offsets for {} ranks", send_offsets.size(), W);
    std::vector<int64_t> send_bytes(static_cast<size_t>(W)), recv_bytes(static_cast<size_t>(W), recv_count * es),
        at(send_offsets.begin(), send_offsets.end());
    int64_t total = 0;
    for (int r = 0; r < W; ++r) {
        TESSERA_CHECK(at.empty() || at[size_t(r)] >= 0, "reduce_scatter: block offset {}",
                      at.empty() ? 0 : at[size_t(r)]);
        send_bytes[size_t(r)] = send_counts[size_t(r)] * es;
        total += send_bytes[size_t(r)];
    }
    const int64_t received = recv_count * es * W, need = received + (at.empty() ? 0 : total);
    TESSERA_CHECK(scratch.empty() || int64_t(scratch.size()) >= need, "reduce_scatter: scratch of {} bytes, needs {}",
                  scratch.size(), need);
    const Device side = side_of("reduce_scatter", {send, recv, scratch.data()});
    return submit_on(
        side, [=, this, send_bytes = std::move(send_bytes), recv_bytes = std::move(recv_bytes), at = std::move(at)] {
            trace::Span span("reduce_scatter", "comm", total, "bytes");
            std::vector<std::byte> own;
            std::span<std::byte> buffer = scratch;
            if (buffer.empty() && side == Device::cuda) {
                buffer = link_->scratch(size_t(need));
            } else if (buffer.empty()) {
                own.resize(size_t(need));
                buffer = own;
            }
            const std::byte* packed = static_cast<const std::byte*>(send);
            if (!at.empty()) {  // the blocks one after another, behind the received parts
                std::byte* to = buffer.data() + received;
                for (int r = 0; r < W; ++r) {
                    copy_bytes(to, side, packed + at[size_t(r)] * es, side, size_t(send_bytes[size_t(r)]));
                    to += send_bytes[size_t(r)];
                }
                packed = buffer.data() + received;
            }
            // nothing received: no receive buffer, as MPI would read a send buffer at the receive buffer's address as
            // an in-place exchange
            const std::span<std::byte> parts = received > 0 ? buffer.first(size_t(received)) : std::span<std::byte>();
            all_to_all_v_now(side, {packed, size_t(total)}, send_bytes, parts, recv_bytes);
            sum_parts(side, dtype, parts.data(), W, recv_count, recv, accumulate);
        });
}

Handle Comm::reduce_scatter_async(
    DType dtype, const void* send, void* recv, int64_t count, std::span<std::byte> scratch, int64_t send_count) {
    const int W = size();
    if (send_count < 0) send_count = count * W;
    TESSERA_CHECK(count >= 0 && send_count <= count * W, "reduce_scatter: {} elements sent for {} chunks of {}",
                  send_count, W, count);
    const int64_t es = int64_t(dtype_size(dtype));
    TESSERA_CHECK(scratch.empty() || int64_t(scratch.size()) >= count * es * W,
                  "reduce_scatter: scratch of {} bytes, needs {}", scratch.size(), count * es * W);
    // chunk r holds the elements [r·count, (r+1)·count) that exist; the missing tail of this rank's is zeros
    // (the reduction never touches recv's tail, so it is cleared here)
    std::vector<int64_t> present(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) present[size_t(r)] = std::clamp<int64_t>(send_count - int64_t(r) * count, 0, count);
    const int64_t have = present[size_t(rank())];
    device_zero(side_of("reduce_scatter", {send, recv, scratch.data()}), static_cast<std::byte*>(recv) + have * es,
                size_t((count - have) * es));
    return reduce_scatter_v_async(dtype, send, present, recv, have, false, scratch);
}

Handle Comm::all_reduce_async(DType dtype, void* buf, int64_t count) {
    TESSERA_CHECK(count >= 0, "all_reduce: negative count {}", count);
    const Device side = side_of("all_reduce", {buf});
    return submit_on(side, [=, this] {
        trace::Span span("all_reduce", "comm", count * int64_t(dtype_size(dtype)), "bytes");
        const int W = size();
        const size_t es = dtype_size(dtype), chunk = size_t((count + W - 1) / W) * es, n = size_t(count) * es;
        // padded copy [W · chunk] (the padding zeros), the parts received, my reduced chunk; then every chunk gathered
        // back into the padded copy
        std::vector<std::byte> own;
        std::span<std::byte> all;
        if (side == Device::cuda) {
            all = link_->scratch(chunk * size_t(2 * W + 1));
        } else {
            own.resize(chunk * size_t(2 * W + 1));
            all = own;
        }
        const std::span<std::byte> padded = all.first(chunk * size_t(W)),
                                   parts = all.subspan(chunk * size_t(W), chunk * size_t(W)),
                                   mine = all.subspan(chunk * size_t(2 * W), chunk);
        copy_bytes(padded.data(), side, buf, side, n);
        device_zero(side, padded.data() + n, padded.size() - n);
        const std::vector<int64_t> counts(static_cast<size_t>(W), static_cast<int64_t>(chunk));
        all_to_all_v_now(side, padded, counts, parts, counts);
        sum_parts(side, dtype, parts.data(), W, int64_t(chunk / es), mine.data());
        all_gather_now(side, mine, padded, counts);
        copy_bytes(buf, side, padded.data(), side, n);
    });
}

std::string Comm::broadcast_text(const std::string& text, int root) {
    int64_t n = int64_t(text.size());
    broadcast(std::as_writable_bytes(std::span(&n, 1)), root);
    std::string out = rank() == root ? text : std::string(size_t(n), '\0');
    broadcast(std::as_writable_bytes(std::span(out.data(), out.size())), root);
    return out;
}

void Comm::barrier() {
    submit([this] { do_barrier(); }).wait();
}

}  // namespace tessera::parallel
