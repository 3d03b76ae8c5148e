// Communicator checks (see comm_checks.h). Payloads are labelled with the sending rank and position,
// so a block delivered to the wrong place or rank shows.
#include "parallel/comm_checks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <thread>

#include "core/check.h"
#include "core/device.h"
#include "parallel/mesh.h"

namespace tessera::test {

using parallel::Comm;

namespace {
template <class T>
std::span<const std::byte> bytes(const std::vector<T>& v) {
    return std::as_bytes(std::span<const T>(v));
}
template <class T>
std::span<std::byte> bytes(std::vector<T>& v) {
    return std::as_writable_bytes(std::span<T>(v));
}
int32_t label(int rank, int64_t i) { return int32_t(rank * 100000 + i); }

// A collective's buffer in host or GPU memory: host values in, the collective's pointer, host values back.
template <class T>
class Buf {
  public:
    Buf(std::vector<T> values, Device side) : host_(std::move(values)), side_(side) {
        if (side_ == Device::cpu) return;
        device_ = static_cast<T*>(device_alloc(side_, host_.size() * sizeof(T)));
        copy_bytes(device_, side_, host_.data(), Device::cpu, host_.size() * sizeof(T));
    }
    ~Buf() { device_free(side_, device_); }
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    T* data() { return side_ == Device::cpu ? host_.data() : device_; }
    std::span<std::byte> bytes() { return std::as_writable_bytes(std::span<T>(data(), host_.size())); }
    std::span<const std::byte> cbytes() { return std::as_bytes(std::span<T>(data(), host_.size())); }
    const std::vector<T>& host() {  // the values now (after the collective's handle completed)
        if (side_ != Device::cpu) copy_bytes(host_.data(), Device::cpu, device_, side_, host_.size() * sizeof(T));
        return host_;
    }

