// Helpers shared by blocks.
#include "model/layers/block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/rows.h"

namespace tessera::model {

double ParamInit::value(double u, double n) const {
    switch (kind) {
        case Kind::normal:
            return a * n;
        case Kind::constant:
            return a;
        case Kind::uniform:
            return a + (b - a) * u;
        case Kind::log_uniform:
            return std::log(a + (b - a) * u);
        case Kind::dt_inverse_softplus: {
            const double dt = std::max(1e-4, std::exp(std::log(a) + (std::log(b) - std::log(a)) * u));
            return dt + std::log(-std::expm1(-dt));
        }
    }
    return 0.0;
}

void add_param(std::vector<BufferSpec>& specs,
               std::vector<ParamInit>& inits,
               std::string name,
               Shape shape,
               ParamInit init,
               bool weight_decay) {
    // the decayed matrices are the GEMM weights (projections, experts, embedding, head), read through ops that take
    // bf16 too; a block whose op reads one otherwise clears narrowable
    specs.push_back({.name = std::move(name),
                     .dtype = DType::f32,
                     .shape = shape,
                     .kind = BufferKind::param,
                     .weight_decay = weight_decay,
                     .narrowable = weight_decay && shape.ndim >= 2});
    inits.push_back(init);
}

void Block::start_output(TensorView x_in, TensorView x_out, int64_t rows) const {
    TESSERA_CHECK(x_in.is_contiguous() && x_out.is_contiguous() && x_in.size(1) == x_out.size(1),
                  "block: mismatched residual buffers");
    if (!residual_) {
        ops::zero_rows(x_out, rows);
    } else if (x_in.data != x_out.data) {
        ops::copy_rows(x_in.slice0(0, rows), x_out.slice0(0, rows));
    }
}

void Block::start_input_grad(TensorView dres, int64_t rows) const {
    if (!residual_) ops::zero_rows(dres, rows);
}

TensorView heads_view(TensorView rows, StepShape s, int64_t col, int64_t heads, int64_t head_stride, int64_t width) {
    const int64_t row = rows.strides[0];
    TensorView v(static_cast<float*>(rows.data) + col, DType::f32, Shape{s.batch, s.seq, heads, width}, rows.device);
    v.strides = {s.seq * row, row, head_stride, 1};
    return v;
}

TensorView param_view(const BufferGroup& g, const std::string& name, bool grad) {
    return grad ? g.find(name) : g.view(name);
}

void fuse_last(std::vector<BufferSpec>& specs, size_t count) {
    TESSERA_CHECK(count >= 1 && count <= specs.size(), "fuse_last: {} of {} parameters", count, specs.size());
    for (size_t i = specs.size() - count; i + 1 < specs.size(); ++i) specs[i].fused_next = true;
}

TensorView adjacent(const std::vector<TensorView>& parts, int64_t cols, const std::string& what) {
    size_t frozen = 0;
    for (const TensorView& p : parts) frozen += p.defined() ? 0 : 1;
    if (frozen == parts.size()) return {};
    TESSERA_CHECK(frozen == 0, "{}: train together or not at all (one tensor here), some are frozen", what);
    int64_t rows = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        if (i) {
            TESSERA_CHECK(static_cast<std::byte*>(parts[i - 1].data) + parts[i - 1].nbytes() == parts[i].data &&
                              parts[i].dtype == parts[0].dtype,
                          "{}: parameters are not adjacent (or not of one dtype)", what);
        }
        rows += parts[i].size(0);
    }
    return TensorView(parts[0].data, parts[0].dtype, Shape{rows, cols}, parts[0].device);
}

TensorView cache_rows(const TensorView& cache, int64_t batch, int64_t pos) {
    return strided(cache.narrow(0, 0, batch).narrow(1, pos, 1), Shape{batch, cache.size(2)},
                   {cache.strides[0], cache.strides[2]});
}

TensorView strided(const TensorView& t, const Shape& shape, std::initializer_list<int64_t> strides) {
    TensorView v = t;
    v.shape = shape;
    size_t i = 0;
    for (const int64_t s : strides) v.strides[i++] = s;
    return v;
}

}  // namespace tessera::model
