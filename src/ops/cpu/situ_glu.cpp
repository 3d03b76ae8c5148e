// SiTU-GLU forward/backward on the CPU (elementwise; row loops in glu_math.h).
#include "ops/situ_glu.h"

#include "ops/backend.h"
#include "ops/cpu/glu_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y) {
    note_op_use("situ_glu");
    cpu_only("situ_glu", {gate, up, y});
    cpu::dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        cpu::glu_forward<T>(cpu::SituGlu<T>(p.beta, p.linear_beta), "situ_glu", gate, up, y);
    });
}

void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    cpu_only("situ_glu", {dy, gate, up, dgate, dup});
    cpu::dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        cpu::glu_backward<T>(cpu::SituGlu<T>(p.beta, p.linear_beta), "situ_glu", dy, gate, up, dgate, dup);
    });
}

}  // namespace tessera::ops
