// The one dispatch point of every op: each public entry point (the functions the op headers declare)
// checks that its tensors share one device and sends the call to that device's implementation —
// the CPU kernels in ops/cpu/ (the oracle) or the CUDA backend in ops/cuda/ (entry points in
// ops/cuda/cuda_ops.h). The argument checks before the dispatch are shared by both backends.
//
//   void rmsnorm_forward(const RmsNormParams& p, TensorView x, ...) {
//       ... shape and dtype checks ...
//       if (op_device("rmsnorm", {x, w, y, rstd}) == Device::cuda) return TESSERA_ON_CUDA(rmsnorm_forward(p, x, ...));
//       ... the CPU kernel ...
//   }
//
// An op without a CUDA implementation yet calls cpu_only(...) instead, so CUDA tensors get a clear error rather
// than a host loop over device pointers. Work goes to the calling thread's current stream (core/device.h).
#pragma once

#include <initializer_list>
#include <string_view>

#include "core/tensor.h"

namespace tessera::ops {

// The device of an op's defined tensors (absent views are skipped; none defined: the CPU). Throws when they differ.
Device op_device(std::string_view op, std::initializer_list<TensorView> tensors);

// For an op the CUDA backend does not implement yet: throws when its tensors are on a CUDA device.
void cpu_only(std::string_view op, std::initializer_list<TensorView> tensors);

// The error for CUDA tensors in a build without the CUDA backend.
[[noreturn]] void no_cuda_backend(std::string_view call);

// Device memory the CUDA backend holds outside the arena now: its threads' grow-only buffers (kernel scratch, GEMM
// operand pointers, bf16 operand copies; ops/cuda/entry_util.h). 0 in a CPU run. note_cuda_scratch adds to it.
size_t cuda_scratch_bytes();
void note_cuda_scratch(int64_t delta_bytes);

}  // namespace tessera::ops

// Without the backend the call fails; the neutral call after the comma is never reached (no_cuda_backend throws)
// and is there only so the expression has the op's return type.
#if TESSERA_WITH_CUDA
#include "ops/cuda/cuda_ops.h"
#define TESSERA_ON_CUDA(call) ::tessera::ops::cuda::call
#else
#define TESSERA_ON_CUDA(call) (::tessera::ops::no_cuda_backend(#call), ::tessera::ops::call)
#endif
