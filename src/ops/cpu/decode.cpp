// Decoding's cached attention and indexer selection (ops/decode.h): the entry points (checks, then CUDA tensors to
// ops/cuda) and the CPU loops, a sequence per thread.
#include "ops/decode.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/backend.h"
#include "ops/dsa.h"

namespace tessera::ops {

namespace {
// An f32 view of `dims` dims whose last dim is contiguous.
void check_view(const TensorView& t, int64_t dims, const char* what) {
    TESSERA_CHECK(t.dtype == DType::f32 && t.shape.ndim == dims && t.strides[size_t(dims - 1)] == 1,
                  "{}: an f32 [{}-dim] view with its last dim contiguous, not {} {}", what, dims, dtype_name(t.dtype),
                  t.shape.str());
}
}  // namespace

void cached_attention(
    double scale, TensorView q, TensorView keys, TensorView values, TensorView rows, int64_t len, TensorView o) {
    check_view(q, 3, "cached_attention: q");
    check_view(keys, 4, "cached_attention: keys");
    check_view(values, 4, "cached_attention: values");
    check_view(o, 3, "cached_attention: o");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), L = keys.size(1), HKV = keys.size(2), DV = o.size(2);
    TESSERA_CHECK(keys.size(0) == B && keys.size(3) == D && values.size(0) == B && values.size(1) == L &&
                      values.size(2) == HKV && values.size(3) == DV && o.size(0) == B && o.size(1) == H && HKV > 0 &&
                      H % HKV == 0 && len >= 1 && len <= L,
                  "cached_attention: q {}, keys {}, values {}, o {}, len {} do not fit", q.shape.str(),
                  keys.shape.str(), values.shape.str(), o.shape.str(), len);
    TESSERA_CHECK(!rows.defined() ||
                      (rows.dtype == DType::i32 && rows.shape.ndim == 2 && rows.size(0) == B && rows.is_contiguous()),
                  "cached_attention: rows must be contiguous i32 [{}, n]", B);
    if (op_device("cached_attention", {q, keys, values, rows, o}) == Device::cuda)
        return TESSERA_ON_CUDA(cached_attention(scale, q, keys, values, rows, len, o));
    const int64_t n = rows.defined() ? rows.size(1) : len;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        std::vector<int64_t> at;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t s = rows.defined() ? rows.ptr<int32_t>()[b * n + i] : i;
            if (s >= 0 && s < len) at.push_back(s);
        }
        std::vector<double> z(at.size());
        for (int64_t h = 0; h < H; ++h) {
            const int64_t kvh = h / (H / HKV);
            const float* qh = q.ptr<float>() + b * q.strides[0] + h * q.strides[1];
            double m = -INFINITY;
            for (size_t i = 0; i < at.size(); ++i) {
                const float* k =
                    keys.ptr<float>() + b * keys.strides[0] + at[i] * keys.strides[1] + kvh * keys.strides[2];
                double dot = 0;
                for (int64_t d = 0; d < D; ++d) dot += double(qh[d]) * double(k[d]);
                z[i] = dot * scale;
                m = std::max(m, z[i]);
            }
            double sum = 0;
            for (double& x : z) sum += (x = std::exp(x - m));
            float* oh = o.ptr<float>() + b * o.strides[0] + h * o.strides[1];
            for (int64_t e = 0; e < DV; ++e) {
                double acc = 0;
                for (size_t i = 0; i < at.size(); ++i)
                    acc += z[i] * double(values.ptr<float>()[b * values.strides[0] + at[i] * values.strides[1] +
                                                             kvh * values.strides[2] + e]);
                oh[e] = at.empty() ? 0.f : float(acc / sum);
            }
        }
    }
}

void cached_index_topk(TensorView q, TensorView w, TensorView keys, int64_t len, TensorView rows) {
    check_view(q, 3, "cached_index_topk: q");
    check_view(w, 2, "cached_index_topk: w");
    check_view(keys, 3, "cached_index_topk: keys");
    const int64_t B = q.size(0), HI = q.size(1), DI = q.size(2), L = keys.size(1);
    TESSERA_CHECK(w.size(0) == B && w.size(1) == HI && keys.size(0) == B && keys.size(2) == DI && len >= 1 &&
                      len <= L && rows.dtype == DType::i32 && rows.shape.ndim == 2 && rows.size(0) == B &&
                      rows.size(1) >= 1 && rows.is_contiguous(),
                  "cached_index_topk: q {}, w {}, keys {}, rows {}, len {} do not fit", q.shape.str(), w.shape.str(),
                  keys.shape.str(), rows.shape.str(), len);
    if (op_device("cached_index_topk", {q, w, keys, rows}) == Device::cuda)
        return TESSERA_ON_CUDA(cached_index_topk(q, w, keys, len, rows));
    const int64_t K = rows.size(1);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        const float* qb = q.ptr<float>() + b * q.strides[0];
        const float* wb = w.ptr<float>() + b * w.strides[0];
        std::vector<std::pair<float, int64_t>> scored;
        for (int64_t s = 0; s < len; ++s) {
            const float* k = keys.ptr<float>() + b * keys.strides[0] + s * keys.strides[1];
            float I = 0;
            for (int64_t j = 0; j < HI; ++j) {
                float dot = 0;
                for (int64_t d = 0; d < DI; ++d) dot += qb[j * q.strides[1] + d] * k[d];
                I += wb[j * w.strides[1]] * std::max(dot, 0.f);
            }
            scored.push_back({I, s});
        }
        const int64_t n = std::min(K, len);
        std::partial_sort(scored.begin(), scored.begin() + n, scored.end(), [](const auto& u, const auto& v) {
            return dsa_ranks_before(u.first, u.second, v.first, v.second);
        });
        scored.resize(size_t(n));
        std::sort(scored.begin(), scored.end(), [](const auto& u, const auto& v) { return u.second < v.second; });
        int32_t* out = rows.ptr<int32_t>() + b * K;
        for (int64_t i = 0; i < K; ++i) out[i] = i < n ? int32_t(scored[size_t(i)].second) : -1;
    }
}

}  // namespace tessera::ops
