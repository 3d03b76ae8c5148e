// The CUDA entry points' per-thread scratch, cuBLAS handle and GEMMs (ops/cuda/entry_util.h).
#include "ops/cuda/entry_util.h"

#include "core/dynamic_library.h"
#include "ops/backend.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

namespace tessera::ops::cuda {

namespace {
// The strided GemmEx's C signature (the headers add a C++ overload of the name, so decltype cannot name it); it also
// runs the single bf16 products (batch 1)
using GemmStridedExFn = cublasStatus_t (*)(cublasHandle_t,
                                           cublasOperation_t,
                                           cublasOperation_t,
                                           int,
                                           int,
                                           int,
                                           const void*,
                                           const void*,
                                           cudaDataType,
                                           int,
                                           long long,
                                           const void*,
                                           cudaDataType,
                                           int,
                                           long long,
                                           const void*,
                                           void*,
                                           cudaDataType,
                                           int,
                                           long long,
                                           int,
                                           cublasComputeType_t,
                                           cublasGemmAlgo_t);

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
    GemmStridedExFn gemm_strided_ex;
    decltype(&cublasGemmGroupedBatchedEx) gemm_grouped_ex;
};

const CublasApi& cublas() {
#if TESSERA_CUDA_EMULATOR  // the emulator's cuBLAS (src/cuda_emulator/cublas.cpp), linked
    static const CublasApi api{&cublasCreate_v2,
                               &cublasDestroy_v2,
                               &cublasSetStream_v2,
                               &cublasSgemm_v2,
                               &cublasDgemm_v2,
                               &cublasSgemmStridedBatched,
                               &cublasDgemmStridedBatched,
                               &cublasSgemmGroupedBatched,
                               &cublasDgemmGroupedBatched,
                               &cublasGemmStridedBatchedEx,
                               &cublasGemmGroupedBatchedEx};
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
        lib.bind(a.gemm_strided_ex, "cublasGemmStridedBatchedEx");
        lib.bind(a.gemm_grouped_ex, "cublasGemmGroupedBatchedEx");
        return a;
    }();
#endif
    return api;
}

// A column-major operand op(X) [r, c], stored [r, c] or (trans) [c, r]: its contiguous runs and their length; its
// bf16 copy's leading dimension (the length padded to 8 values, 16 bytes) and extent (padded to 128 values, 256 bytes),
// so every copy starts and every run of it is aligned as cuBLAS's tensor-core kernels want.
struct Runs {
    int64_t cols, len, ld, extent;
};
Runs runs_of(bool trans, int64_t r, int64_t c) {
    const int64_t cols = trans ? r : c, len = trans ? c : r, ld = (std::max<int64_t>(1, len) + 7) / 8 * 8;
    return {cols, len, ld, (cols * ld + 127) / 128 * 128};
}

// The bf16 copies of one GEMM call's f32 operands (GemmPrecision::bf16): the pieces are queued, then one launch rounds
// them all into the calling thread's grow-only buffer (the pieces' table first, then their values), reserved whole
// before anything is written, so one call's copies never move. Not the thread's scratch: the operands may live there.
class Bf16Operands {
  public:
    // Queues the runs of src (apart by ld); returns the copy's offset in the values (consecutive copies are
    // consecutive extents).
    int64_t add(const float* src, const Runs& r, int64_t ld) {
        const int64_t at = values_;
        pieces_.push_back({src, reinterpret_cast<uint16_t*>(at), r.cols, r.len, ld, r.ld});
        values_ += r.extent;
        largest_ = std::max(largest_, r.cols * r.len);
        return at;
    }
    // Rounds the queued pieces on the current stream and empties the queue; returns where the offsets start.
    const uint16_t* round() {
        const size_t table = scratch_part(pieces_.size() * sizeof(Bf16Piece));
        void* buffer = buffer_.reserve(table + 2 * size_t(values_));
        auto* values = reinterpret_cast<uint16_t*>(static_cast<std::byte*>(buffer) + table);
        for (Bf16Piece& p : pieces_) p.dst = values + reinterpret_cast<intptr_t>(p.dst);
        const Bf16Piece* t = upload(buffer, std::span<const Bf16Piece>(pieces_));
        check_launch(launch_round_bf16(t, int64_t(pieces_.size()), largest_, stream()), "GEMM operands to bf16");
        pieces_.clear();
        values_ = largest_ = 0;
        return values;
    }

  private:
    std::vector<Bf16Piece> pieces_;
    int64_t values_ = 0, largest_ = 0;
    GrowBuffer buffer_;
};
Bf16Operands& bf16_operands() {
    thread_local Bf16Operands o;
    return o;
}
}  // namespace

