// cuBLAS as the CUDA emulator provides it (src/cuda_emulator): the GEMMs tessera's CUDA backend calls
// (ops/cuda/entry_util.cpp), column-major as cuBLAS defines them, computed on the host in the element type, each
// output's sum in k order. The strided and grouped GemmEx take bf16 A and B with f32 C and CUBLAS_COMPUTE_32F only (the
// products of bf16 values are exact in f32; each sum in k order in f32); other type combinations are not supported, nor
// are any by the grouped one under TESSERA_CUDA_EMULATOR_GROUPED_EX=0 (a cuBLAS without them: the caller's fallback).
#pragma once

#include <cuda_runtime.h>

#define CUBLAS_VER_MAJOR 13

struct cublasContext;
using cublasHandle_t = cublasContext*;

enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
// (library_types.h and cublas_api.h's values)
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16BF = 14 };
using cudaDataType = cudaDataType_t;
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle);
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream);

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
                              int ldc);
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
                              int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t,
                                         cublasOperation_t ta,
                                         cublasOperation_t tb,
                                         int m,
                                         int n,
                                         int k,
                                         const float* alpha,
                                         const float* a,
                                         int lda,
                                         long long stride_a,
                                         const float* b,
                                         int ldb,
                                         long long stride_b,
                                         const float* beta,
                                         float* c,
                                         int ldc,
                                         long long stride_c,
                                         int batch);
cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t,
                                         cublasOperation_t ta,
                                         cublasOperation_t tb,
                                         int m,
                                         int n,
                                         int k,
                                         const double* alpha,
                                         const double* a,
                                         int lda,
                                         long long stride_a,
                                         const double* b,
                                         int ldb,
                                         long long stride_b,
                                         const double* beta,
                                         double* c,
                                         int ldc,
                                         long long stride_c,
                                         int batch);
// The pointer arrays a, b, c are in device memory; the others on the host.
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
                                         int group_count,
                                         const int* group_size);
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
                                         int group_count,
                                         const int* group_size);
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
                                          long long stride_a,
                                          const void* b,
                                          cudaDataType b_type,
                                          int ldb,
                                          long long stride_b,
                                          const void* beta,
                                          void* c,
                                          cudaDataType c_type,
                                          int ldc,
                                          long long stride_c,
                                          int batch,
                                          cublasComputeType_t compute,
                                          cublasGemmAlgo_t algo);
// The pointer arrays a, b, c are in device memory; the others (alpha and beta in the compute type) on the host.
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
                                          int group_count,
                                          const int* group_size,
                                          cublasComputeType_t compute);
