// MPI communicator (see comm_mpi.h). Byte transfers map to MPI_Allgather, MPI_Alltoallv and
// MPI_Bcast on MPI_BYTE; reductions are the fixed-order ones of comm.cpp.
#include "parallel/comm_mpi.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <thread>

#include "core/check.h"

namespace tessera::parallel {

namespace {
std::shared_ptr<ProgressThread>& progress_thread() {
    static std::shared_ptr<ProgressThread> t;
    return t;
}

void check_mpi(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    TESSERA_FAIL("MPI: {} failed: {}", what, std::string(text, size_t(len)));
}

int as_count(int64_t bytes, const char* what) {
    TESSERA_CHECK(bytes <= INT_MAX, "MPI: {} of {} bytes exceeds MPI's int count per rank", what, bytes);
    return int(bytes);
}

// Completes a nonblocking collective. MPI's own wait spins (sched_yield when oversubscribed), which on a CPU
// machine takes the cores the ranks compute on while the communication thread waits for a peer that is still
// computing. So: poll, and after a short spin, sleep between polls, longer the longer it waits (at most 100 µs).
void finish(MPI_Request& req, const char* what) {
    int done = 0;
    std::chrono::microseconds nap{2};
    for (int spins = 0;; ++spins) {
        check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
        if (done) return;
        if (spins < 64) continue;
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds{100});
    }
}

class MpiComm final : public Comm {
  public:
    explicit MpiComm(MPI_Comm c) : comm_(c) {
        MPI_Comm_rank(c, &rank_);
        MPI_Comm_size(c, &size_);
    }
    ~MpiComm() override {
        if (comm_ != MPI_COMM_WORLD) submit([c = comm_]() mutable { MPI_Comm_free(&c); }).wait();
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string backend() const override { return "mpi"; }

    std::unique_ptr<Comm> do_split(int color, int key) override {
        MPI_Comm out = MPI_COMM_NULL;
        submit([&] { check_mpi(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split"); }).wait();
        return std::make_unique<MpiComm>(out);
    }

  protected:
    Handle submit(std::function<void()> job) override { return progress_thread()->submit(std::move(job)); }

    void do_all_gather_v(std::span<const std::byte> send,
                         std::span<std::byte> recv,
                         std::span<const int64_t> recv_bytes) override {
        const size_t n = static_cast<size_t>(size_);
        std::vector<int> rc(n), rd(n);
        int64_t at = 0;
        for (int r = 0; r < size_; ++r) {
            rc[size_t(r)] = as_count(recv_bytes[size_t(r)], "all_gather");
            rd[size_t(r)] = as_count(at, "all_gather offset");
            at += recv_bytes[size_t(r)];
        }
        MPI_Request req;
        check_mpi(MPI_Iallgatherv(send.data(), as_count(int64_t(send.size()), "all_gather"), MPI_BYTE, recv.data(),
                                  rc.data(), rd.data(), MPI_BYTE, comm_, &req),
                  "MPI_Iallgatherv");
        finish(req, "MPI_Iallgatherv");
    }

    void do_all_to_all_v(std::span<const std::byte> send,
                         std::span<const int64_t> send_bytes,
                         std::span<std::byte> recv,
                         std::span<const int64_t> recv_bytes) override {
        const size_t n = static_cast<size_t>(size_);
        std::vector<int> sc(n), sd(n), rc(n), rd(n);
        int64_t so = 0, ro = 0;
        for (int r = 0; r < size_; ++r) {
            sc[size_t(r)] = as_count(send_bytes[size_t(r)], "all_to_all_v");
            rc[size_t(r)] = as_count(recv_bytes[size_t(r)], "all_to_all_v");
            sd[size_t(r)] = as_count(so, "all_to_all_v offset");
            rd[size_t(r)] = as_count(ro, "all_to_all_v offset");
            so += send_bytes[size_t(r)];
            ro += recv_bytes[size_t(r)];
        }
        MPI_Request req;
        check_mpi(MPI_Ialltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(), rc.data(), rd.data(),
                                 MPI_BYTE, comm_, &req),
                  "MPI_Ialltoallv");
        finish(req, "MPI_Ialltoallv");
    }

    void do_broadcast(std::span<std::byte> buf, int root) override {
        MPI_Request req;
        check_mpi(MPI_Ibcast(buf.data(), as_count(int64_t(buf.size()), "broadcast"), MPI_BYTE, root, comm_, &req),
                  "MPI_Ibcast");
        finish(req, "MPI_Ibcast");
    }

    void do_barrier() override {
        MPI_Request req;
        check_mpi(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
        finish(req, "MPI_Ibarrier");
    }

  private:
    MPI_Comm comm_;
    int rank_ = 0, size_ = 1;
};
}  // namespace

bool launched_by_mpi() {
    for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"})
        if (std::getenv(v)) return true;
    return false;
}

MpiRuntime::MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    TESSERA_CHECK(!initialized, "MPI: initialised twice in one process");
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    if (provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        TESSERA_FAIL("MPI: the library gives thread level {}, tessera needs MPI_THREAD_SERIALIZED", provided);
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    progress_thread() = std::make_shared<ProgressThread>();
}

MpiRuntime::~MpiRuntime() {
    progress_thread().reset();  // drains its queue
    MPI_Finalize();
}

void MpiRuntime::abort(int status) {
    MPI_Abort(MPI_COMM_WORLD, status);
    std::_Exit(status);  // (MPI_Abort does not return)
}

int local_ranks() {
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
        if (const char* s = std::getenv(v)) {
            const int n = std::atoi(s);
            if (n > 0) return n;
        }
    }
    return 1;
}

int local_rank() {
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
        if (const char* s = std::getenv(v)) {
            const int n = std::atoi(s);
            if (n >= 0) return n;
        }
    }
    return 0;
}

std::unique_ptr<Comm> MpiRuntime::world() { return std::make_unique<MpiComm>(MPI_COMM_WORLD); }

}  // namespace tessera::parallel
