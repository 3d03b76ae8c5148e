// One element of a tensor of any dtype as a double (float dtypes widened, integers cast, FP8 and MXFP4 decoded): for
// comparisons against references (ops/verify.h, the tests), not for hot loops.
#pragma once

#include "core/tensor.h"

namespace tessera {

double element_as_double(const TensorView& t, int64_t i);

}  // namespace tessera
