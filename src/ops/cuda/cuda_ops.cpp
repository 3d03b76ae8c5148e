// The CUDA backend's op entry points: argument checks and error messages around the launchers.
#include "ops/cuda/cuda_ops.h"

#include <cmath>

#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

bool device_available() {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v) {
    const AdamWScalars s{.decay = float(1.0 - p.lr * p.weight_decay),
                         .one_minus_beta1 = float(1.0 - p.beta1),
                         .beta2 = float(p.beta2),
                         .one_minus_beta2 = float(1.0 - p.beta2),
                         .step_size = float(p.lr / (1.0 - std::pow(p.beta1, double(p.step)))),
                         .bias_correction2_sqrt = float(std::sqrt(1.0 - std::pow(p.beta2, double(p.step)))),
                         .eps = float(p.eps)};
    const cudaError_t err = launch_adamw(param.ptr<float>(), grad.ptr<float>(), m.ptr<float>(), v.ptr<float>(),
                                         param.numel(), s, /*stream=*/nullptr);
    TESSERA_CHECK(err == cudaSuccess, "adamw (CUDA): launch failed: {}", cudaGetErrorString(err));
}

}  // namespace tessera::ops::cuda
