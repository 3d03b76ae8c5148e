// The CUDA entry points' per-thread scratch, cuBLAS handle and GEMMs (ops/cuda/entry_util.h).
#include "ops/cuda/entry_util.h"

#include "core/dynamic_library.h"

#include <climits>
#include <string>
#include <type_traits>

namespace tessera::ops::cuda {

namespace {
// cuBLAS, opened at the first GEMM instead of linked: its libraries (libcublas and libcublasLt, ~600 MB of code)
// loaded at start cost every process of a CUDA build ~200 MB of resident memory, CPU runs included (docs/ops.md).
struct CublasApi {
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSgemm_v2) sgemm;
    decltype(&cublasDgemm_v2) dgemm;
    decltype(&cublasSgemmStridedBatched) sgemm_strided;
    decltype(&cublasDgemmStridedBatched) dgemm_strided;
    decltype(&cublasSgemmGroupedBatched) sgemm_grouped;
    decltype(&cublasDgemmGroupedBatched) dgemm_grouped;
};

const CublasApi& cublas() {
#if TESSERA_CUDA_EMULATOR  // the emulator's cuBLAS (src/cuda_emulator/cublas.cpp), linked
    static const CublasApi api{
        &cublasCreate_v2,          &cublasDestroy_v2,          &cublasSetStream_v2,        &cublasSgemm_v2,
        &cublasDgemm_v2,           &cublasSgemmStridedBatched, &cublasDgemmStridedBatched, &cublasSgemmGroupedBatched,
        &cublasDgemmGroupedBatched};
#else
    static const CublasApi api = [] {
        // the soname the headers belong to, through the loader's search (the executable's run path, the cache), else
        // the file the build linked against
        const DynamicLibrary lib("libcublas.so." + std::to_string(CUBLAS_VER_MAJOR), TESSERA_CUBLAS_LIBRARY, "cuBLAS");
        CublasApi a{};
        lib.bind(a.create, "cublasCreate_v2");
        lib.bind(a.destroy, "cublasDestroy_v2");
        lib.bind(a.set_stream, "cublasSetStream_v2");
        lib.bind(a.sgemm, "cublasSgemm_v2");
        lib.bind(a.dgemm, "cublasDgemm_v2");
        lib.bind(a.sgemm_strided, "cublasSgemmStridedBatched");
        lib.bind(a.dgemm_strided, "cublasDgemmStridedBatched");
        lib.bind(a.sgemm_grouped, "cublasSgemmGroupedBatched");
        lib.bind(a.dgemm_grouped, "cublasDgemmGroupedBatched");
        return a;
    }();
#endif
    return api;
}
}  // namespace

void load_cublas() { cublas(); }

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

size_t max_shared_memory() {
    int dev = 0, bytes = 0;
    check_launch(cudaGetDevice(&dev), "cudaGetDevice");
    check_launch(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                 "cudaDeviceGetAttribute");
    return size_t(bytes);
}

cublasHandle_t blas() {
    struct Handle {
        cublasHandle_t h = nullptr;
        ~Handle() {
            if (h) cublas().destroy(h);
        }
    };
    thread_local Handle handle;
    if (!handle.h) {
        const cublasStatus_t st = cublas().create(&handle.h);
        TESSERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS: cannot create a handle (status {})", int(st));
    }
    cublas().set_stream(handle.h, stream());
    return handle.h;
}

int blas_int(int64_t v, const char* what) {
    TESSERA_CHECK(v <= INT_MAX, "cuBLAS: {} = {} exceeds its 32-bit sizes", what, v);
    return int(v);
}

template <class T>
void gemm(bool ta,
          bool tb,
          int64_t m,
          int64_t n,
          int64_t k,
          T alpha,
          const T* a,
          int64_t lda,
          const T* b,
          int64_t ldb,
          T beta,
          T* c,
          int64_t ldc,
          Batch batch) {
    const cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int M = blas_int(m, "m"), N = blas_int(n, "n"), K = blas_int(k, "k");
    const int LA = blas_int(lda, "lda"), LB = blas_int(ldb, "ldb"), LC = blas_int(ldc, "ldc");
    const int count = blas_int(batch.count, "batch");
    cublasStatus_t st;
    if constexpr (std::is_same_v<T, float>) {
        st = count == 1 ? cublas().sgemm(blas(), oa, ob, M, N, K, &alpha, a, LA, b, LB, &beta, c, LC)
                        : cublas().sgemm_strided(blas(), oa, ob, M, N, K, &alpha, a, LA, batch.a, b, LB, batch.b, &beta,
                                                 c, LC, batch.c, count);
    } else {
        st = count == 1 ? cublas().dgemm(blas(), oa, ob, M, N, K, &alpha, a, LA, b, LB, &beta, c, LC)
                        : cublas().dgemm_strided(blas(), oa, ob, M, N, K, &alpha, a, LA, batch.a, b, LB, batch.b, &beta,
                                                 c, LC, batch.c, count);
    }
    TESSERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS GEMM {}x{}x{} (batch {}) failed (status {})", m, n, k, count,
                  int(st));
}

