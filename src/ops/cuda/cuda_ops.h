// The CUDA backend's entry points (built with -DTESSERA_CUDA=ON). Ops dispatch here when their
// tensors live on Device::cuda; the CPU implementations in ops/cpu/ are the oracle they are
// tested against. Launches go to the current device's default stream.
#pragma once

#include "ops/adamw.h"

namespace tessera::ops::cuda {

bool device_available();
void adamw_update(const AdamWParams& p, TensorView param, TensorView grad, TensorView m, TensorView v);

}  // namespace tessera::ops::cuda
