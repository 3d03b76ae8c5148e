// The NCCL device link (parallel/comm.h: DeviceLink): a communicator's GPU buffers travel over an NCCL communicator
// of the same ranks, one GPU per rank. Bytes only: all-gather-v and all-to-all-v are grouped sends and receives
// (NCCL's own all-gather takes equal blocks), broadcast is NCCL's; the reductions stay comm.cpp's all-to-all and
// rank-order sum (on the GPU), so they keep the CPU's bits where NCCL's own reduce-scatter would pick its order by
// topology. The link's work runs on its own stream, which waits for the issuing stream's point at issue (an event),
// so collectives overlap the caller's later kernels; a handle completes once the link's stream is done.
//
// NCCL is opened at the first link (dlopen of libnccl.so.2, else the library the build found), as cuBLAS is: a
// process that never communicates GPU memory never loads it. The CUDA emulator's build links the emulator's NCCL
// (src/cuda_emulator/nccl.cpp), which carries the bytes between processes over Unix sockets.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace tessera::parallel {

// A link over `host`'s ranks. Collective over them: rank 0 makes NCCL's unique id and `host` broadcasts it. Each rank
// uses its thread's current CUDA device (core/device.h: use_cuda_device), and so does the link. Throws in a build
// without the CUDA backend.
std::unique_ptr<DeviceLink> make_nccl_link(Comm& host);

}  // namespace tessera::parallel