  private:
    std::vector<T> host_;
    Device side_;
    T* device_ = nullptr;
};
}  // namespace

void check_all_gather(Comm& c, Device side) {
    const int W = c.size(), me = c.rank();
    std::vector<int32_t> values(7);
    for (int64_t i = 0; i < 7; ++i) values[size_t(i)] = label(me, i);
    Buf<int32_t> send(values, side), out(std::vector<int32_t>(static_cast<size_t>(7 * W), -1), side);
    c.all_gather(send.cbytes(), out.bytes());
    const std::vector<int32_t>& recv = out.host();
    for (int r = 0; r < W; ++r)
        for (int64_t i = 0; i < 7; ++i) ASSERT_EQ(recv[size_t(r * 7 + i)], label(r, i)) << "from rank " << r;
}

void check_all_gather_uneven(Comm& c, Device side) {
    const int W = c.size(), me = c.rank();
    auto n = [](int r) -> int64_t { return (r * 3 + 1) % 4; };  // rank 2 of 4 sends nothing
    std::vector<int64_t> rb(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) rb[size_t(r)] = n(r) * 4;
    std::vector<int32_t> send(static_cast<size_t>(n(me)));
    for (int64_t i = 0; i < n(me); ++i) send[size_t(i)] = label(me, i);
    Buf<int32_t> in(send, side),
        out(std::vector<int32_t>(size_t(std::accumulate(rb.begin(), rb.end(), int64_t(0)) / 4), -1), side);
    c.all_gather_v(in.cbytes(), out.bytes(), rb);
    const std::vector<int32_t>& recv = out.host();
    size_t at = 0;
    for (int r = 0; r < W; ++r)
        for (int64_t i = 0; i < n(r); ++i) ASSERT_EQ(recv[at++], label(r, i)) << "from rank " << r;
}

void check_all_to_all_v_uneven(Comm& c, Device side) {
    const int W = c.size(), me = c.rank();
    // rank r sends (r + 2q) % 5 elements to rank q (some pairs send nothing); a second round sends
    // everything to rank 0 (all-to-one)
    for (int round = 0; round < 2; ++round) {
        auto n = [&](int r, int q) -> int64_t { return round == 0 ? (r + 2 * q) % 5 : (q == 0 ? 3 + r : 0); };
        std::vector<int64_t> sb(static_cast<size_t>(W)), rb(static_cast<size_t>(W));
        std::vector<int32_t> send;
        for (int q = 0; q < W; ++q) {
            sb[size_t(q)] = n(me, q) * 4;
            rb[size_t(q)] = n(q, me) * 4;
            for (int64_t i = 0; i < n(me, q); ++i) send.push_back(label(me, q * 1000 + i));
        }
        Buf<int32_t> in(send, side),
            out(std::vector<int32_t>(size_t(std::accumulate(rb.begin(), rb.end(), int64_t(0)) / 4), -1), side);
        c.all_to_all_v(in.cbytes(), sb, out.bytes(), rb);
        const std::vector<int32_t>& recv = out.host();
        size_t at = 0;
        for (int r = 0; r < W; ++r)
            for (int64_t i = 0; i < n(r, me); ++i) ASSERT_EQ(recv[at++], label(r, me * 1000 + i)) << "round " << round;
        ASSERT_EQ(at, recv.size());
    }
}

void check_broadcast(Comm& c, Device side) {
    for (int root = 0; root < c.size(); ++root) {
        std::vector<int32_t> values(5);
        for (int64_t i = 0; i < 5; ++i) values[size_t(i)] = c.rank() == root ? label(root, i) : -1;
        Buf<int32_t> buf(values, side);
        c.broadcast(buf.bytes(), root);
        const std::vector<int32_t>& v = buf.host();
        for (int64_t i = 0; i < 5; ++i) ASSERT_EQ(v[size_t(i)], label(root, i));
    }
}

void check_reductions_sum_in_rank_order(Comm& c, Device side) {
    const int W = c.size(), me = c.rank();
    // values of very different magnitudes: float addition is not associative on them, so the bits
    // show the order of the sum
    auto value = [](int r, int64_t i) {
        return float(std::ldexp(1.0 + 0.1 * double(i % 7), int(((r * 7 + i) % 9) * 5 - 20)));
    };
    auto sum_in_rank_order = [&](int64_t j) {
        float want = 0;  // rank order, starting from rank 0's value
        for (int r = 0; r < W; ++r) want = r == 0 ? value(r, j) : want + value(r, j);
        return want;
    };
    const int64_t count = 11;
    std::vector<float> values(static_cast<size_t>(count * W));
    for (int64_t j = 0; j < count * W; ++j) values[size_t(j)] = value(me, j);
    Buf<float> send(values, side);
    {
        Buf<float> out(std::vector<float>(static_cast<size_t>(count), 7.0f), side);
        c.reduce_scatter(DType::f32, send.data(), out.data(), count);
        const std::vector<float>& recv = out.host();
        for (int64_t i = 0; i < count; ++i) {
            const float want = sum_in_rank_order(me * count + i);
            ASSERT_EQ(std::memcmp(&recv[size_t(i)], &want, 4), 0)
                << "element " << i << ": " << recv[size_t(i)] << " vs " << want;
        }
    }
    {  // a send buffer shorter than W chunks (ZeRO's flat gradients): the missing tail counts as zeros
        const int64_t short_count = std::max<int64_t>(0, count * W - 13);
        Buf<float> out(std::vector<float>(static_cast<size_t>(count), 7.0f), side);
        c.reduce_scatter(DType::f32, send.data(), out.data(), count, short_count);
        const std::vector<float>& recv = out.host();
        for (int64_t i = 0; i < count; ++i) {
            const int64_t j = me * count + i;
            const float want = j >= short_count ? 0.0f : sum_in_rank_order(j);
            ASSERT_EQ(std::memcmp(&recv[size_t(i)], &want, 4), 0) << "short send, element " << i;
        }
    }
    // uneven blocks (FSDP's pieces of a unit), added to what recv holds: recv + b_0 + b_1 + ... in rank order
    auto piece = [](int q) -> int64_t { return (q * 5 + 2) % 6; };
    std::vector<int64_t> counts(static_cast<size_t>(W));
    int64_t before = 0;  // elements of the blocks for lower ranks
    for (int q = 0; q < W; ++q) {
        counts[size_t(q)] = piece(q);
        if (q < me) before += piece(q);
    }
    std::vector<float> acc(static_cast<size_t>(piece(me)));
    for (int64_t i = 0; i < piece(me); ++i) acc[size_t(i)] = value(W, i);
    for (bool accumulate : {true, false}) {
        Buf<float> out(acc, side);
        c.reduce_scatter_v_async(DType::f32, send.data(), counts, out.data(), piece(me), accumulate).wait();
        const std::vector<float>& got = out.host();
        for (int64_t i = 0; i < piece(me); ++i) {
            float want = accumulate ? acc[size_t(i)] : 0.0f;
            for (int r = 0; r < W; ++r) {
                const float v = value(r, before + i);
                want = (r == 0 && !accumulate) ? v : want + v;
            }
            ASSERT_EQ(std::memcmp(&got[size_t(i)], &want, 4), 0)
                << (accumulate ? "accumulating" : "replacing") << ", element " << i;
        }
    }
    // the same blocks 7 elements apart (ZeRO-2's rounds: a piece of every rank's range), padding between
    // them that no rank may receive; with the scratch given (the received parts, then the packed blocks). At 4 ranks
    // rank 2 receives nothing: its receive buffer must not sit at its packed blocks' address, which MPI would read
    // as an in-place exchange (MPI_ERR_TRUNCATE, or a hang in the next collective)
    const int64_t stride = 7;
    std::vector<float> spread(size_t(stride * W), 1e30f);
    for (int q = 0, at = 0; q < W; at += int(piece(q)), ++q)
        for (int64_t i = 0; i < piece(q); ++i) spread[size_t(q * stride + i)] = values[size_t(at + i)];
    int64_t sent = 0;
    for (int64_t n : counts) sent += n;
    Buf<float> strided(spread, side), out(std::vector<float>(size_t(piece(me))), side);
    Buf<std::byte> scratch(std::vector<std::byte>(size_t((piece(me) * W + sent) * 4)), side);  // exactly its need
    std::vector<int64_t> offsets(static_cast<size_t>(W));
    for (int q = 0; q < W; ++q) offsets[size_t(q)] = q * stride;
    c.reduce_scatter_v_async(DType::f32, strided.data(), counts, out.data(), piece(me), false, scratch.bytes(), offsets)
        .wait();
    const std::vector<float>& got = out.host();
    for (int64_t i = 0; i < piece(me); ++i) {
        const float want = sum_in_rank_order(before + i);
        ASSERT_EQ(std::memcmp(&got[size_t(i)], &want, 4), 0) << "strided, element " << i;
    }
    EXPECT_THROW(c.reduce_scatter_v_async(DType::f32, strided.data(), counts, out.data(), piece(me), false, {},
                                          std::vector<int64_t>(size_t(W) + 1)),
                 Error)
        << "an offset for each rank, no more";
    // all-reduce of a count that does not divide by W, in place; and of integers
    std::vector<float> mine(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) mine[size_t(i)] = value(me, i);
    Buf<float> buf(mine, side);
    c.all_reduce(DType::f32, buf.data(), count);
    const std::vector<float>& reduced = buf.host();
    for (int64_t i = 0; i < count; ++i) {
        const float want = sum_in_rank_order(i);
        ASSERT_EQ(std::memcmp(&reduced[size_t(i)], &want, 4), 0) << "all_reduce element " << i;
    }
    Buf<int64_t> ints(std::vector<int64_t>{int64_t(me) + 1, -int64_t(me)}, side);
    c.all_reduce(DType::i64, ints.data(), 2);
    EXPECT_EQ(ints.host()[0], int64_t(W) * (W + 1) / 2);
    EXPECT_EQ(ints.host()[1], -int64_t(W) * (W - 1) / 2);
    Buf<double> half(std::vector<double>{0.5 * me}, side);
    c.all_reduce(DType::f64, half.data(), 1);
    EXPECT_EQ(half.host()[0], 0.25 * W * (W - 1));
}

void check_async_progresses_while_the_caller_computes(Comm& c) {
    if (c.size() < 2) return;
    // rank 1 joins late; rank 0's all-gather is pending meanwhile and rank 0 keeps computing
    std::vector<int32_t> send(3, c.rank()), recv(static_cast<size_t>(3 * c.size()));
    if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = std::chrono::steady_clock::now();
    parallel::Handle h = c.all_gather_async(bytes(send), bytes(recv));
    const double issued = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(issued, 0.05) << "issuing a collective blocked the caller";
    if (c.rank() == 0) {
        EXPECT_FALSE(h.done()) << "completed before rank 1 joined";
    }
    volatile double work = 0;  // the caller's compute, overlapping the collective
    for (int i = 0; i < 1000000; ++i) work = work + 1e-9 * i;
    h.wait();
    for (int r = 0; r < c.size(); ++r) EXPECT_EQ(recv[size_t(3 * r)], r);
    // the link delay is paid on the communication thread
    c.set_link_delay(1e-6);  // 1 µs per byte
    std::vector<std::byte> big(static_cast<size_t>(20000)), all(static_cast<size_t>(20000 * c.size()));
    const auto t1 = std::chrono::steady_clock::now();
    c.all_gather(big, all);
    EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(),
              0.02 * (c.size() - 1) * 0.9);
    c.set_link_delay(0);
    EXPECT_GT(c.stats().bytes_sent, 0);
}

