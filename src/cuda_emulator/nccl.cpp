// The CUDA emulator's NCCL (include/nccl.h): ranks are processes on this machine, each pair joined by a Unix stream
// socket (Linux's abstract names, so nothing is left on disk). Within a group, every transfer to or from a peer is
// one message with an 8-byte length; a peer's messages arrive in the order it sent them, as NCCL pairs sends and
// receives. A group runs when it ends: the sends are copied off the device, all sockets progress together (poll)
// until every message is out and in, and the received bytes are copied onto the device. Device memory is touched only
// inside those copies (emulator.h's DeviceScope), never while waiting for a peer.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emulator/emulator.h"
#include "nccl.h"

struct ncclComm {
    int rank = 0, size = 1;
    std::vector<int> fds;  // fds[q]: the socket to rank q (-1 for this rank)
};

namespace {

[[noreturn]] void die(const std::string& what) {
    std::fprintf(stderr, "CUDA emulator: NCCL: %s\n", what.c_str());
    std::abort();
}

ncclResult_t fail(ncclResult_t r, const std::string& what) {
    std::fprintf(stderr, "CUDA emulator: NCCL: %s\n", what.c_str());
    return r;
}

sockaddr_un address(const ncclUniqueId& id, int rank, socklen_t* len) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string name = std::string(id.internal) + "-" + std::to_string(rank);
    std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: an abstract name
    *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return a;
}

bool write_all(int fd, const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
        const ssize_t w = ::write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        c += w;
        n -= size_t(w);
    }
    return true;
}

bool read_all(int fd, void* p, size_t n) {
    char* c = static_cast<char*>(p);
    while (n > 0) {
        const ssize_t r = ::read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= size_t(r);
    }
    return true;
}

// One transfer of a group: bytes to or from a peer.
struct Op {
    bool send;
    const void* device_src;  // send
    void* device_dst;        // receive
    size_t bytes;
    int peer;
    ncclComm_t comm;
};

// A peer's side of a running group: the bytes still to write, and the messages still to read in order.
struct Peer {
    int fd = -1;
    std::vector<char> out;  // every message to it, each with its length in front
    size_t written = 0;
    std::vector<size_t> in_ops;  // indices into the group's ops, the receives from it in order
    size_t in_at = 0;            // the receive being read
    uint64_t header = 0;
    size_t header_read = 0, body_read = 0;
};

thread_local int t_group_depth = 0;
thread_local std::vector<Op> t_group;

