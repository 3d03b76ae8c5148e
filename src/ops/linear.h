// Linear layer: y = x · wᵀ + b. Shapes: x [N, IN], w [OUT, IN], b [OUT] (optional), y [N, OUT].
// x, y, dx and dy may be row-strided 2-D views (last dim contiguous), e.g. column blocks of a
// fused buffer. Backward accumulates into dx, dw and db; an absent (undefined) dx, dw or db is skipped (dw:
// a frozen weight, whose gradient is never computed). w may be bf16 with f32 x and y (a frozen base kept in bf16,
// model.lora.base_dtype): the GEMMs widen it block by block (ops/gemm.h, the bf16 B overload), bitwise as its f32
// values would.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct LinearParams {
    bool accumulate = false;  // y += x · wᵀ (+ b) instead of overwriting y
};

void linear_forward(const LinearParams& p, TensorView x, TensorView w, TensorView b, TensorView y);
void linear_backward(TensorView dy, TensorView x, TensorView w, TensorView dx, TensorView dw, TensorView db);

// FLOPs of forward and backward (for throughput and MFU): 2·N·IN·OUT and 4·N·IN·OUT.
inline double linear_forward_flops(int64_t n, int64_t in, int64_t out) { return 2.0 * n * in * out; }

// The device's f32 GEMM rate in GFLOP/s, measured now: the best of five n × n × n linear_forward calls on it (the
// denominator of "MFU" for a run on a GPU; the CPU's is ops::measure_gemm_gflops). n doubles from 512 until a call
// takes 20 ms or n reaches max_n: a GPU reaches its rate only on large products, and a slow device (the CUDA
// emulator) is not held for minutes.
double measure_linear_gflops(Device device, int64_t max_n = 4096);

}  // namespace tessera::ops