void check_split_into_mesh_groups(Comm& c, Device side) {
    const int W = c.size();
    for (int ep : {1, 2, 4}) {
        if (W % ep != 0) continue;
        parallel::Mesh mesh(c, ep);
        EXPECT_EQ(mesh.expert().size(), ep);
        EXPECT_EQ(mesh.expert_data().size(), W / ep);
        EXPECT_EQ(mesh.expert().rank(), c.rank() % ep);
        EXPECT_EQ(mesh.expert_data().rank(), c.rank() / ep);
        // members of my expert group are the consecutive ranks of my block
        Buf<int32_t> me(std::vector<int32_t>{c.rank()}, side), members(std::vector<int32_t>(size_t(ep)), side);
        mesh.expert().all_gather(me.cbytes(), members.bytes());
        for (int i = 0; i < ep; ++i) EXPECT_EQ(members.host()[size_t(i)], c.rank() / ep * ep + i);
        Buf<int32_t> peers(std::vector<int32_t>(size_t(W / ep)), side);
        mesh.expert_data().all_gather(me.cbytes(), peers.bytes());
        for (int i = 0; i < W / ep; ++i) EXPECT_EQ(peers.host()[size_t(i)], c.rank() % ep + i * ep);
    }
    if (W == 3) {  // a layout that does not fit is a one-line error on every rank
        try {
            parallel::Mesh bad(c, 2);
            ADD_FAILURE() << "ep 2 over 3 ranks was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("does not divide the 3 ranks"), std::string::npos) << e.what();
        }
    }
    // pipeline stages: stage s is the ranks [s·D, (s+1)·D), its groups inside it; a pair exchanges with its neighbour
    for (int pp : {2, 4}) {
        if (W % pp != 0) continue;
        const int D = W / pp, s = c.rank() / D;
        parallel::Mesh mesh(c, 1, 0, pp);
        EXPECT_EQ(mesh.world().size(), W);
        EXPECT_EQ(mesh.data().size(), D);
        EXPECT_EQ(mesh.stage(), s);
        ASSERT_NE(mesh.pipeline(), nullptr);
        EXPECT_EQ(mesh.pipeline()->size(), pp);
        EXPECT_EQ(mesh.pipeline()->rank(), s);
        EXPECT_EQ(mesh.expert_data().size(), D);
        EXPECT_EQ(mesh.prev() != nullptr, s > 0);
        EXPECT_EQ(mesh.next() != nullptr, s + 1 < pp);
        // each stage sends its world rank forward and its negation back, both at once where it has both neighbours
        Buf<int32_t> fwd_in(std::vector<int32_t>{-1}, side), bwd_in(std::vector<int32_t>{-1}, side),
            fwd_out(std::vector<int32_t>{c.rank()}, side), bwd_out(std::vector<int32_t>{-c.rank() - 1}, side);
        if (s % 2 == 0) {  // even stages first toward the next, odd ones toward the previous: the same pairs in order
            if (mesh.next()) parallel::exchange(*mesh.next(), fwd_out.cbytes(), bwd_in.bytes());
            if (mesh.prev()) parallel::exchange(*mesh.prev(), bwd_out.cbytes(), fwd_in.bytes());
        } else {
            if (mesh.prev()) parallel::exchange(*mesh.prev(), bwd_out.cbytes(), fwd_in.bytes());
            if (mesh.next()) parallel::exchange(*mesh.next(), fwd_out.cbytes(), bwd_in.bytes());
        }
        EXPECT_EQ(fwd_in.host()[0], s > 0 ? c.rank() - D : -1);
        EXPECT_EQ(bwd_in.host()[0], s + 1 < pp ? -(c.rank() + D) - 1 : -1);
    }
    if (W == 4) {
        try {
            parallel::Mesh bad(c, 4, 0, 2);
            ADD_FAILURE() << "ep 4 in stages of 2 ranks was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("does not divide the 2 ranks of a pipeline stage"), std::string::npos)
                << e.what();
        }
    }
}

}  // namespace tessera::test
