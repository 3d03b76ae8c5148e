// The interface every residual block implements: x_out = x_in + f(x_in). A block declares its
// parameters, the activations it saves for backward and the scratch its backward uses (buffer
// specs; see core/buffer_spec.h), binds views into the allocated groups, and runs forward/backward.
// Shapes: x_in, x_out, dres [N, C] with N = B·T tokens, C = d_model.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "core/buffer_spec.h"

namespace tessera::model {

struct StepShape {
    int64_t batch = 1;
    int64_t seq = 1;
    int64_t tokens() const { return batch * seq; }
};

class Block {
  public:
    virtual ~Block() = default;

    // Parameters under the block's own name prefix (e.g. "model.layers.3.self_attn."), with init.
    virtual void declare_params(std::vector<BufferSpec>& specs, std::vector<double>& init_std) const = 0;
    // Activations forward saves for backward, named under `prefix`, for up to `max` tokens.
    virtual void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const = 0;
    // Buffers used only inside backward, shared by every block of the same kind.
    virtual void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const = 0;
    virtual size_t workspace_bytes(StepShape max, int num_threads) const { return 0; }

    virtual void bind_params(const BufferGroup& params, const BufferGroup* grads) = 0;
    virtual void bind_saved(const BufferGroup& acts, const std::string& prefix) = 0;
    virtual void bind_scratch(const BufferGroup& acts, const std::string& prefix) = 0;

    // x_out = x_in + f(x_in); saves what backward needs.
    virtual void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) = 0;
    // dres holds dL/dx_out on entry and dL/dx_in on exit; parameter gradients accumulate.
    virtual void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) = 0;

    // Forward FLOPs per token at sequence length `seq` (matmuls and attention scores).
    virtual double forward_flops_per_token(int64_t seq) const = 0;
    // Short kind name shared by blocks that share scratch ("attention", "mlp").
    virtual std::string kind() const = 0;
};

// x_out = x_in (the residual copy every block starts from)
void residual_copy(TensorView x_in, TensorView x_out, int64_t rows);
// zero-fill the first `rows` rows of a contiguous [rows_max, cols] buffer
void zero_rows(TensorView t, int64_t rows);

}  // namespace tessera::model
