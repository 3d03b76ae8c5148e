// Embedding lookup: y[n] = table[ids[n]]. Shapes: ids [N] (i32 or i64), table [V, D], y [N, D]. A bf16 table (a
// frozen base kept in bf16) with an f32 y is widened row by row.
// Backward accumulates dtable[ids[n]] += dy[n], in token order (deterministic).
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

void embedding_forward(TensorView ids, TensorView table, TensorView y);
void embedding_backward(TensorView dy, TensorView ids, TensorView dtable);

}  // namespace tessera::ops
