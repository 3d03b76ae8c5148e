// SwiGLU forward/backward on the CPU (elementwise; row loops in glu_math.h).
#include "ops/swiglu.h"

#include "ops/cpu/glu_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

void swiglu_forward(TensorView gate, TensorView up, TensorView y) {
    note_op_use("swiglu");
    cpu::dispatch_float(gate.dtype, "swiglu",
                        [&]<class T>(T) { cpu::glu_forward<T>(cpu::SwiGlu<T>{}, "swiglu", gate, up, y); });
}

void swiglu_backward(TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    cpu::dispatch_float(gate.dtype, "swiglu", [&]<class T>(T) {
        cpu::glu_backward<T>(cpu::SwiGlu<T>{}, "swiglu", dy, gate, up, dgate, dup);
    });
}

}  // namespace tessera::ops
