// The CUDA runtime as the CUDA emulator provides it (src/cuda_emulator, docs/testing.md): the part of the runtime
// API and of the device language that tessera's CUDA backend uses, for a host compiler. A build with
// -DTESSERA_CUDA_EMULATOR=ON compiles ops/cuda/*.cu as C++ against this header and runs every kernel on the CPU:
// each block's threads are fibers that meet at __syncthreads and at warp shuffles, so the CUDA tests run on
// machines without a GPU. Device memory is host memory that host code cannot touch outside device work.
#pragma once

#include <math.h>  // the float overloads of exp, log, ... in the global namespace, as CUDA's math API has them

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ---- the device language's keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Shared memory: one copy per kernel, since the emulator runs one block at a time (under one lock for the process).
#define __shared__ static

// ---- types
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;
constexpr unsigned cudaStreamNonBlocking = 0x01;
constexpr unsigned cudaEventDisableTiming = 0x02;

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
};
struct cudaPointerAttributes {
    cudaMemoryType type;
    int device;
    void* devicePointer;
    void* hostPointer;
};

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int warpSize;
    int maxThreadsPerBlock;
    int multiProcessorCount;
    int major, minor;
};

// ---- the runtime API (the emulator's runtime.cpp)
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
// the device's free and total memory: its address range less what is allocated
cudaError_t cudaMemGetInfo(size_t* free, size_t* total);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemset2DAsync(
    void* p, size_t pitch, int value, size_t width, size_t height, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpyAsync(
    void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy2DAsync(void* dst,
                              size_t dpitch,
                              const void* src,
                              size_t spitch,
                              size_t width,
                              size_t height,
                              cudaMemcpyKind kind,
                              cudaStream_t stream = nullptr);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();
// Streams and events: the emulator's device work is done when its call returns, so these only keep handles apart.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);

namespace tessera::cuda_emulator {
// A kernel launch: `thread()` runs once per thread of every block, with threadIdx, blockIdx, blockDim and gridDim
// set; returns the launch's error (a bad configuration, or more dynamic shared memory than the kernel opted in to).
cudaError_t launch(const void* kernel,
                   dim3 grid,
                   dim3 block,
                   size_t dynamic_smem,
                   cudaStream_t stream,
                   void (*thread)(void*),
                   void* context);
cudaError_t set_max_dynamic_smem(const void* kernel, int bytes);
unsigned char* dynamic_shared_memory();  // 128-byte aligned
void block_barrier();
void warp_sync();                           // every live lane of the caller's warp meets here
[[noreturn]] void fault(const char* what);  // a misuse a GPU would not catch: stops the process with the message
// A warp's exchange: every live lane gives a value and gets lane src's (or its own, where src is past the block); the
// OR of the live lanes' bits.
uint64_t warp_exchange(uint64_t value, unsigned src);
unsigned warp_ballot(bool predicate);
}  // namespace tessera::cuda_emulator

template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    return tessera::cuda_emulator::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), value);
}

// ---- the device side: built-in variables, barriers, warp functions, intrinsics
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

inline void __syncthreads() { tessera::cuda_emulator::block_barrier(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { tessera::cuda_emulator::warp_sync(); }

template <class T>
T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    const unsigned lane = threadIdx.x % 32u, w = unsigned(width);
    bits = tessera::cuda_emulator::warp_exchange(bits, (lane & ~(w - 1)) | ((lane ^ unsigned(lane_mask)) & (w - 1)));
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return tessera::cuda_emulator::warp_ballot(predicate != 0) & mask;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, sizeof x);
    return x;
}

// Integer atomics: blocks and threads run one at a time, so a plain read-modify-write is atomic.
template <class T>
T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <class T>
T atomicMin(T* p, T v) {
    const T old = *p;
    if (v < old) *p = v;
    return old;
}

// CUDA's min and max overloads: fmax/fmin for floating types (a NaN loses), the usual comparison for integers
template <class A, class B>
std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmax(C(a), C(b));
    } else {
        return C(a) < C(b) ? C(b) : C(a);
    }
}
template <class A, class B>
std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmin(C(a), C(b));
    } else {
        return C(b) < C(a) ? C(b) : C(a);
    }
}
