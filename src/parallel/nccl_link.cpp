// The NCCL device link (see nccl_link.h).
#include "parallel/nccl_link.h"

#include "core/check.h"
#include "core/device.h"
#include "core/dynamic_library.h"

#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <vector>
#endif

namespace tessera::parallel {

#if TESSERA_WITH_CUDA
namespace {

struct NcclApi {
    decltype(&ncclGetErrorString) error_string;
    decltype(&ncclGetUniqueId) get_unique_id;
    decltype(&ncclCommInitRank) init_rank;
    decltype(&ncclCommDestroy) destroy;
    decltype(&ncclGroupStart) group_start;
    decltype(&ncclGroupEnd) group_end;
    decltype(&ncclSend) send;
    decltype(&ncclRecv) recv;
    decltype(&ncclBroadcast) broadcast;
};

const NcclApi& nccl() {
#if TESSERA_CUDA_EMULATOR
    static const NcclApi api{&ncclGetErrorString, &ncclGetUniqueId, &ncclCommInitRank,
                             &ncclCommDestroy,    &ncclGroupStart,  &ncclGroupEnd,
                             &ncclSend,           &ncclRecv,        &ncclBroadcast};
#else
    static const NcclApi api = [] {
#ifdef TESSERA_NCCL_LIBRARY
        const char* fallback = TESSERA_NCCL_LIBRARY;
#else
        const char* fallback = nullptr;
#endif
        const DynamicLibrary lib("libnccl.so." + std::to_string(NCCL_MAJOR), fallback, "NCCL (GPU ranks)");
        NcclApi a{};
        lib.bind(a.error_string, "ncclGetErrorString");
        lib.bind(a.get_unique_id, "ncclGetUniqueId");
        lib.bind(a.init_rank, "ncclCommInitRank");
        lib.bind(a.destroy, "ncclCommDestroy");
        lib.bind(a.group_start, "ncclGroupStart");
        lib.bind(a.group_end, "ncclGroupEnd");
        lib.bind(a.send, "ncclSend");
        lib.bind(a.recv, "ncclRecv");
        lib.bind(a.broadcast, "ncclBroadcast");
        return a;
    }();
#endif
    return api;
}

void check_nccl(ncclResult_t r, const char* what) {
    TESSERA_CHECK(r == ncclSuccess, "NCCL: {} failed: {}", what, nccl().error_string(r));
}

void check_cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    cudaGetLastError();
    TESSERA_FAIL("NCCL link: CUDA {} failed: {}", what, cudaGetErrorString(e));
}

class NcclLink final : public DeviceLink {
  public:
    explicit NcclLink(Comm& host) : rank_(host.rank()), size_(host.size()), device_(cuda_device_index()) {
        ncclUniqueId id{};
        if (rank_ == 0) check_nccl(nccl().get_unique_id(&id), "ncclGetUniqueId");
        host.broadcast(std::as_writable_bytes(std::span(&id, 1)), 0);
        check_nccl(nccl().init_rank(&comm_, size_, id, rank_), "ncclCommInitRank");
        check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream creation");
    }
    ~NcclLink() override {
        cudaStreamSynchronize(stream_);
        nccl().destroy(comm_);
        cudaStreamDestroy(stream_);
        device_free(Device::cuda, scratch_);
    }
    NcclLink(const NcclLink&) = delete;
    NcclLink& operator=(const NcclLink&) = delete;

    std::shared_ptr<void> issue_point() override {
        cudaEvent_t e = nullptr;
        check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event creation");
        std::shared_ptr<void> point(e, [](cudaEvent_t ev) { cudaEventDestroy(ev); });
        check_cuda(cudaEventRecord(e, static_cast<cudaStream_t>(current_stream().handle)), "event record");
        return point;
    }

