// Helpers shared by blocks.
#include "model/layers/block.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tessera::model {

double ParamInit::value(double u, double n) const {
    switch (kind) {
        case Kind::normal:
            return a * n;
        case Kind::constant:
            return a;
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
    specs.push_back({std::move(name), DType::f32, shape, BufferKind::param, weight_decay});
    inits.push_back(init);
}

void residual_copy(TensorView x_in, TensorView x_out, int64_t rows) {
    TESSERA_CHECK(x_in.is_contiguous() && x_out.is_contiguous() && x_in.size(1) == x_out.size(1),
                  "residual_copy: mismatched residual buffers");
    if (x_in.data != x_out.data) std::memcpy(x_out.data, x_in.data, size_t(rows * x_in.size(1)) * sizeof(float));
}

void zero_rows(TensorView t, int64_t rows) {
    TESSERA_CHECK(t.is_contiguous(), "zero_rows: buffer must be contiguous");
    const int64_t cols = t.ndim() >= 2 ? t.numel() / t.size(0) : 1;
    std::memset(t.data, 0, size_t(rows * cols) * dtype_size(t.dtype));
}

}  // namespace tessera::model
