// NCCL as the CUDA emulator provides it (src/cuda_emulator/nccl.cpp): the part of NCCL's API that tessera's device
// link uses (parallel/nccl_link.cpp), between processes on one machine. Each pair of ranks talks over a Unix socket;
// a group's transfers run when it ends, as NCCL's do on their stream. Buffers must be device memory, as NCCL's.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 0
#define NCCL_UNIQUE_ID_BYTES 128

struct ncclComm;
using ncclComm_t = ncclComm*;
struct ncclUniqueId {
    char internal[NCCL_UNIQUE_ID_BYTES];
};

enum ncclResult_t {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
};

enum ncclDataType_t {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
};

const char* ncclGetErrorString(ncclResult_t result);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclBroadcast(
    const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm, cudaStream_t s);
