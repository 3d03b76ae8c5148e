// Dense matrix multiply on the CPU, row-major: C[M,N] = alpha * op(A) · op(B) + beta * C.
// f32 runs on oneDNN's sgemm; f64 is a plain reference loop (tests and finite differences).
//
// NOTES: we cut C into a grid of blocks that depends only on (M, N, K) (gemm_grid) and call the
// single-threaded sgemm on each block; threads take blocks. Every element then gets the same
// reduction order whatever the thread count (oneDNN's kernels round a row differently for a different
// block height, so the blocks must not follow the thread count), and results are bitwise identical on
// 1 or N threads, on every ISA (tests/ops/test_gemm.cpp). Inside an OpenMP parallel region the call
// runs the same blocks on the calling thread. oneDNN 2.x's sgemm takes one packing
// buffer per call from posix_memalign (it has no entry point taking caller memory); that is the only
// heap use of a training step (tests/model/test_no_alloc.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/mxfp4.h"

namespace tessera::ops {

enum class Trans : uint8_t { N, T };

// op(A) is [M, K]: A is [M, K] with row stride lda when ta == N, [K, M] when ta == T (likewise B).
void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          float alpha,
          const float* A,
          int64_t lda,
          const float* B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc);
void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          double alpha,
          const double* A,
          int64_t lda,
          const double* B,
          int64_t ldb,
          double beta,
          double* C,
          int64_t ldc);

// The f32 product with B a frozen weight held narrow, laid out as a float B would be: bf16 (a frozen base,
// model.lora.base_dtype) or MXFP4 (frozen routed experts, model.lora.expert_dtype; core/mxfp4.h, B a position in
// its blocks, ldb in values). gemm widens each block's panel of B (its columns of op(B), all of K) to f32 just
// before that block's sgemm call, so the product equals, bit for bit, gemm() on the widened f32 weight, and the
// weight is read once per block row instead of being copied whole. ta must be N. The panel goes to a per-thread
// buffer outside any arena, as large as the largest panel the thread has seen (block_n × K floats; grown on first
// use only).
void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          float alpha,
          const float* A,
          int64_t lda,
          const bf16* B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc);
void gemm(Trans ta,
          Trans tb,
          int64_t M,
          int64_t N,
          int64_t K,
          float alpha,
          const float* A,
          int64_t lda,
          Mxfp4 B,
          int64_t ldb,
          float beta,
          float* C,
          int64_t ldc);

// The blocks of C that gemm() computes one sgemm call each: rows × cols blocks of block_m × block_n
// (the last ones cut short), a function of the shape (and of whether A is transposed) only.
struct GemmGrid {
    int64_t block_m = 0, block_n = 0, rows = 0, cols = 0;
};
GemmGrid gemm_grid(Trans ta, int64_t M, int64_t N, int64_t K);

// Bytes of the per-thread buffer of the products whose operands go through copies with padded strides (on oneDNN's
// AVX2 kernels: weight gradients, op(A) = Aᵀ, and B untransposed at a stride of a multiple of 512), outside any
// arena: allocated on a thread's first such product, one fixed size, never grown.
size_t gemm_copy_buffer_bytes();

// The same product computed by oneDNN's own threaded sgemm: the bench's reference point.
void gemm_onednn_reference(Trans ta,
                           Trans tb,
                           int64_t M,
                           int64_t N,
                           int64_t K,
                           float alpha,
                           const float* A,
                           int64_t lda,
                           const float* B,
                           int64_t ldb,
                           float beta,
                           float* C,
                           int64_t ldc);

// The precision of the f32 GEMMs (train.precision; process-wide, both devices): f32 (the default; on CUDA without
// TF32), or bf16: each operand rounded to nearest even (core/dtype.h's float_to_bf16), the products (exact in f32)
// summed in f32. On CUDA that is cuBLAS's GemmEx family on the tensor cores (CUBLAS_COMPUTE_32F). On the CPU each
// block's operands are converted to bf16 as they are copied for oneDNN's AMX GEMM where oneDNN runs AMX kernels
// (3.9-6x its f32 sgemm per core), and elsewhere rounded in f32 copies for sgemm (slower than f32 there): the same
// arithmetic up to the sums' order (and AMX's flushing of values below 2^-126 to zero). f64 GEMMs are always f64.
// The scope sets it for its lifetime and restores the previous value.
enum class GemmPrecision : uint8_t { f32, bf16 };
// How this CPU computes GemmPrecision::bf16, for the trainer's start line: "oneDNN's AMX kernels", or "sgemm on
// operands rounded to bf16, slower than f32 here" where oneDNN has no AMX kernels (or the library lacks the GEMM).
const char* cpu_bf16_gemm();
GemmPrecision gemm_precision();
class GemmPrecisionScope {
  public:
    explicit GemmPrecisionScope(GemmPrecision p);
    ~GemmPrecisionScope();
    GemmPrecisionScope(const GemmPrecisionScope&) = delete;
    GemmPrecisionScope& operator=(const GemmPrecisionScope&) = delete;

  private:
    GemmPrecision previous_;
};

// The machine's practical f32 GEMM rate (GFLOP/s): the best of repeated n×n×n products through
// gemm() over at least `seconds`. The reference point for MFU and benchmark ratios (measured, not a
// datasheet peak; the best run, so a busy neighbour does not lower the roofline).
double measure_gemm_gflops(int64_t n = 1024, double seconds = 0.25);

}  // namespace tessera::ops
