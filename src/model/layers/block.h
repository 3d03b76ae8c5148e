// The interface every residual block implements: x_out = x_in + f(x_in), or x_out = f(x_in) when the
// model routes the residual paths itself (Attention Residuals: set_residual(false)). A block declares its
// parameters, the activations it saves for backward and the scratch its backward uses (buffer
// specs; see core/buffer_spec.h), binds views into the allocated groups, and runs forward/backward.
// Shapes: x_in, x_out, dres [N, C] with N = B·T tokens, C = d_model.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "ops/rows.h"

namespace tessera::model {

struct StepShape {
    int64_t batch = 1;
    int64_t seq = 1;
    // Document boundaries (optional): sequence starts over the flattened batch·seq tokens, every row
    // start included, ending with batch·seq. Blocks then keep packed documents apart.
    std::span<const int64_t> cu_seqlens = {};
    int64_t tokens() const { return batch * seq; }
};

// How a parameter starts (values from Philox by (seed, name, index); see Model::init_params).
struct ParamInit {
    enum class Kind : uint8_t {
        normal,               // N(0, a²)
        constant,             // a
        uniform,              // U(a, b)
        log_uniform,          // ln U(a, b)
        dt_inverse_softplus,  // dt = exp(U(ln a, ln b)) clamped >= 1e-4, value = dt + ln(−expm1(−dt))
    };
    Kind kind = Kind::normal;
    double a = 0.0, b = 0.0;
    int64_t element_offset = 0;  // a slice of a larger tensor (one rank's experts): its first element's index there

    static ParamInit normal(double std) { return {Kind::normal, std, 0.0}; }
    static ParamInit constant(double value) { return {Kind::constant, value, 0.0}; }
    double value(double uniform01, double normal01) const;  // the value for one element
};

// What the next passes are for: training forwards record statistics (MoE loads) once per
// micro-batch, recompute and eval forwards do not; loss_scale weighs losses a block adds itself
// (MoE router losses) like the LM loss.
struct PassOptions {
    bool record = false;
    double loss_scale = 1.0;
    uint64_t lora_seed = 0;  // training passes with model.lora.dropout: the micro-batch's masks (0: no dropout)
};

class Block {
  public:
    virtual ~Block() = default;

    // Parameters under the block's own name prefix (e.g. "model.layers.3.self_attn."), with init.
    virtual void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const = 0;
    // Activations forward saves for backward, named under `prefix`, for up to `max` tokens.
    virtual void declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const = 0;
    // Buffers used only inside backward, shared by every block of the same kind.
    virtual void declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const = 0;
    virtual size_t workspace_bytes(StepShape max, int num_threads) const { return 0; }

    // grads: the trainable parameters' gradients; a frozen parameter has none (its view is left undefined,
    // backward skips its gradient: param_view)
    virtual void bind_params(const BufferGroup& params, const BufferGroup* grads) = 0;
    virtual void bind_saved(const BufferGroup& acts, const std::string& prefix) = 0;
    virtual void bind_scratch(const BufferGroup& acts, const std::string& prefix) = 0;

    // x_out = x_in + f(x_in); saves what backward needs.
    virtual void forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) = 0;
    // dres holds dL/dx_out on entry and dL/dx_in on exit; parameter gradients accumulate.
    virtual void backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) = 0;

    // Incremental decoding (generation): per-sequence caches for `batch` sequences of up to `max_len`
    // tokens, and one step = one new token per sequence at position `pos` (the caches hold positions
    // < pos; x_in, x_out [batch, C]). Blocks without cross-token state keep the defaults: no cache,
    // and a step is their forward over `batch` one-token rows.
    virtual void declare_cache(std::vector<BufferSpec>& specs,
                               const std::string& prefix,
                               int64_t batch,
                               int64_t max_len) const {}
    virtual void bind_cache(const BufferGroup& cache, const std::string& prefix) {}
    virtual void step(int64_t batch, int64_t pos, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
        forward(StepShape{batch, 1}, x_in, x_out, ws);
    }

    // Forward FLOPs per token at sequence length `seq` (matmuls and attention scores).
    virtual double forward_flops_per_token(int64_t seq) const = 0;
    // Short kind name shared by blocks that share scratch ("attention", "mlp").
    virtual std::string kind() const = 0;
    virtual void set_pass(const PassOptions&) {}
    // The saved activations were overwritten by a copy of another forward's (a pipeline stage restoring a micro-batch
    // before its backward, train/pipeline.h): whatever the block keeps of its last forward outside them is stale.
    virtual void saved_replaced() {}
    // Whether this parameter's gradient is the same whichever of the block's heads run (the DSA indexer's: it learns
    // from the mean over every head): under tensor parallelism each rank of the group computes all of it, so one adds
    // it (model/layers/tensor_slice.h).
    virtual bool head_independent_gradient(const std::string& param) const { return false; }

    // false: forward writes f(x_in) alone and backward leaves only f's input gradient in dres.
    void set_residual(bool on) { residual_ = on; }

  protected:
    // Where every forward starts: x_out = x_in (residual) or 0, for the first `rows` rows.
    void start_output(TensorView x_in, TensorView x_out, int64_t rows) const;
    // Called after the last read of dL/dx_out in dres and before the input norm's backward adds dL/dx_in
    // into it: without the residual, dres restarts at 0.
    void start_input_grad(TensorView dres, int64_t rows) const;

  private:
    bool residual_ = true;
};

// Appends one parameter (f32) and its initialisation.
void add_param(std::vector<BufferSpec>& specs,
               std::vector<ParamInit>& inits,
               std::string name,
               Shape shape,
               ParamInit init,
               bool weight_decay);

// the first `width` columns of each of `heads` heads (head h at col + h·head_stride) of a row-major
// [B·T, *] f32 buffer, as a [B, T, heads, width] view
TensorView heads_view(TensorView rows, StepShape s, int64_t col, int64_t heads, int64_t head_stride, int64_t width);
// Decoding caches [B, L, W]: the [batch, W] rows at position pos, and a view of t's data with other shape and strides.
TensorView cache_rows(const TensorView& cache, int64_t batch, int64_t pos);
TensorView strided(const TensorView& t, const Shape& shape, std::initializer_list<int64_t> strides);
// A parameter's view in the parameter group, or its gradient's in the gradient group (undefined when frozen).
TensorView param_view(const BufferGroup& g, const std::string& name, bool grad);
// one [Σ rows, cols] view (their dtype) over parameters declared back to back (checks that they are adjacent);
// undefined when every part is (the gradients of frozen parameters)
TensorView adjacent(const std::vector<TensorView>& parts, int64_t cols, const std::string& what);
// Marks the last `count` declared parameters as read together through adjacent() (BufferSpec::fused_next), so
// whatever places parameters outside the packed group (the weight budget) keeps them back to back.
void fuse_last(std::vector<BufferSpec>& specs, size_t count);

}  // namespace tessera::model
