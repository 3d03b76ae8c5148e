// Device checks of the op dispatch (ops/backend.h).
#include "ops/backend.h"

namespace tessera::ops {

Device op_device(std::string_view op, std::initializer_list<TensorView> tensors) {
    bool seen = false;
    Device d = Device::cpu;
    for (const TensorView& t : tensors) {
        if (!t.defined()) continue;
        if (!seen) {
            d = t.device;
            seen = true;
        }
        TESSERA_CHECK(t.device == d, "{}: tensors on different devices (CPU and CUDA); copy them to one device first",
                      op);
    }
    return d;
}

void cpu_only(std::string_view op, std::initializer_list<TensorView> tensors) {
    TESSERA_CHECK(op_device(op, tensors) == Device::cpu,
                  "{}: the CUDA backend has no implementation of this op yet (its tensors are on a CUDA device)", op);
}

void no_cuda_backend(std::string_view call) {
    TESSERA_FAIL(
        "{}: tensors are on a CUDA device but this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)",
        call.substr(0, call.find('(')));
}

}  // namespace tessera::ops
