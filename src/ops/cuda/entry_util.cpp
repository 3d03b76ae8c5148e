// The CUDA entry points' per-thread scratch and cuBLAS handle (ops/cuda/entry_util.h).
#include "ops/cuda/entry_util.h"

#include <climits>

namespace tessera::ops::cuda {

void* scratch(size_t bytes) {
    struct Buffer {
        void* p = nullptr;
        size_t size = 0;
        ~Buffer() { device_free(Device::cuda, p); }
    };
    thread_local Buffer b;
    if (b.size < bytes) {
        device_free(Device::cuda, b.p);
        b.p = nullptr;
        b.size = 0;
        b.p = device_alloc(Device::cuda, bytes);
        b.size = bytes;
    }
    return b.p;
}

cublasHandle_t blas() {
    struct Handle {
        cublasHandle_t h = nullptr;
        ~Handle() {
            if (h) cublasDestroy(h);
        }
    };
    thread_local Handle handle;
    if (!handle.h) {
        const cublasStatus_t st = cublasCreate(&handle.h);
        TESSERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS: cannot create a handle (status {})", int(st));
    }
    cublasSetStream(handle.h, stream());
    return handle.h;
}

int blas_int(int64_t v, const char* what) {
    TESSERA_CHECK(v <= INT_MAX, "cuBLAS: {} = {} exceeds its 32-bit sizes", what, v);
    return int(v);
}

}  // namespace tessera::ops::cuda
