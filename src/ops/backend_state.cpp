// Process-wide settings and counters both backends read (ops/gemm.h: the GEMMs' precision; ops/backend.h: the CUDA
// backend's scratch outside the arena). In tessera_ops_math, below both backends.
#include <algorithm>
#include <atomic>

#include "ops/backend.h"
#include "ops/gemm.h"

namespace tessera::ops {

namespace {
std::atomic<GemmPrecision> precision{GemmPrecision::f32};
std::atomic<int64_t> scratch_bytes{0};
}  // namespace

GemmPrecision gemm_precision() { return precision.load(std::memory_order_relaxed); }
GemmPrecisionScope::GemmPrecisionScope(GemmPrecision p) : previous_(precision.exchange(p)) {}
GemmPrecisionScope::~GemmPrecisionScope() { precision.store(previous_); }

size_t cuda_scratch_bytes() { return size_t(std::max<int64_t>(0, scratch_bytes.load(std::memory_order_relaxed))); }
void note_cuda_scratch(int64_t delta_bytes) { scratch_bytes.fetch_add(delta_bytes, std::memory_order_relaxed); }

}  // namespace tessera::ops
