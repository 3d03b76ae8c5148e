// Incremental decoding's attention over the per-sequence caches (one new query per sequence and step), on either
// device: the attention blocks' step() (model/layers) calls these with their cache views.
//
// cached_attention: for each sequence b and head h, reading kv head h / (H / HKV),
//   o[b, h] = Σ_s softmax_s(scale·q[b, h]·keys[b, s, kvh])·values[b, s, kvh]
// over the positions s of rows[b] (ascending, −1 entries skipped) or, without rows, every s < len. Scores, softmax
// and sums in double. q [B, H, D], keys [B, L, HKV, D], values [B, L, HKV, DV], o [B, H, DV]: f32 views with the
// last dim contiguous (any other strides: heads of a fused projection row, the cache's rows); rows [B, n] i32
// contiguous. MLA's MQA mode passes its entry cache as both keys and values (HKV = 1, the values the first DV dims).
//
// cached_index_topk: DSA's lightning indexer for one query per sequence over the cached index keys,
//   I[s] = Σ_j w[b, j]·relu(q[b, j]·keys[b, s]) for s < len (f32, summed over j, each dot over d, in order),
// and rows[b] = the min(topk, len) best s under the selection's total order (ops/dsa.h: dsa_ranks_before), in
// ascending s, padded with −1; topk = rows.size(1). q [B, HI, DI], w [B, HI], keys [B, L, DI] (last dims
// contiguous), rows [B, topk] i32 contiguous.
#pragma once

#include "core/tensor.h"

namespace tessera::ops {

void cached_attention(
    double scale, TensorView q, TensorView keys, TensorView values, TensorView rows, int64_t len, TensorView o);

void cached_index_topk(TensorView q, TensorView w, TensorView keys, int64_t len, TensorView rows);

}  // namespace tessera::ops
