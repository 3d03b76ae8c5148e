// Helpers shared by the CPU kernels (dtype dispatch and row views come from ops/views.h, which the CUDA
// backend's entry points share). Internal to ops/cpu; the public op headers take TensorViews only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

#include "core/mxfp4.h"
#include "core/tensor.h"
#include "ops/views.h"

namespace tessera::ops::cpu {

using ops::check_index_dtype;
using ops::dispatch_float;
using ops::Rows;
using ops::rows_of;

// dst[i] = src[i] rounded to bf16 (to nearest even) and widened back: exactly what a bf16 GEMM multiplies. dst may be
// src.
inline void round_to_bf16(const float* src, int64_t n, float* dst) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(float_to_bf16(src[i]));
}

// Calls f(const T*) with a weight's data in T, or, for a weight held narrow in an f32 op, f(const bf16*) (a frozen
// base kept in bf16) or f(Mxfp4) (frozen routed experts held in MXFP4): ops::gemm and grouped_gemm widen those. A
// narrow weight in an f64 op (the reference paths) is an error.
template <class T, class F>
void with_weight(const TensorView& w, std::string_view op, F&& f) {
    if (w.dtype == DType::bf16 || w.dtype == DType::mxfp4) {
        if constexpr (std::is_same_v<T, float>) {
            if (w.dtype == DType::bf16) {
                f(w.ptr<bf16>());
            } else {
                f(Mxfp4{static_cast<const uint8_t*>(w.data)});
            }
            return;
        }
        TESSERA_FAIL("{}: a {} weight {} in an f64 product (f64 runs on f32 weights)", op, dtype_name(w.dtype),
                     w.shape.str());
    }
    f(w.ptr<T>());
}

// Reads element i of an integer tensor (i32 or i64) as int64.
inline int64_t load_index(const TensorView& ids, int64_t i) {
    return ids.dtype == DType::i32 ? int64_t(static_cast<const int32_t*>(ids.data)[i])
                                   : static_cast<const int64_t*>(ids.data)[i];
}

// The sequences of a step: each of the B rows of length T, or (B = 1) the variable-length sequences
// packed in the row by cu_seqlens (sequence s is tokens [cu[s], cu[s+1])). Validated on creation.
struct Segments {
    int64_t B = 0, T = 0;
    std::span<const int64_t> cu;

    Segments(int64_t batch, int64_t time, std::span<const int64_t> cu_seqlens, std::string_view what)
        : B(batch), T(time), cu(cu_seqlens) {
        if (cu.empty()) return;
        TESSERA_CHECK(B == 1, "{}: cu_seqlens needs B = 1 (sequences packed in one row), not B = {}", what, B);
        TESSERA_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == T,
                      "{}: cu_seqlens must start at 0 and end at T = {}", what, T);
        for (size_t s = 1; s < cu.size(); ++s) {
            TESSERA_CHECK(cu[s] > cu[s - 1], "{}: cu_seqlens must increase strictly (entry {})", what, s);
        }
    }
    int64_t count() const { return cu.empty() ? B : int64_t(cu.size()) - 1; }
    int64_t batch(int64_t s) const { return cu.empty() ? s : 0; }
    int64_t start(int64_t s) const { return cu.empty() ? 0 : cu[size_t(s)]; }  // within its batch row
    int64_t length(int64_t s) const { return cu.empty() ? T : cu[size_t(s) + 1] - cu[size_t(s)]; }
    int64_t first_token(int64_t s) const { return batch(s) * T + start(s); }  // in the flattened B·T axis
    // the start (within its batch row) of the sequence holding position t
    int64_t first_of(int64_t /*b*/, int64_t t) const {
        if (cu.empty()) return 0;
        return *(std::upper_bound(cu.begin(), cu.end(), t) - 1);
    }
};

// Workspace carving: successive 64-byte aligned slices of a byte span. A measuring cursor (no span)
// hands out null pointers and only counts, so one carving function gives both an op's layout and its
// `<op>_workspace_bytes`: the size and the use cannot disagree.
class WorkspaceCursor {
  public:
    explicit WorkspaceCursor(std::span<std::byte> ws) : ws_(ws) {}
    static WorkspaceCursor measuring() {
        WorkspaceCursor c({});
        c.measuring_ = true;
        return c;
    }
    template <class T>
    T* take(size_t count) {
        return static_cast<T*>(static_cast<void*>(take_bytes(count * sizeof(T))));
    }
    std::byte* take_bytes(size_t n) {
        const size_t bytes = (n + 63) / 64 * 64;
        if (measuring_) {
            used_ += bytes;
            return nullptr;
        }
        TESSERA_CHECK(used_ + bytes <= ws_.size(), "workspace of {} bytes is too small (need more than {})", ws_.size(),
                      used_ + bytes);
        std::byte* p = ws_.data() + used_;
        used_ += bytes;
        return p;
    }
    size_t used() const { return used_; }

  private:
    std::span<std::byte> ws_;
    size_t used_ = 0;
    bool measuring_ = false;
};

// Bytes of a scratch layout: `carve(cursor)` takes its slices from a measuring cursor.
template <class Carve>
size_t measure_scratch(Carve&& carve) {
    WorkspaceCursor c = WorkspaceCursor::measuring();
    carve(c);
    return c.used();
}

// A workspace split into a shared head of `shared` bytes and one slice of `per_thread` bytes per thread
// (for parallel regions of `threads` threads); checks that the span holds them all.
struct ThreadSlices {
    std::span<std::byte> ws;
    size_t shared = 0, per_thread = 0;
    ThreadSlices(std::span<std::byte> w, size_t shared_bytes, size_t per_thread_bytes, int threads, const char* op)
        : ws(w), shared(shared_bytes), per_thread(per_thread_bytes) {
        TESSERA_CHECK(ws.size() >= shared + per_thread * size_t(threads),
                      "{}: workspace of {} bytes < {} needed for {} threads (see its _workspace_bytes)", op, ws.size(),
                      shared + per_thread * size_t(threads), threads);
    }
    std::span<std::byte> head() const { return ws.first(shared); }
    std::span<std::byte> thread(int tid) const { return ws.subspan(shared + per_thread * size_t(tid), per_thread); }
};

}  // namespace tessera::ops::cpu