ncclResult_t run_group(std::vector<Op> ops) {
    std::vector<std::vector<char>> staged(ops.size());
    std::vector<Peer> peers;  // by (comm, peer): a group may mix communicators; each pair is one socket
    auto peer_of = [&](const Op& o) -> Peer& {
        const int fd = o.comm->fds[size_t(o.peer)];
        for (Peer& p : peers)
            if (p.fd == fd) return p;
        peers.push_back(Peer{});
        peers.back().fd = fd;
        return peers.back();
    };
    {
        tessera::cuda_emulator::DeviceScope device;
        for (size_t i = 0; i < ops.size(); ++i) {
            const Op& o = ops[i];
            if (o.send) {
                Peer& p = peer_of(o);
                const uint64_t n = o.bytes;
                const size_t at = p.out.size();
                p.out.resize(at + sizeof n + o.bytes);
                std::memcpy(p.out.data() + at, &n, sizeof n);
                if (o.bytes > 0) std::memcpy(p.out.data() + at + sizeof n, o.device_src, o.bytes);
            } else {
                peer_of(o).in_ops.push_back(i);
                staged[i].resize(o.bytes);
            }
        }
    }
    for (;;) {
        std::vector<pollfd> fds;
        for (Peer& p : peers) {
            short events = 0;
            if (p.written < p.out.size()) events |= POLLOUT;
            if (p.in_at < p.in_ops.size()) events |= POLLIN;
            if (events) fds.push_back(pollfd{p.fd, events, 0});
        }
        if (fds.empty()) break;
        if (::poll(fds.data(), nfds_t(fds.size()), -1) < 0) {
            if (errno == EINTR) continue;
            die(std::string("poll failed: ") + std::strerror(errno));
        }
        for (const pollfd& f : fds) {
            Peer* pp = nullptr;
            for (Peer& p : peers)
                if (p.fd == f.fd) pp = &p;
            Peer& p = *pp;
            if (f.revents & POLLOUT) {
                const ssize_t w = ::send(p.fd, p.out.data() + p.written, p.out.size() - p.written, MSG_DONTWAIT);
                if (w < 0 && errno != EAGAIN && errno != EINTR) die(std::string("send: ") + std::strerror(errno));
                if (w > 0) p.written += size_t(w);
            }
            if (f.revents & (POLLIN | POLLHUP | POLLERR)) {
                if (p.in_at >= p.in_ops.size()) {
                    if (f.revents & (POLLHUP | POLLERR)) die("a peer closed its connection");
                    continue;
                }
                const Op& o = ops[p.in_ops[p.in_at]];
                char* to;
                size_t want;
                if (p.header_read < sizeof p.header) {
                    to = reinterpret_cast<char*>(&p.header) + p.header_read;
                    want = sizeof p.header - p.header_read;
                } else {
                    to = staged[p.in_ops[p.in_at]].data() + p.body_read;
                    want = o.bytes - p.body_read;
                }
                ssize_t r = want > 0 ? ::recv(p.fd, to, want, MSG_DONTWAIT) : 0;
                if (r == 0 && want > 0) die("rank " + std::to_string(o.peer) + " closed its connection mid-group");
                if (r < 0 && errno != EAGAIN && errno != EINTR) die(std::string("recv: ") + std::strerror(errno));
                if (r < 0) r = 0;
                if (p.header_read < sizeof p.header) {
                    p.header_read += size_t(r);
                    if (p.header_read == sizeof p.header && p.header != o.bytes)
                        die("rank " + std::to_string(o.comm->rank) + " receives " + std::to_string(o.bytes) +
                            " bytes from rank " + std::to_string(o.peer) + ", which sent " + std::to_string(p.header) +
                            " (the ranks' sends and receives do not pair up)");
                } else {
                    p.body_read += size_t(r);
                }
                if (p.header_read == sizeof p.header && p.body_read == o.bytes) {
                    ++p.in_at;
                    p.header_read = p.body_read = 0;
                }
            }
        }
    }
    tessera::cuda_emulator::DeviceScope device;
    for (size_t i = 0; i < ops.size(); ++i)
        if (!ops[i].send && ops[i].bytes > 0) std::memcpy(ops[i].device_dst, staged[i].data(), ops[i].bytes);
    return ncclSuccess;
}

ncclResult_t enqueue(Op op) {
    if (!op.comm) return fail(ncclInvalidArgument, "a null communicator");
    if (op.peer < 0 || op.peer >= op.comm->size || op.peer == op.comm->rank)
        return fail(ncclInvalidArgument, "peer " + std::to_string(op.peer) + " of " + std::to_string(op.comm->size) +
                                             " ranks from rank " + std::to_string(op.comm->rank) +
                                             " (the emulator sends to other ranks only)");
    const void* buf = op.send ? op.device_src : op.device_dst;
    if (op.bytes > 0 && !tessera::cuda_emulator::is_device_pointer(buf))
        return fail(ncclInvalidArgument,
                    std::string(op.send ? "ncclSend" : "ncclRecv") + ": the buffer is not device memory");
    t_group.push_back(op);
    if (t_group_depth > 0) return ncclSuccess;
    return ncclGroupEnd();  // (a lone call is a group of one)
}

}  // namespace

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess:
            return "no error";
        case ncclUnhandledCudaError:
            return "unhandled cuda error";
        case ncclSystemError:
            return "unhandled system error";
        case ncclInternalError:
            return "internal error";
        case ncclInvalidArgument:
            return "invalid argument";
        case ncclInvalidUsage:
            return "invalid usage";
        case ncclRemoteError:
            return "remote process exited or there was a network error";
    }
    return "unknown result code";
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static std::atomic<int> counter{0};
    timespec t{};
    clock_gettime(CLOCK_REALTIME, &t);
    *id = {};
    std::snprintf(id->internal, sizeof id->internal, "tessera-nccl-%d-%d-%lld%09ld", int(getpid()), counter++,
                  static_cast<long long>(t.tv_sec), t.tv_nsec);
    return ncclSuccess;
}