void load_cublas() { cublas(); }

void* GrowBuffer::reserve(size_t bytes) {
    if (size_ < bytes) {
        device_free(Device::cuda, p_);
        note_cuda_scratch(-int64_t(size_));
        p_ = nullptr;
        size_ = 0;
        p_ = device_alloc(Device::cuda, bytes);
        size_ = bytes;
        note_cuda_scratch(int64_t(size_));
    }
    return p_;
}

GrowBuffer::~GrowBuffer() {
    device_free(Device::cuda, p_);
    note_cuda_scratch(-int64_t(size_));
}

void* scratch(size_t bytes) {
    thread_local GrowBuffer b;
    return b.reserve(bytes);
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
        if (gemm_precision() == GemmPrecision::bf16)  // each operand rounded (packed), summed in f32
            return gemm_bf16(ta, tb, m, n, k, alpha, a, DType::f32, lda, b, DType::f32, ldb, beta, c, ldc, batch);
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
               Batch batch) {
    TESSERA_CHECK(gemm_precision() == GemmPrecision::bf16, "a bf16 GEMM operand outside GemmPrecision::bf16");
    const int M = blas_int(m, "m"), N = blas_int(n, "n"), K = blas_int(k, "k"), LC = blas_int(ldc, "ldc");
    const int count = blas_int(batch.count, "batch");
    // an operand's bf16 values: in place (from), or its batch's copies at `at` of the rounded values; ld, stride
    struct Operand {
        const uint16_t* from;
        int64_t at, ld, stride;
    };
    Bf16Operands& copies = bf16_operands();
    auto take = [&](const void* x, DType type, bool trans, int64_t r, int64_t cols, int64_t ld, int64_t stride) {
        if (type == DType::bf16) return Operand{static_cast<const uint16_t*>(x), 0, ld, stride};
        TESSERA_CHECK(type == DType::f32, "a bf16 GEMM takes f32 or bf16 operands, not {}", dtype_name(type));
        const Runs runs = runs_of(trans, r, cols);
        const auto* f = static_cast<const float*>(x);
        int64_t at = 0;
        for (int i = 0; i < count; ++i) {  // operand i's copy at at + i·extent
            const int64_t o = copies.add(f + i * stride, runs, ld);
            if (i == 0) at = o;
        }
        return Operand{nullptr, at, runs.ld, runs.extent};
    };
    const Operand A = take(a, a_type, ta, m, k, lda, batch.a), B = take(b, b_type, tb, k, n, ldb, batch.b);
    const uint16_t* values = copies.round();
    const uint16_t *A16 = A.from ? A.from : values + A.at, *B16 = B.from ? B.from : values + B.at;
    const cublasStatus_t st = cublas().gemm_strided_ex(
        blas(), ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, M, N, K, &alpha, A16, CUDA_R_16BF,
        blas_int(A.ld, "lda"), A.stride, B16, CUDA_R_16BF, blas_int(B.ld, "ldb"), B.stride, &beta, c, CUDA_R_32F, LC,
        batch.c, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    TESSERA_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS bf16 GEMM {}x{}x{} (batch {}) failed (status {})", m, n, k,
                  count, int(st));
}

template <class T>
void GemmGroup<T>::add_rows(Trans ta,
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
                            DType b_type,
                            DType a_type) {
    if (M == 0 || N == 0) return;
    for (const DType t : {a_type, b_type})
        TESSERA_CHECK(t == dtype_of<T>() || (t == DType::bf16 && gemm_precision() == GemmPrecision::bf16),
                      "a grouped GEMM takes {} operands (bf16 ones at GemmPrecision::bf16), not {}",
                      dtype_name(dtype_of<T>()), dtype_name(t));
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
    a_bf16_.push_back(b_type == DType::bf16);
    b_bf16_.push_back(a_type == DType::bf16);
    b_.push_back(a);
    c_.push_back(c);
}

