// Helpers of the CUDA backend's entry points (ops/cuda/*.cpp): the current stream, launch checks, row views as
// launcher arguments, a per-thread device scratch, the per-thread cuBLAS handle and its GEMMs. Internal to ops/cuda.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/device.h"
#include "ops/cuda/launchers.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/views.h"

namespace tessera::ops::cuda {

inline cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream().handle); }

inline void check_launch(cudaError_t err, const char* op) {
    TESSERA_CHECK(err == cudaSuccess, "{} (CUDA): launch failed: {}", op, cudaGetErrorString(err));
}

template <class T>
RowsArg<T> arg(const Rows<T>& r) {
    return {r.data, r.rows, r.cols, r.ld};
}
template <class T>
RowsArg<const T> carg(const TensorView& v, const char* what) {
    const Rows<T> r = rows_of<T>(v, what);
    return {r.data, r.rows, r.cols, r.ld};
}
template <class T>
RowsArg<T> marg(const TensorView& v, const char* what) {
    return arg(rows_of<T>(v, what));
}

// A view's data, or null for an absent view (an optional gradient or bias).
template <class T>
T* ptr_or_null(const TensorView& t) {
    return t.defined() ? t.ptr<T>() : nullptr;
}
// A [B, T, H, D] view with D contiguous as a kernel argument.
template <class T>
HeadsArg<T> heads(const TensorView& x) {
    return {x.ptr<T>(), x.strides[0], x.strides[1], x.strides[2]};
}
template <class T>
HeadsArg<const T> cheads(const TensorView& x) {
    return {x.ptr<T>(), x.strides[0], x.strides[1], x.strides[2]};
}

// Device memory that only grows, so a step allocates nothing after its first call: at least `bytes` from reserve
// (earlier contents are lost when it grows). Counted in ops::cuda_scratch_bytes() (ops/backend.h), outside the arena.
class GrowBuffer {
  public:
    GrowBuffer() = default;
    GrowBuffer(const GrowBuffer&) = delete;
    GrowBuffer& operator=(const GrowBuffer&) = delete;
    ~GrowBuffer();
    void* reserve(size_t bytes);

  private:
    void* p_ = nullptr;
    size_t size_ = 0;
};

// The calling thread's device scratch (per-call buffers: loss partials, check flags, copied offsets, kernel
// workspaces: KDA's chunk slots, the backward scatters' slabs, widened experts). One buffer: a call's earlier pointer
// is invalid after a larger request.
void* scratch(size_t bytes);

// The parts of one scratch request start at multiples of 256 bytes.
inline size_t scratch_part(size_t bytes) { return (bytes + 255) / 256 * 256; }

// A frozen weight held narrow (bf16: model.lora.base_dtype; MXFP4: model.lora.expert_dtype) is widened to f32 for the
// f32 GEMMs in pieces of at most this many bytes of the thread's scratch (linear: row blocks; moe: windows of experts).
// At GemmPrecision::bf16 the GEMMs read a bf16 weight in place, and an MXFP4 one dequantized to bf16 in the same
// pieces (half the bytes).
constexpr int64_t kWidenBytes = int64_t(64) << 20;
// Values [first, first + n) of w (bf16 or MXFP4, contiguous on the device) widened exactly into dst: f32, or bf16 for
// MXFP4 (whose values bf16 holds exactly).
void widen(const TensorView& w, int64_t first, int64_t n, DType to, void* dst, const char* what);
// A weight held narrow as one contiguous device tensor (its values, widened or read in place), or a one-line error.
const void* held_weight(const TensorView& w, const char* what);

// Scratch for the row slabs of `terms` column sums over [rows, cols] (launchers.h: column_slab_elements).
template <class T>
T* column_slabs_scratch(int64_t rows, int64_t cols, int terms) {
    return static_cast<T*>(scratch(sizeof(T) * size_t(column_slab_elements(rows, cols, terms))));
}

// Host values copied into the calling thread's scratch, asynchronously on the current stream (the copy reads the
// host buffer before it returns, so the caller may reuse it). The scratch's one-buffer rule applies. upload copies
// into a given place of device memory (a part of one scratch request).
template <class T>
const T* upload(void* device, std::span<const T> host) {
    copy_bytes(device, Device::cuda, host.data(), Device::cpu, host.size_bytes());
    return static_cast<const T*>(device);
}
template <class T>
const T* to_scratch(std::span<const T> host) {
    return upload(scratch(host.size_bytes()), host);
}

// Device values copied back to the host, synchronising the current stream (a loss the call returns).
template <class T>
std::vector<T> download(const T* device, size_t n) {
    std::vector<T> host(n);
    copy_bytes(host.data(), Device::cpu, device, Device::cuda, n * sizeof(T));
    return host;
}

// The strides between the operands of a batch of GEMMs (in elements) and its size; one GEMM by default.
struct Batch {
    int64_t count = 1, a = 0, b = 0, c = 0;
};

// cuBLAS, column-major: C (m×n, ldc) = alpha·op(A)·op(B) + beta·C, for each of batch.count (A, B, C) apart by the
// batch's strides. T is float or double. Row-major products are written as their transposes (row-major Y = X·Wᵀ
// is column-major Yᵀ = W·Xᵀ); gemm_rows does that.
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
          Batch batch = {});
// gemm at GemmPrecision::bf16 with each operand f32 (rounded into a copy, as gemm<float> does at that precision) or
// bf16 already (a frozen weight held narrow, or one dequantized to bf16: read in place, its batch stride in bf16
// values). The same products as gemm<float> on the operands widened to f32, without the round trip.
void gemm_bf16(bool ta,
               bool tb,
               int64_t m,
               int64_t n,
               int64_t k,
               float alpha,
               const void* a,
               DType a_type,
               int64_t lda,
               const void* b,
               DType b_type,
               int64_t ldb,
               float beta,
               float* c,
               int64_t ldc,
               Batch batch = {});