    void* begin(const std::shared_ptr<void>& issued) override {
        check_cuda(cudaSetDevice(device_), "device selection");  // (the communication thread's device)
        check_cuda(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(issued.get()), 0), "stream wait");
        return stream_;
    }
    void end() override { check_cuda(cudaStreamSynchronize(stream_), "stream synchronize"); }

    void all_gather_v(std::span<const std::byte> send,
                      std::span<std::byte> recv,
                      std::span<const int64_t> recv_bytes) override {
        const std::vector<int64_t> send_bytes(size_t(size_), int64_t(send.size()));
        exchange(send, send_bytes, /*same_block=*/true, recv, recv_bytes);
    }

    void all_to_all_v(std::span<const std::byte> send,
                      std::span<const int64_t> send_bytes,
                      std::span<std::byte> recv,
                      std::span<const int64_t> recv_bytes) override {
        exchange(send, send_bytes, /*same_block=*/false, recv, recv_bytes);
    }

    void broadcast(std::span<std::byte> buf, int root) override {
        if (size_ == 1 || buf.empty()) return;
        check_nccl(nccl().broadcast(buf.data(), buf.data(), buf.size(), ncclUint8, root, comm_, stream_),
                   "ncclBroadcast");
    }

    std::span<std::byte> scratch(size_t bytes) override {
        if (bytes > scratch_bytes_) {  // (the previous collective's work is done: end synchronised the stream)
            device_free(Device::cuda, scratch_);
            scratch_ = nullptr;
            scratch_bytes_ = 0;
            scratch_ = device_alloc(Device::cuda, bytes);
            scratch_bytes_ = bytes;
        }
        return {static_cast<std::byte*>(scratch_), bytes};
    }

    std::unique_ptr<DeviceLink> split(Comm& child) override { return std::make_unique<NcclLink>(child); }

  private:
    // Rank q gets send_bytes[q] bytes (from the start of send when same_block, else the q-th consecutive block) and
    // this rank recv_bytes[q] from q, in consecutive blocks of recv: one group of sends and receives, this rank's
    // own block a device copy.
    void exchange(std::span<const std::byte> send,
                  std::span<const int64_t> send_bytes,
                  bool same_block,
                  std::span<std::byte> recv,
                  std::span<const int64_t> recv_bytes) {
        const std::byte* own = nullptr;
        std::byte* own_to = nullptr;
        check_nccl(nccl().group_start(), "ncclGroupStart");
        int64_t s = 0, r = 0;
        for (int q = 0; q < size_; ++q) {
            const int64_t sb = send_bytes[size_t(q)], rb = recv_bytes[size_t(q)];
            const std::byte* from = send.data() + (same_block ? 0 : s);
            if (q == rank_) {
                own = from;
                own_to = recv.data() + r;
            } else {
                if (sb > 0) check_nccl(nccl().send(from, size_t(sb), ncclUint8, q, comm_, stream_), "ncclSend");
                if (rb > 0)
                    check_nccl(nccl().recv(recv.data() + r, size_t(rb), ncclUint8, q, comm_, stream_), "ncclRecv");
            }
            s += sb;
            r += rb;
        }
        check_nccl(nccl().group_end(), "ncclGroupEnd");
        const int64_t mine = recv_bytes[size_t(rank_)];
        if (mine > 0)
            check_cuda(cudaMemcpyAsync(own_to, own, size_t(mine), cudaMemcpyDeviceToDevice, stream_), "own block copy");
    }

    int rank_, size_, device_;
    ncclComm_t comm_ = nullptr;
    cudaStream_t stream_ = nullptr;
    void* scratch_ = nullptr;
    size_t scratch_bytes_ = 0;
};

}  // namespace

std::unique_ptr<DeviceLink> make_nccl_link(Comm& host) { return std::make_unique<NcclLink>(host); }

#else

std::unique_ptr<DeviceLink> make_nccl_link(Comm&) {
    TESSERA_FAIL("NCCL: this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)");
}

#endif

}  // namespace tessera::parallel
