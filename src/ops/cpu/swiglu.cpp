// SwiGLU forward/backward: the entry points (CUDA tensors to ops/cuda) and the CPU's (row loops in glu_math.h).
#include "ops/swiglu.h"

#include "ops/backend.h"
#include "ops/cpu/glu_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

void swiglu_forward(TensorView gate, TensorView up, TensorView y) {
    note_op_use("swiglu");
    if (op_device("swiglu", {gate, up, y}) == Device::cuda) {
        cpu::check_like_gate("swiglu", gate, {{"up", up}, {"y", y}});
        return TESSERA_ON_CUDA(swiglu_forward(gate, up, y));
    }
    cpu::dispatch_float(gate.dtype, "swiglu",
                        [&]<class T>(T) { cpu::glu_forward<T>(cpu::SwiGlu<T>{}, "swiglu", gate, up, y); });
}

void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    if (op_device("swiglu", {dy, gate, up, dgate, dup}) == Device::cuda) {
        cpu::check_like_gate("swiglu", gate, {{"up", up}, {"dy", dy}, {"dgate", dgate}, {"dup", dup}});
        return TESSERA_ON_CUDA(swiglu_backward(dy, gate, up, dgate, dup));
    }
    cpu::dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        cpu::glu_backward<T>(cpu::SwiGlu<T>{}, "swiglu", dy, gate, up, dgate, dup);
    });
}

}  // namespace tessera::ops
