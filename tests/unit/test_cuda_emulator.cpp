// The CUDA emulator (src/cuda_emulator) itself: barriers and warp shuffles behave as on a GPU, a racy kernel gives
// different results in the two thread orders, host code that touches device memory faults, threads that wait at
// different barriers stop the process, and the runtime's checks (launch shapes, opt-in shared memory, copy sides)
// answer with CUDA's errors; WMMA's tiles multiply as matrices and its misuses stop the process. Built only with
// -DTESSERA_CUDA_EMULATOR=ON.
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <vector>

#include <cuda_bf16.h>
#include <mma.h>

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

// C = relu(A·B) by WMMA: A [32, 48] bf16 row-major, B [48, 32] bf16 column-major (each column a row of `b`, as
// the indexer reads keys), C [32, 32] f32 row-major; a warp per 16×16 tile of C, three products each. The relu goes
// over the accumulator's elements (layout-free); `offset` moves C's pointer off its 32-byte alignment.
__global__ void wmma_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, int offset) {
    namespace wmma = nvcuda::wmma;
    const int warp = int(threadIdx.x / 32), r0 = warp / 2 * 16, c0 = warp % 2 * 16;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k0 = 0; k0 < 48; k0 += 16) {
        wmma::load_matrix_sync(fa, a + r0 * 48 + k0, 48);
        wmma::load_matrix_sync(fb, b + c0 * 48 + k0, 48);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    for (int i = 0; i < acc.num_elements; ++i) acc.x[i] = acc.x[i] > 0.0f ? acc.x[i] : 0.0f;
    wmma::store_matrix_sync(c + offset + r0 * 32 + c0, acc, 32, wmma::mem_row_major);
}

struct WmmaCase {
    std::vector<float> a, b;  // A [32, 48] and Bᵀ [32, 48], small integers (exact in bf16, sums exact in f32)
    __nv_bfloat16 *da = nullptr, *db = nullptr;
    float* dc = nullptr;
    WmmaCase() : a(32 * 48), b(32 * 48) {
        for (size_t i = 0; i < a.size(); ++i) {
            a[i] = float(int(i * 7 % 13) - 6);
            b[i] = float(int(i * 5 % 11) - 5);
        }
        std::vector<__nv_bfloat16> ha(a.size()), hb(b.size());
        for (size_t i = 0; i < a.size(); ++i) {
            ha[i] = __float2bfloat16(a[i]);
            hb[i] = __float2bfloat16(b[i]);
        }
        da = device_copy(ha);
        db = device_copy(hb);
        dc = device_copy(std::vector<float>(32 * 32 + 8));
    }
    ~WmmaCase() {
        cudaFree(da);
        cudaFree(db);
        cudaFree(dc);
    }
};

TEST(CudaEmulator, WmmaTilesMultiplyAsMatrices) {
    for (const char* order : {"forward", "reverse"}) {
        setenv("TESSERA_CUDA_EMULATOR_ORDER", order, 1);
        WmmaCase m;
        launch_kernel(wmma_kernel, 1, 128, 0, nullptr, m.da, m.db, m.dc, 0);
        unsetenv("TESSERA_CUDA_EMULATOR_ORDER");
        ASSERT_EQ(cudaGetLastError(), cudaSuccess);
        const std::vector<float> c = host_copy(m.dc, 32 * 32);
        int positive = 0;
        for (int i = 0; i < 32; ++i)
            for (int j = 0; j < 32; ++j) {
                float want = 0;
                for (int k = 0; k < 48; ++k) want += m.a[size_t(i * 48 + k)] * m.b[size_t(j * 48 + k)];
                ASSERT_EQ(c[size_t(i * 32 + j)], std::max(want, 0.0f)) << order << " C[" << i << ", " << j << "]";
                positive += want > 0;
            }
        EXPECT_GT(positive, 100) << "the relu left too few entries to check";
        EXPECT_LT(positive, 1000) << "the relu clipped nothing";
    }
}

TEST(CudaEmulatorDeathTest, WmmaOnAMisalignedPointerStopsTheProcess) {
    WmmaCase m;
    EXPECT_DEATH(launch_kernel(wmma_kernel, 1, 128, 0, nullptr, m.da, m.db, m.dc, 1), "misaligned");
}

}  // namespace
}  // namespace tessera
