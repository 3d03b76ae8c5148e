// Memory and copies on the devices a TensorView can name (core/tensor.h: Device::cpu, Device::cuda),
// and the stream ops enqueue their work on. The one place that talks to the CUDA runtime outside the
// kernels: a build without the CUDA backend compiles the same calls and fails them with a clear error.
//
// Streams: every op takes its stream from the calling thread's current stream (a null handle is the
// device's default stream); StreamGuard sets it for a scope, so a trainer can put its work on its own
// streams without every op signature growing an argument. On the CPU, work is synchronous and the
// stream is ignored.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tessera {

// A CUDA stream (cudaStream_t) without the CUDA headers; null is the default stream.
struct Stream {
    void* handle = nullptr;
};

// The calling thread's stream for device work, and a scope that sets it.
Stream current_stream();
class StreamGuard {
  public:
    explicit StreamGuard(Stream s);
    ~StreamGuard();
    StreamGuard(const StreamGuard&) = delete;
    StreamGuard& operator=(const StreamGuard&) = delete;

  private:
    Stream previous_;
};

// Whether this build has the CUDA backend, and whether a CUDA device is present (false without the backend);
// whether that device is the CUDA emulator's (src/cuda_emulator, which shows TESSERA_CUDA_EMULATOR_DEVICES devices).
bool cuda_built();
bool cuda_available();
bool cuda_emulated();

// The device whose memory p points into: cuda for CUDA device (and managed) memory, else cpu (host memory, null).
Device device_of_pointer(const void* p);

// Makes CUDA device `index` the calling thread's (one rank per GPU: its local rank modulo the devices); throws when
// there is no such device. Every thread that does device work sets it (cuda_device_index() says which).
void use_cuda_device(int index);
int cuda_device_count();  // 0 without the backend or a device
int cuda_device_index();  // the calling thread's device

// Memory: aligned to at least 256 bytes on every device (host regions of 64 KiB and more to pages). device_alloc throws
// tessera::Error when the device has no room (or no CUDA backend / device is there); device_free takes what
// device_alloc returned.
void* device_alloc(Device d, size_t bytes);
void device_free(Device d, void* p);
void device_zero(Device d, void* p, size_t bytes);  // on the current stream

// Copies bytes between any two devices, on the current stream (asynchronous for device ↔ device and for
// pinned host memory; the host side of a copy to or from pageable memory is done when this returns).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// `rows` runs of `width` bytes, run r from src + r·src_pitch to dst + r·dst_pitch (a strided block: one CUDA 2D copy).
void copy_bytes_2d(void* dst,
                   size_t dst_pitch,
                   Device dst_device,
                   const void* src,
                   size_t src_pitch,
                   Device src_device,
                   size_t width,
                   size_t rows);
// Waits until the current stream's work on the device is done (a no-op on the CPU).
void synchronize(Device d);
// The current CUDA device's free memory in bytes (cudaMemGetInfo); 0 without a device.
size_t cuda_free_bytes();
// How many times this process's host has waited for a device stream so far (a copy to the host, synchronize): each
// wait drains the queue of launches, so the step path keeps them few (tests count them).
uint64_t device_waits();

// The values of a small contiguous view on the host: its own memory on the CPU, else copied into `buffer` (grown
// once, then reused).
template <class T>
std::span<const T> read_to_host(const TensorView& v, std::vector<T>& buffer) {
    if (v.device == Device::cpu) return {v.ptr<T>(), size_t(v.numel())};
    buffer.resize(size_t(v.numel()));
    copy_bytes(buffer.data(), Device::cpu, v.data, v.device, buffer.size() * sizeof(T));
    return buffer;
}

// The name of the CUDA device in use ("" without one).
std::string cuda_device_name();

}  // namespace tessera
