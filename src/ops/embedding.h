// Embedding lookup: y[n] = table[ids[n]]. Shapes: ids [N] (i32 or i64), table [V, D], y [N, D].
// Backward accumulates dtable[ids[n]] += dy[n], in token order (deterministic).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

void embedding_forward(TensorView ids, TensorView table, TensorView y);
void embedding_backward(TensorView dy, TensorView ids, TensorView dtable);

}  // namespace tessera::ops
