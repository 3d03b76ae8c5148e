// The CUDA emulator's internals that its cuBLAS shares with its runtime (src/cuda_emulator/runtime.cpp).
#pragma once

#include <cuda_runtime.h>

namespace tessera::cuda_emulator {

constexpr int kMaxDynamicSmemOptin = 232448;  // an H100's or H200's opt-in shared memory per block (227 KiB)

bool is_device_pointer(const void* p);

// Device work other than a kernel or a copy (the emulated cuBLAS): device memory is accessible while one lives.
class DeviceScope {
  public:
    DeviceScope();
    ~DeviceScope();
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

  private:
    void* work_;
};

}  // namespace tessera::cuda_emulator