template void gemm<float>(bool,
                          bool,
                          int64_t,
                          int64_t,
                          int64_t,
                          float,
                          const float*,
                          int64_t,
                          const float*,
                          int64_t,
                          float,
                          float*,
                          int64_t,
                          Batch);
template void gemm<double>(bool,
                           bool,
                           int64_t,
                           int64_t,
                           int64_t,
                           double,
                           const double*,
                           int64_t,
                           const double*,
                           int64_t,
                           double,
                           double*,
                           int64_t,
                           Batch);

template <class T>
void GemmGroup<T>::add_rows(Trans ta,
                            Trans tb,
                            int64_t M,
                            int64_t N,
                            int64_t K,
                            T alpha,
                            const T* a,
                            int64_t lda,
                            const T* b,
                            int64_t ldb,
                            T beta,
                            T* c,
                            int64_t ldc) {
    if (M == 0 || N == 0) return;
    // row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B first (gemm_rows' mapping)
    ta_.push_back(tb == Trans::T ? CUBLAS_OP_T : CUBLAS_OP_N);
    tb_.push_back(ta == Trans::T ? CUBLAS_OP_T : CUBLAS_OP_N);
    m_.push_back(blas_int(N, "n"));
    n_.push_back(blas_int(M, "m"));
    k_.push_back(blas_int(K, "k"));
    lda_.push_back(blas_int(ldb, "ldb"));
    ldb_.push_back(blas_int(lda, "lda"));
    ldc_.push_back(blas_int(ldc, "ldc"));
    size_.push_back(1);
    alpha_.push_back(alpha);
    beta_.push_back(beta);
    a_.push_back(b);
    b_.push_back(a);
    c_.push_back(c);
}

template <class T>
void GemmGroup<T>::run() {
    const int count = int(size_.size());
    if (count > 0) {
        const size_t bytes = sizeof(void*) * size_t(count);
        if (pointer_bytes_ < 3 * bytes) {
            device_free(Device::cuda, pointers_);
            pointers_ = nullptr;
            pointer_bytes_ = 0;
            pointers_ = device_alloc(Device::cuda, 3 * bytes);
            pointer_bytes_ = 3 * bytes;
        }
        auto* base = static_cast<std::byte*>(pointers_);
        const T* const* A = upload(base, std::span<const T* const>(a_));
        const T* const* B = upload(base + bytes, std::span<const T* const>(b_));
        T* const* C = upload(base + 2 * bytes, std::span<T* const>(c_));
        cublasStatus_t st;
        if constexpr (std::is_same_v<T, float>) {
            st = cublas().sgemm_grouped(blas(), ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
                                        A, lda_.data(), B, ldb_.data(), beta_.data(), C, ldc_.data(), count,
                                        size_.data());
        } else {
            st = cublas().dgemm_grouped(blas(), ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
                                        A, lda_.data(), B, ldb_.data(), beta_.data(), C, ldc_.data(), count,
                                        size_.data());
        }
        TESSERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS grouped GEMM of {} problems failed (status {})", count,
                      int(st));
    }
    for (auto* v : {&m_, &n_, &k_, &lda_, &ldb_, &ldc_, &size_}) v->clear();
    ta_.clear();
    tb_.clear();
    alpha_.clear();
    beta_.clear();
    a_.clear();
    b_.clear();
    c_.clear();
}

template <class T>
GemmGroup<T>::~GemmGroup() {
    device_free(Device::cuda, pointers_);
}

void widen_to_f32(const TensorView& w, int64_t first, int64_t n, float* dst, const char* what) {
    TESSERA_CHECK(w.data != nullptr && !w.slices, "{}: a {} weight must be one contiguous device tensor", what,
                  dtype_name(w.dtype));
    if (w.dtype == DType::bf16) {
        check_launch(launch_widen_bf16(static_cast<const uint16_t*>(w.data) + first, n, dst, stream()), what);
    } else {
        TESSERA_CHECK(w.dtype == DType::mxfp4, "{}: weights in {} are not widened (bf16, mxfp4)", what,
                      dtype_name(w.dtype));
        check_launch(launch_widen_mxfp4(static_cast<const uint8_t*>(w.data), first, n, dst, stream()), what);
    }
}

template class GemmGroup<float>;
template class GemmGroup<double>;

}  // namespace tessera::ops::cuda
