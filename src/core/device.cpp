// Device memory and copies (core/device.h): host memory for Device::cpu, the CUDA runtime for
// Device::cuda when the build has the CUDA backend.
#include "core/device.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tessera {

namespace {
thread_local Stream t_stream;

#if TESSERA_WITH_CUDA
void check_cuda(cudaError_t err, const char* what, size_t bytes) {
    if (err == cudaSuccess) return;
    cudaGetLastError();  // clear a sticky launch error so the next call reports its own
    TESSERA_FAIL("CUDA {} of {} bytes failed: {}", what, bytes, cudaGetErrorString(err));
}
std::atomic<bool> g_device_memory_used{false};
cudaStream_t stream_of(Stream s) { return static_cast<cudaStream_t>(s.handle); }
cudaMemcpyKind copy_kind(Device dst, Device src) {
    if (dst == Device::cuda) return src == Device::cuda ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    return src == Device::cuda ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
}
#else
[[noreturn]] void no_cuda(const char* what) {
    TESSERA_FAIL(
        "{}: a tensor is on a CUDA device but this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)", what);
}
#endif
}  // namespace

Stream current_stream() { return t_stream; }
StreamGuard::StreamGuard(Stream s) : previous_(t_stream) { t_stream = s; }
StreamGuard::~StreamGuard() { t_stream = previous_; }

bool cuda_built() {
#if TESSERA_WITH_CUDA
    return true;
#else
    return false;
#endif
}

bool cuda_emulated() {
#if TESSERA_CUDA_EMULATOR
    return true;
#else
    return false;
#endif
}

bool cuda_available() {
#if TESSERA_WITH_CUDA
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
#else
    return false;
#endif
}

Device device_of_pointer(const void* p) {
#if TESSERA_WITH_CUDA
    // (a process that never allocated device memory has none, and asking the runtime would start a CUDA context)
    if (!p || !g_device_memory_used.load(std::memory_order_relaxed)) return Device::cpu;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {  // (older runtimes: unregistered host memory)
        cudaGetLastError();
        return Device::cpu;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? Device::cuda : Device::cpu;
#else
    (void)p;
    return Device::cpu;
#endif
}

int cuda_device_count() {
#if TESSERA_WITH_CUDA
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
#else
    return 0;
#endif
}

void use_cuda_device(int index) {
    const int count = cuda_device_count();
    TESSERA_CHECK(index >= 0 && index < count, "CUDA device {}: this machine has {}", index, count);
#if TESSERA_WITH_CUDA
    const cudaError_t err = cudaSetDevice(index);
    if (err != cudaSuccess) cudaGetLastError();
    TESSERA_CHECK(err == cudaSuccess, "CUDA device {}: cannot select it: {}", index, cudaGetErrorString(err));
#endif
}

int cuda_device_index() {
#if TESSERA_WITH_CUDA
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
    return dev;
#else
    return 0;
#endif
}

void* device_alloc(Device d, size_t bytes) {
    const size_t padded = (bytes + 255) / 256 * 256;
    if (d == Device::cpu) {
        const size_t align = bytes >= (size_t(1) << 16) ? 4096 : 256;  // large regions (arenas) on page boundaries
        void* p = std::aligned_alloc(align, padded == 0 ? align : (padded + align - 1) / align * align);
        TESSERA_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
        return p;
    }
#if TESSERA_WITH_CUDA
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, padded == 0 ? 256 : padded), "allocation", bytes);
    g_device_memory_used.store(true, std::memory_order_relaxed);
    return p;
#else
    no_cuda("device memory");
#endif
}

void device_free(Device d, void* p) {
    if (!p) return;
    if (d == Device::cpu) {
        std::free(p);
        return;
    }
#if TESSERA_WITH_CUDA
    cudaFree(p);  // (an error here would be a sticky one from earlier work: nothing to free differently)
#endif
}

void device_zero(Device d, void* p, size_t bytes) {
    if (bytes == 0) return;
    if (d == Device::cpu) {
        std::memset(p, 0, bytes);
        return;
    }
#if TESSERA_WITH_CUDA
    check_cuda(cudaMemsetAsync(p, 0, bytes, stream_of(t_stream)), "memset", bytes);
#else
    no_cuda("device memset");
#endif
}

namespace {
std::atomic<uint64_t> waits{0};
#if TESSERA_WITH_CUDA
void wait_for(const Stream& s, const char* what, size_t bytes) {
    waits.fetch_add(1, std::memory_order_relaxed);
    check_cuda(cudaStreamSynchronize(stream_of(s)), what, bytes);
}
#endif
}  // namespace

uint64_t device_waits() { return waits.load(std::memory_order_relaxed); }

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
    if (bytes == 0) return;
    if (dst_device == Device::cpu && src_device == Device::cpu) {
        std::memcpy(dst, src, bytes);
        return;
    }
#if TESSERA_WITH_CUDA
    check_cuda(cudaMemcpyAsync(dst, src, bytes, copy_kind(dst_device, src_device), stream_of(t_stream)), "copy", bytes);
    if (dst_device == Device::cpu) wait_for(t_stream, "copy to host", bytes);
#else
    no_cuda("device copy");
#endif
}

void copy_bytes_2d(void* dst,
                   size_t dst_pitch,
                   Device dst_device,
                   const void* src,
                   size_t src_pitch,
                   Device src_device,
                   size_t width,
                   size_t rows) {
    if (width == 0 || rows == 0) return;
    if (dst_device == Device::cpu && src_device == Device::cpu) {
        for (size_t r = 0; r < rows; ++r)
            std::memcpy(static_cast<std::byte*>(dst) + r * dst_pitch,
                        static_cast<const std::byte*>(src) + r * src_pitch, width);
        return;
    }
#if TESSERA_WITH_CUDA
    check_cuda(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, copy_kind(dst_device, src_device),
                                 stream_of(t_stream)),
               "2D copy", width * rows);
    if (dst_device == Device::cpu) wait_for(t_stream, "copy to host", width * rows);
#else
    no_cuda("device copy");
#endif
}

void synchronize(Device d) {
    if (d == Device::cpu) return;
#if TESSERA_WITH_CUDA
    wait_for(t_stream, "stream synchronize", 0);
#else
    no_cuda("device synchronize");
#endif
}

size_t cuda_free_bytes() {
#if TESSERA_WITH_CUDA
    size_t free = 0, total = 0;
    if (!cuda_available() || cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
    return free;
#else
    return 0;
#endif
}

std::string cuda_device_name() {
#if TESSERA_WITH_CUDA
    if (!cuda_available()) return "";
    int dev = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return "";
    return prop.name;
#else
    return "";
#endif
}

}  // namespace tessera