// Row-major C [M, N] = alpha·op(A)·op(B) + beta·C with op(A) [M, K] and op(B) [K, N] (ops::gemm's form).
template <class T>
void gemm_rows(Trans ta,
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
    gemm<T>(tb == Trans::T, ta == Trans::T, N, M, K, alpha, b, ldb, a, lda, beta, c, ldc);
}

// GEMMs of different shapes in one cuBLAS grouped-batched call (cublas{S,D}gemmGroupedBatched, one problem per
// group), e.g. one per expert: the CUDA form of ops/grouped_gemm.h. Problems are added row-major as gemm_rows takes
// them; run() copies the operand pointers into the group's own grow-only device buffer (not the thread's scratch, so
// operands may live there: experts widened from a narrow dtype), launches on the current stream and empties the group.
template <class T>
class GemmGroup {
  public:
    void add_rows(Trans ta,
                  Trans tb,
                  int64_t M,
                  int64_t N,
                  int64_t K,
                  T alpha,
                  const void* a,
                  int64_t lda,
                  const void* b,
                  int64_t ldb,
                  T beta,
                  T* c,
                  int64_t ldc,
                  DType b_type = dtype_of<T>(),   // bf16: in place, at GemmPrecision::bf16 only (gemm_bf16)
                  DType a_type = dtype_of<T>());  // the same
    void run();

  private:
    GrowBuffer pointers_;           // the operand pointers
    std::vector<int64_t> offsets_;  // GemmPrecision::bf16: the operands' copies
    std::vector<const void*> bf16_ptrs_;
    std::vector<cublasOperation_t> ta_, tb_;
    std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
    std::vector<T> alpha_, beta_;
    std::vector<const void*> a_, b_;
    std::vector<uint8_t> a_bf16_, b_bf16_;  // per problem: a_ (the row-major B), b_ (A) is bf16, read in place
    std::vector<T*> c_;
};

// Row `row` of a row-major matrix of `type` values (ld apart) at x.
inline const void* row_at(const void* x, DType type, int64_t row, int64_t ld) {
    return static_cast<const std::byte*>(x) + dtype_bytes(type, row * ld);
}

// A GEMM operand: T values, or bf16 ones (a narrow weight, or values rounded already, read in place at
// GemmPrecision::bf16: activations rounded once for several products, ops/cuda/moe_ops.cpp and the linear's dy).
struct GroupOperand {
    template <class T>
    GroupOperand(const T* p) : data(p), type(dtype_of<T>()) {}  // NOLINT: T values as they are
    GroupOperand(const void* p, DType t) : data(p), type(t) {}
    GroupOperand at(int64_t elements) const { return {row_at(data, type, elements, 1), type}; }
    const void* data;
    DType type;
};

// The two grouped kinds of ops/grouped_gemm.h over experts' rows (offsets on the host), each one grouped-batched
// cuBLAS call: C[rows_e] = alpha·A[rows_e]·op(B_e) + beta·C (B_e = B + e·b_stride), and C_e += A[rows_e]ᵀ·B[rows_e]
// (C_e = C + e·c_stride; experts without rows are skipped).
// B's experts and the rows may be bf16 (in place at GemmPrecision::bf16).
template <class T>
void grouped_rows(Trans tb,
                  const ExpertRows& g,
                  int64_t N,
                  int64_t K,
                  T alpha,
                  GroupOperand A,
                  int64_t lda,
                  const void* B,
                  int64_t b_stride,
                  int64_t ldb,
                  T beta,
                  T* C,
                  int64_t ldc,
                  DType b_type = dtype_of<T>()) {
    thread_local GemmGroup<T> group;
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t o = g.offsets[e], n = g.offsets[e + 1] - o;
        group.add_rows(Trans::N, tb, n, N, K, alpha, row_at(A.data, A.type, o, lda), lda,
                       row_at(B, b_type, e, b_stride), ldb, beta, C + o * ldc, ldc, b_type, A.type);
    }
    group.run();
}
template <class T>
void grouped_wgrad(const ExpertRows& g,
                   int64_t M,
                   int64_t N,
                   GroupOperand A,
                   int64_t lda,
                   GroupOperand B,
                   int64_t ldb,
                   T* C,
                   int64_t c_stride,
                   int64_t ldc) {
    thread_local GemmGroup<T> group;
    for (int64_t e = 0; e < g.experts; ++e) {
        const int64_t o = g.offsets[e], n = g.offsets[e + 1] - o;
        if (n > 0)
            group.add_rows(Trans::T, Trans::N, M, N, n, T(1), row_at(A.data, A.type, o, lda), lda,
                           row_at(B.data, B.type, o, ldb), ldb, T(1), C + e * c_stride, ldc, B.type, A.type);
    }
    group.run();
}

// The most dynamic shared memory a block may opt in to on the current device.
size_t max_shared_memory();

// Opens cuBLAS and binds the entry points the backend uses, once per process; a one-line error when the library or
// one of them is missing. The first GEMM does it (blas()), so a process that runs no CUDA GEMM never maps cuBLAS.
void load_cublas();
// cuBLAS: one handle per thread, on the current stream. Default math mode: f32 GEMMs stay f32 (no TF32), so they
// compare with the CPU's at f32 tolerance.
cublasHandle_t blas();
// A size as cuBLAS's int, or a one-line error naming it.
int blas_int(int64_t v, const char* what);

}  // namespace tessera::ops::cuda
