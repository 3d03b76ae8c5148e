// The CUDA emulator's cuBLAS (include/cublas_v2.h): column-major GEMMs, C = alpha·op(A)·op(B) + beta·C, each output's
// sum in k order in the element type; C is not read where beta is 0, as cuBLAS defines.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "cuda_emulator/emulator.h"

using tessera::cuda_emulator::DeviceScope;
using tessera::cuda_emulator::is_device_pointer;

struct cublasContext {};

namespace {

// An operand's element in the compute type T: itself, or a bf16 (its bits) widened exactly.
template <class T>
T value(T x) {
    return x;
}
inline float value(uint16_t bf16) {
    uint32_t u = uint32_t(bf16) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// op(A) and op(B) packed column by column (column l of op(A) and column j of op(B) contiguous, in the compute type T),
// then C in tiles of 64 rows × 4 columns held in a small accumulator, each output's sum over l in order: a fixed order
// per output, with the inner loop over contiguous rows so the compiler vectorises it.
template <class T, class In = T>
cublasStatus_t gemm(cublasOperation_t ta,
                    cublasOperation_t tb,
                    int m,
                    int n,
                    int k,
                    T alpha,
                    const In* a,
                    int lda,
                    const In* b,
                    int ldb,
                    T beta,
                    T* c,
                    int ldc) {
    if (m < 0 || n < 0 || k < 0 || ldc < (m > 1 ? m : 1)) return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    if (!is_device_pointer(c) || (k > 0 && (!is_device_pointer(a) || !is_device_pointer(b))))
        return CUBLAS_STATUS_INVALID_VALUE;  // a host pointer handed to the GPU
    const bool at = ta == CUBLAS_OP_T, bt = tb == CUBLAS_OP_T;
    std::vector<T> pa(size_t(m) * size_t(k)), pb(size_t(k) * size_t(n));
    for (int l = 0; l < k; ++l)
        for (int i = 0; i < m; ++i)
            pa[size_t(l) * m + i] = value(at ? a[l + int64_t(i) * lda] : a[i + int64_t(l) * lda]);
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < k; ++l)
            pb[size_t(j) * k + l] = value(bt ? b[j + int64_t(l) * ldb] : b[l + int64_t(j) * ldb]);
    constexpr int kRows = 64, kCols = 4;
    for (int j0 = 0; j0 < n; j0 += kCols) {
        const int nc = std::min(kCols, n - j0);
        for (int i0 = 0; i0 < m; i0 += kRows) {
            const int nr = std::min(kRows, m - i0);
            T acc[kCols][kRows] = {};
            for (int l = 0; l < k; ++l) {
                const T* col = pa.data() + size_t(l) * m + i0;
                for (int jj = 0; jj < nc; ++jj) {
                    const T y = pb[size_t(j0 + jj) * k + l];
                    for (int ii = 0; ii < nr; ++ii) acc[jj][ii] += col[ii] * y;
                }
            }
            for (int jj = 0; jj < nc; ++jj) {
                T* out = c + int64_t(j0 + jj) * ldc + i0;
                for (int ii = 0; ii < nr; ++ii)
                    out[ii] = beta == T(0) ? alpha * acc[jj][ii] : alpha * acc[jj][ii] + beta * out[ii];
            }
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

template <class T>
cublasStatus_t strided(cublasOperation_t ta,
                       cublasOperation_t tb,
                       int m,
                       int n,
                       int k,
                       const T* alpha,
                       const T* a,
                       int lda,
                       long long sa,
                       const T* b,
                       int ldb,
                       long long sb,
                       const T* beta,
                       T* c,
                       int ldc,
                       long long sc,
                       int batch) {
    DeviceScope work;
    for (int i = 0; i < batch; ++i) {
        const cublasStatus_t st =
            gemm(ta, tb, m, n, k, *alpha, a + i * sa, lda, b + i * sb, ldb, *beta, c + i * sc, ldc);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

template <class T>
cublasStatus_t grouped(const cublasOperation_t* ta,
                       const cublasOperation_t* tb,
                       const int* m,
                       const int* n,
                       const int* k,
                       const T* alpha,
                       const T* const a[],
                       const int* lda,
                       const T* const b[],
                       const int* ldb,
                       const T* beta,
                       T* const c[],
                       const int* ldc,
                       int groups,
                       const int* size) {
    DeviceScope work;
    if (!is_device_pointer(a) || !is_device_pointer(b) || !is_device_pointer(c)) return CUBLAS_STATUS_INVALID_VALUE;
    int64_t p = 0;  // the problem's index in the pointer arrays
    for (int g = 0; g < groups; ++g) {
        for (int i = 0; i < size[g]; ++i, ++p) {
            const cublasStatus_t st =
                gemm(ta[g], tb[g], m[g], n[g], k[g], alpha[g], a[p], lda[g], b[p], ldb[g], beta[g], c[p], ldc[g]);
            if (st != CUBLAS_STATUS_SUCCESS) return st;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

// The GemmEx types the emulator computes: bf16 A and B, f32 C, f32 compute
bool bf16_f32(cudaDataType a, cudaDataType b, cudaDataType c, cublasComputeType_t compute) {
    return a == CUDA_R_16BF && b == CUDA_R_16BF && c == CUDA_R_32F && compute == CUBLAS_COMPUTE_32F;
}

}  // namespace

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    *handle = new cublasContext;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasSgemm_v2(cublasHandle_t,
                              cublasOperation_t ta,
                              cublasOperation_t tb,
                              int m,
                              int n,
                              int k,
                              const float* alpha,
                              const float* a,
                              int lda,
                              const float* b,
                              int ldb,
                              const float* beta,
                              float* c,
                              int ldc) {
    return strided(ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t,
                              cublasOperation_t ta,
                              cublasOperation_t tb,
                              int m,
                              int n,
                              int k,
                              const double* alpha,
                              const double* a,
                              int lda,
                              const double* b,
                              int ldb,
                              const double* beta,
                              double* c,
                              int ldc) {
    return strided(ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t,
                                         cublasOperation_t ta,
                                         cublasOperation_t tb,
                                         int m,
                                         int n,
                                         int k,
                                         const float* alpha,
                                         const float* a,
                                         int lda,
                                         long long sa,
                                         const float* b,
                                         int ldb,
                                         long long sb,
                                         const float* beta,
                                         float* c,
                                         int ldc,
                                         long long sc,
                                         int batch) {
    return strided(ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t,
                                         cublasOperation_t ta,
                                         cublasOperation_t tb,
                                         int m,
                                         int n,
                                         int k,
                                         const double* alpha,
                                         const double* a,
                                         int lda,
                                         long long sa,
                                         const double* b,
                                         int ldb,
                                         long long sb,
                                         const double* beta,
                                         double* c,
                                         int ldc,
                                         long long sc,
                                         int batch) {
    return strided(ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch);
}

cublasStatus_t cublasSgemmGroupedBatched(cublasHandle_t,
                                         const cublasOperation_t* ta,
                                         const cublasOperation_t* tb,
                                         const int* m,
                                         const int* n,
                                         const int* k,
                                         const float* alpha,
                                         const float* const a[],
                                         const int* lda,
                                         const float* const b[],
                                         const int* ldb,
                                         const float* beta,
                                         float* const c[],
                                         const int* ldc,
                                         int groups,
                                         const int* size) {
    return grouped(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, groups, size);
}

cublasStatus_t cublasDgemmGroupedBatched(cublasHandle_t,
                                         const cublasOperation_t* ta,
                                         const cublasOperation_t* tb,
                                         const int* m,
                                         const int* n,
                                         const int* k,
                                         const double* alpha,
                                         const double* const a[],
                                         const int* lda,
                                         const double* const b[],
                                         const int* ldb,
                                         const double* beta,
                                         double* const c[],
                                         const int* ldc,
                                         int groups,
                                         const int* size) {
    return grouped(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, groups, size);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t,
                                          cublasOperation_t ta,
                                          cublasOperation_t tb,
                                          int m,
                                          int n,
                                          int k,
                                          const void* alpha,
                                          const void* a,
                                          cudaDataType a_type,
                                          int lda,
                                          long long sa,
                                          const void* b,
                                          cudaDataType b_type,
                                          int ldb,
                                          long long sb,
                                          const void* beta,
                                          void* c,
                                          cudaDataType c_type,
                                          int ldc,
                                          long long sc,
                                          int batch,
                                          cublasComputeType_t compute,
                                          cublasGemmAlgo_t) {
    if (!bf16_f32(a_type, b_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
    DeviceScope work;
    const auto *A = static_cast<const uint16_t*>(a), *B = static_cast<const uint16_t*>(b);
    auto* C = static_cast<float*>(c);
    const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    for (int i = 0; i < batch; ++i) {
        const cublasStatus_t st =
            gemm<float, uint16_t>(ta, tb, m, n, k, al, A + i * sa, lda, B + i * sb, ldb, be, C + i * sc, ldc);
        if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t,
                                          const cublasOperation_t* ta,
                                          const cublasOperation_t* tb,
                                          const int* m,
                                          const int* n,
                                          const int* k,
                                          const void* alpha,
                                          const void* const a[],
                                          cudaDataType_t a_type,
                                          const int* lda,
                                          const void* const b[],
                                          cudaDataType_t b_type,
                                          const int* ldb,
                                          const void* beta,
                                          void* const c[],
                                          cudaDataType_t c_type,
                                          const int* ldc,
                                          int groups,
                                          const int* size,
                                          cublasComputeType_t compute) {
    // TESSERA_CUDA_EMULATOR_GROUPED_EX=0: as a cuBLAS whose grouped GEMM lacks these types (the caller's fallback)
    const char* grouped = std::getenv("TESSERA_CUDA_EMULATOR_GROUPED_EX");
    if (!bf16_f32(a_type, b_type, c_type, compute) || (grouped && std::string_view(grouped) == "0"))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    DeviceScope work;
    if (!is_device_pointer(a) || !is_device_pointer(b) || !is_device_pointer(c)) return CUBLAS_STATUS_INVALID_VALUE;
    const auto *al = static_cast<const float*>(alpha), *be = static_cast<const float*>(beta);
    int64_t p = 0;  // the problem's index in the pointer arrays
    for (int g = 0; g < groups; ++g) {
        for (int i = 0; i < size[g]; ++i, ++p) {
            const cublasStatus_t st = gemm<float, uint16_t>(
                ta[g], tb[g], m[g], n[g], k[g], al[g], static_cast<const uint16_t*>(a[p]), lda[g],
                static_cast<const uint16_t*>(b[p]), ldb[g], be[g], static_cast<float*>(c[p]), ldc[g]);
            if (st != CUBLAS_STATUS_SUCCESS) return st;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}