template <class T>
void GemmGroup<T>::run() {
    const int count = int(size_.size());
    if (count > 0) {
        const size_t bytes = sizeof(void*) * size_t(count);
        auto* base = static_cast<std::byte*>(pointers_.reserve(3 * bytes));
        T* const* C = upload(base + 2 * bytes, std::span<T* const>(c_));
        cublasStatus_t st;
        if constexpr (std::is_same_v<T, float>) {
            if (gemm_precision() == GemmPrecision::bf16) {  // each problem's operands rounded, summed in f32
                Bf16Operands& copies = bf16_operands();
                std::vector<int64_t>& at = offsets_;
                at.clear();
                for (int p = 0; p < count; ++p) {  // a bf16 operand (a narrow weight, rounded rows) stays in place: −1
                    const Runs ra = runs_of(ta_[p] == CUBLAS_OP_T, m_[p], k_[p]),
                               rb = runs_of(tb_[p] == CUBLAS_OP_T, k_[p], n_[p]);
                    at.push_back(a_bf16_[size_t(p)] ? -1 : copies.add(static_cast<const float*>(a_[p]), ra, lda_[p]));
                    at.push_back(b_bf16_[size_t(p)] ? -1 : copies.add(static_cast<const float*>(b_[p]), rb, ldb_[p]));
                    if (!a_bf16_[size_t(p)]) lda_[p] = blas_int(ra.ld, "lda");
                    if (!b_bf16_[size_t(p)]) ldb_[p] = blas_int(rb.ld, "ldb");
                }
                const uint16_t* values = copies.round();
                std::vector<const void*>& ptrs = bf16_ptrs_;
                ptrs.clear();
                for (int p = 0; p < count; ++p) {
                    const int64_t o = at[size_t(2 * p)];
                    ptrs.push_back(o < 0 ? a_[size_t(p)] : values + o);
                }
                for (int p = 0; p < count; ++p) {
                    const int64_t o = at[size_t(2 * p + 1)];
                    ptrs.push_back(o < 0 ? b_[size_t(p)] : values + o);
                }
                const void* const* A = upload(base, std::span<const void* const>(ptrs.data(), size_t(count)));
                const void* const* B =
                    upload(base + bytes, std::span<const void* const>(ptrs.data() + count, size_t(count)));
                st = cublas().gemm_grouped_ex(blas(), ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(),
                                              alpha_.data(), A, CUDA_R_16BF, lda_.data(), B, CUDA_R_16BF, ldb_.data(),
                                              beta_.data(), reinterpret_cast<void* const*>(C), CUDA_R_32F, ldc_.data(),
                                              count, size_.data(), CUBLAS_COMPUTE_32F);
                // a cuBLAS whose grouped GEMM lacks bf16 inputs with f32 output: one GemmEx per problem (the same
                // products, more launches)
                if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
                    st = CUBLAS_STATUS_SUCCESS;
                    for (int p = 0; p < count && st == CUBLAS_STATUS_SUCCESS; ++p)
                        st = cublas().gemm_strided_ex(blas(), ta_[p], tb_[p], m_[p], n_[p], k_[p], &alpha_[p],
                                                      ptrs[size_t(p)], CUDA_R_16BF, lda_[p], 0, ptrs[size_t(count + p)],
                                                      CUDA_R_16BF, ldb_[p], 0, &beta_[p], c_[p], CUDA_R_32F, ldc_[p], 0,
                                                      1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                }
            } else {
                const auto* A = reinterpret_cast<const T* const*>(upload(base, std::span<const void* const>(a_)));
                const auto* B =
                    reinterpret_cast<const T* const*>(upload(base + bytes, std::span<const void* const>(b_)));
                st = cublas().sgemm_grouped(blas(), ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(),
                                            alpha_.data(), A, lda_.data(), B, ldb_.data(), beta_.data(), C, ldc_.data(),
                                            count, size_.data());
            }
        } else {
            const auto* A = reinterpret_cast<const T* const*>(upload(base, std::span<const void* const>(a_)));
            const auto* B = reinterpret_cast<const T* const*>(upload(base + bytes, std::span<const void* const>(b_)));
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
    a_bf16_.clear();
    b_bf16_.clear();
    b_.clear();
    c_.clear();
}

const void* held_weight(const TensorView& w, const char* what) {
    TESSERA_CHECK(w.data != nullptr && !w.slices, "{}: a {} weight must be one contiguous device tensor", what,
                  dtype_name(w.dtype));
    return w.data;
}

void widen(const TensorView& w, int64_t first, int64_t n, DType to, void* dst, const char* what) {
    held_weight(w, what);
    TESSERA_CHECK(to == DType::f32 || (to == DType::bf16 && w.dtype == DType::mxfp4),
                  "{}: {} weights are not widened to {}", what, dtype_name(w.dtype), dtype_name(to));
    if (w.dtype == DType::bf16) {
        check_launch(
            launch_widen_bf16(static_cast<const uint16_t*>(w.data) + first, n, static_cast<float*>(dst), stream()),
            what);
    } else {
        TESSERA_CHECK(w.dtype == DType::mxfp4, "{}: weights in {} are not widened (bf16, mxfp4)", what,
                      dtype_name(w.dtype));
        check_launch(
            launch_widen_mxfp4(static_cast<const uint8_t*>(w.data), first, n, to == DType::bf16, dst, stream()), what);
    }
}

template class GemmGroup<float>;
template class GemmGroup<double>;

}  // namespace tessera::ops::cuda
