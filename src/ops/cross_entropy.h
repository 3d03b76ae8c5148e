// Cross-entropy of logits against integer targets, mean over the rows whose target is not ignored.
// Shapes: logits, dlogits [N, V] (row-strided allowed); targets [N] (i32 or i64; ignore_index marks
// rows that do not count); lse [N] (log-sum-exp per row, written by forward, read by backward).
// Each row is streamed once with an online max/sum: no [N, V] softmax is ever materialised.
// Backward accumulates dlogits += dloss / count · (softmax(logits) − onehot(target)) on counted rows.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

struct CrossEntropyParams {
    int64_t ignore_index = -100;
};

struct CrossEntropyResult {
    double loss = 0.0;  // mean over counted rows (0 when none count)
    double sum = 0.0;   // sum over counted rows
    int64_t count = 0;  // rows that count
};

CrossEntropyResult cross_entropy_forward(const CrossEntropyParams& p,
                                         TensorView logits,
                                         TensorView targets,
                                         TensorView lse);
// dloss: gradient of the mean loss returned by forward for these rows
void cross_entropy_backward(const CrossEntropyParams& p,
                            double dloss,
                            TensorView logits,
                            TensorView targets,
                            TensorView lse,
                            TensorView dlogits);

}  // namespace tessera::ops
