// The CUDA emulator (src/cuda_emulator) itself: barriers and warp shuffles behave as on a GPU, a racy kernel gives
// different results in the two thread orders, host code that touches device memory faults, threads that wait at
// different barriers stop the process, and the runtime's checks (launch shapes, opt-in shared memory, copy sides)
// answer with CUDA's errors. Built only with -DTESSERA_CUDA_EMULATOR=ON.
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <vector>

#include "ops/cuda/kernel_util.cuh"

namespace tessera {
namespace {

using ops::cuda::launch_kernel;

template <class T>
T* device_copy(const std::vector<T>& host) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<T*>(p);
}

template <class T>
std::vector<T> host_copy(const T* device, size_t n) {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpyAsync(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
}

// Each block sums its slice with ops::cuda::block_sum (warp shuffles, then __syncthreads around shared memory).
__global__ void block_sums_kernel(const double* x, int64_t n, double* out) {
    __shared__ double partial[32];
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    const double total = ops::cuda::block_sum(i < n ? x[i] : 0.0, partial);
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}

TEST(CudaEmulator, BlockSumsMeetAtTheirBarriers) {
    std::vector<double> x(1000);
    std::iota(x.begin(), x.end(), 1.0);
    double* dx = device_copy(x);
    double* dout = device_copy(std::vector<double>(4));
    launch_kernel(block_sums_kernel, 4, 256, 0, nullptr, dx, int64_t(x.size()), dout);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<double> got = host_copy(dout, 4);
    for (int b = 0; b < 4; ++b) {
        double want = 0;
        for (int i = b * 256; i < std::min(1000, (b + 1) * 256); ++i) want += x[size_t(i)];
        EXPECT_EQ(got[size_t(b)], want) << "block " << b;
    }
    cudaFree(dx);
    cudaFree(dout);
}

// Every thread reads its right neighbour's shared slot: with the barrier, the neighbour's write; without it, whatever
// was there before, depending on which thread ran first.
__global__ void neighbour_kernel(bool barrier, int* out) {
    __shared__ int slot[64];
    slot[threadIdx.x] = -1;
    __syncthreads();
    slot[threadIdx.x] = int(threadIdx.x);
    if (barrier) __syncthreads();
    out[threadIdx.x] = slot[(threadIdx.x + 1) % 64];
}

std::vector<int> neighbours(bool barrier, const char* order) {
    setenv("TESSERA_CUDA_EMULATOR_ORDER", order, 1);
    int* d = device_copy(std::vector<int>(64));
    launch_kernel(neighbour_kernel, 1, 64, 0, nullptr, barrier, d);
    unsetenv("TESSERA_CUDA_EMULATOR_ORDER");
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<int> got = host_copy(d, 64);
    cudaFree(d);
    return got;
}

TEST(CudaEmulator, ARaceGivesDifferentResultsInTheTwoThreadOrders) {
    std::vector<int> want(64);
    for (int t = 0; t < 64; ++t) want[size_t(t)] = (t + 1) % 64;
    EXPECT_EQ(neighbours(true, "forward"), want);
    EXPECT_EQ(neighbours(true, "reverse"), want);
    EXPECT_NE(neighbours(false, "forward"), neighbours(false, "reverse"));
}

__global__ void shuffle_kernel(int* out) {
    const int lane = int(threadIdx.x % 32);
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
    const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
    out[64 + threadIdx.x] = __popc(ballot);
}

TEST(CudaEmulator, WarpShufflesAndBallotsExchangeWithinTheWarp) {
    int* d = device_copy(std::vector<int>(128));
    launch_kernel(shuffle_kernel, 1, 64, 0, nullptr, d);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<int> got = host_copy(d, 128);
    for (int t = 0; t < 64; ++t) {
        EXPECT_EQ(got[size_t(t)], ((t % 32) ^ 5) * 10) << t;
        EXPECT_EQ(got[size_t(64 + t)], 11) << t;  // lanes 0, 3, ..., 30
    }
    cudaFree(d);
}

__global__ void dynamic_smem_kernel(int* out) {
    unsigned char* smem = ops::cuda::dynamic_shared();
    smem[threadIdx.x] = static_cast<unsigned char>(threadIdx.x);
    __syncthreads();
    out[threadIdx.x] = smem[31 - threadIdx.x];
}

TEST(CudaEmulator, LaunchesAreCheckedAsTheRuntimeChecksThem) {
    int* d = device_copy(std::vector<int>(32));
    launch_kernel(dynamic_smem_kernel, 1, 32, 64, nullptr, d);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(host_copy(d, 32)[0], 31);
    launch_kernel(dynamic_smem_kernel, 1, 2048, 64, nullptr, d);  // > 1024 threads
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the error is cleared once read";
    launch_kernel(dynamic_smem_kernel, 1, 32, 64 << 10, nullptr, d);  // past 48 KiB without opting in
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
    ASSERT_EQ(cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
              cudaSuccess);
    launch_kernel(dynamic_smem_kernel, 1, 32, 64 << 10, nullptr, d);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    // copies name their sides
    std::vector<int> host(32);
    EXPECT_EQ(cudaMemcpyAsync(host.data(), d, 128, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    EXPECT_EQ(cudaMemcpyAsync(d, host.data(), 128, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    EXPECT_EQ(cudaFree(host.data()), cudaErrorInvalidDevicePointer);
    cudaGetLastError();
    cudaFree(d);
}

TEST(CudaEmulatorDeathTest, HostCodeThatTouchesDeviceMemoryFaults) {
    int* d = device_copy(std::vector<int>{7});
    EXPECT_EQ(host_copy(d, 1)[0], 7);
    EXPECT_DEATH({ [[maybe_unused]] volatile int x = *d; }, "");
    cudaFree(d);
}

TEST(CudaEmulator, NewDeviceMemoryReadsAsNaN) {
    void* p = nullptr;
    ASSERT_EQ(cudaMalloc(&p, 16), cudaSuccess);
    const std::vector<float> got = host_copy(static_cast<const float*>(p), 4);
    for (float v : got) EXPECT_TRUE(std::isnan(v));
    cudaFree(p);
}

// Half a warp at __syncthreads, the other half at a shuffle that needs the whole warp: a hang on a GPU.
__global__ void split_barrier_kernel() {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __shfl_xor_sync(0xffffffffu, 1, 1);
    }
}

TEST(CudaEmulatorDeathTest, ThreadsAtDifferentBarriersStopTheProcess) {
    EXPECT_DEATH(launch_kernel(split_barrier_kernel, 1, 32, 0, nullptr), "wait at different barriers");
}

}  // namespace
}  // namespace tessera