// Rank r listens on "<id>-r", connects to every lower rank (retrying until it listens, for a minute) and accepts the
// higher ones; each connection starts with the connecting rank's number.
ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
    auto comm = new ncclComm{rank, nranks, std::vector<int>(size_t(nranks), -1)};
    auto abandon = [&](const std::string& what) {
        for (int fd : comm->fds)
            if (fd >= 0) ::close(fd);
        delete comm;
        return fail(ncclSystemError, what + ": " + std::strerror(errno));
    };
    const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener < 0) return abandon("socket");
    socklen_t len = 0;
    sockaddr_un me = address(id, rank, &len);
    if (::bind(listener, reinterpret_cast<sockaddr*>(&me), len) != 0 || ::listen(listener, nranks) != 0) {
        ::close(listener);
        return abandon("bind");
    }
    for (int q = 0; q < rank; ++q) {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            ::close(listener);
            return abandon("socket");
        }
        comm->fds[size_t(q)] = fd;
        sockaddr_un peer = address(id, q, &len);
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (::connect(fd, reinterpret_cast<sockaddr*>(&peer), len) != 0) {
            if (std::chrono::steady_clock::now() > deadline) {
                ::close(listener);
                return abandon("rank " + std::to_string(rank) + " cannot reach rank " + std::to_string(q));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        const int32_t r = rank;
        if (!write_all(fd, &r, sizeof r)) {
            ::close(listener);
            return abandon("handshake");
        }
    }
    for (int n = rank + 1; n < nranks; ++n) {
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        int32_t r = -1;
        if (fd < 0 || !read_all(fd, &r, sizeof r) || r <= rank || r >= nranks || comm->fds[size_t(r)] >= 0) {
            if (fd >= 0) ::close(fd);
            ::close(listener);
            return abandon("handshake");
        }
        comm->fds[size_t(r)] = fd;
    }
    ::close(listener);
    *out = comm;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    for (int fd : comm->fds)
        if (fd >= 0) ::close(fd);
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
    ++t_group_depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (t_group_depth > 0 && --t_group_depth > 0) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(t_group);
    return run_group(std::move(ops));
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t) {
    if (type != ncclInt8 && type != ncclUint8) return fail(ncclInvalidArgument, "ncclSend: bytes only");
    return enqueue(Op{true, buf, nullptr, count, peer, comm});
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t) {
    if (type != ncclInt8 && type != ncclUint8) return fail(ncclInvalidArgument, "ncclRecv: bytes only");
    return enqueue(Op{false, nullptr, buf, count, peer, comm});
}

// The root sends to every other rank (and copies to its own receive buffer); the others receive from it.
ncclResult_t ncclBroadcast(
    const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm, cudaStream_t stream) {
    if (!comm || root < 0 || root >= comm->size) return fail(ncclInvalidArgument, "ncclBroadcast: root");
    ncclGroupStart();
    ncclResult_t r = ncclSuccess;
    if (comm->rank == root) {
        if (send != recv && count > 0 && cudaMemcpyAsync(recv, send, count, cudaMemcpyDeviceToDevice, stream))
            r = fail(ncclUnhandledCudaError, "ncclBroadcast: the root's copy");
        for (int q = 0; q < comm->size && r == ncclSuccess; ++q)
            if (q != root) r = ncclSend(send, count, type, q, comm, stream);
    } else {
        r = ncclRecv(recv, count, type, root, comm, stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
}
