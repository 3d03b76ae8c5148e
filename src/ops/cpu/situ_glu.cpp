// SiTU-GLU forward/backward: the entry points (CUDA tensors to ops/cuda) and the CPU's (row loops in glu_math.h).
#include "ops/situ_glu.h"

#include "ops/backend.h"
#include "ops/cpu/glu_math.h"
#include "ops/op_use.h"

namespace tessera::ops {

void situ_glu_forward(const SituParams& p, TensorView gate, TensorView up, TensorView y) {
    note_op_use("situ_glu");
    if (op_device("situ_glu", {gate, up, y}) == Device::cuda) {
        cpu::check_like_gate("situ_glu", gate, {{"up", up}, {"y", y}});
        return TESSERA_ON_CUDA(situ_glu_forward(p, gate, up, y));
    }
    cpu::dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        cpu::glu_forward<T>(cpu::SituGlu<T>(p.beta, p.linear_beta), "situ_glu", gate, up, y);
    });
}

void situ_glu_backward(
    const SituParams& p, TensorView dy, TensorView gate, TensorView up, TensorView dgate, TensorView dup) {
    if (op_device("situ_glu", {dy, gate, up, dgate, dup}) == Device::cuda) {
        cpu::check_like_gate("situ_glu", gate, {{"up", up}, {"dy", dy}, {"dgate", dgate}, {"dup", dup}});
        return TESSERA_ON_CUDA(situ_glu_backward(p, dy, gate, up, dgate, dup));
    }
    cpu::dispatch_float(gate.dtype, "situ_glu", [&]<class T>(T) {
        cpu::glu_backward<T>(cpu::SituGlu<T>(p.beta, p.linear_beta), "situ_glu", dy, gate, up, dgate, dup);
    });
}

}  // namespace tessera::ops
