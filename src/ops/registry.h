// The op registry behind `tessera op`: every op's tensor names, parameters and a function that runs
// it (forward, and backward when the output gradients are given) on named host tensors.
// Registries are the only globals; this one is filled once, on first use.
#pragma once

#include <cmath>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tessera::ops {

struct OpTensorSpec {
    std::string name;
    std::string shape;  // documentation, e.g. "[N, IN]"
    bool optional = false;
};

enum class ParamKind : uint8_t { number, integer, choice };

struct OpParamSpec {
    std::string name;
    ParamKind kind = ParamKind::number;
    std::string default_value;
    std::vector<std::string> choices;  // ParamKind::choice only
    std::string doc;                   // e.g. "0 = D^-0.5"
    // number and integer: the accepted range, checked by run_op (a negative scale or dv silently meant "the
    // default", a huge topk sized a huge output)
    double min = -HUGE_VAL, max = HUGE_VAL;
};

// Inputs, parsed parameters and outputs of one op call, on a device: with Device::cuda the inputs are copied to
// the GPU, in() and out() are device tensors, and take_outputs() copies them back. host_in() and set_output() are
// for what a binding reads or writes on the host (a scalar loss, a gradient scale); index_span() reads the
// host copy.
class OpContext {
  public:
    OpContext(std::map<std::string, Tensor> inputs,
              std::map<std::string, std::string> params,
              Device device = Device::cpu);

    bool has(const std::string& name) const { return inputs_.count(name) != 0; }
    TensorView in(const std::string& name) const;                        // throws if absent
    TensorView host_in(const std::string& name) const;                   // the host copy
    TensorView in_or_absent(const std::string& name) const;              // a default view if absent
    std::span<const int64_t> index_span(const std::string& name) const;  // an i64 1-D input, or empty
    DType float_dtype() const { return float_dtype_; }                   // f32 or f64: the compute dtype

    double param_f64(const std::string& name) const;
    int64_t param_i64(const std::string& name) const;
    const std::string& param_str(const std::string& name) const;

    // A zero-filled output tensor (or input to be updated in place, when the names agree).
    TensorView out(const std::string& name, DType dtype, Shape shape);
    TensorView out_like(const std::string& name, const TensorView& like) { return out(name, like.dtype, like.shape); }
    std::span<std::byte> workspace(size_t bytes);           // host memory for CPU kernels (empty on CUDA)
    void set_output(const std::string& name, Tensor host);  // an output the binding computed on the host
    double host_value(const std::string& name) const;       // a one-element f32 or f64 input (one-line error else)
    void set_value(const std::string& name, DType dtype, Shape shape, double v);  // a one-element host output

    Device device() const { return device_; }
    std::map<std::string, Tensor> take_outputs();  // on the host

  private:
    Device device_ = Device::cpu;
    std::map<std::string, Tensor> inputs_;
    std::map<std::string, Tensor> device_inputs_;  // Device::cuda: the inputs' copies
    std::map<std::string, std::string> params_;
    std::map<std::string, Tensor> outputs_;
    std::vector<std::byte> workspace_;
    DType float_dtype_ = DType::f32;
};

struct OpDef {
    std::string name;
    std::string summary;
    std::vector<OpTensorSpec> inputs;   // forward inputs and, marked optional, output gradients
    std::vector<OpParamSpec> params;    // every parameter has a default
    std::vector<std::string> outputs;   // forward outputs
    std::vector<std::string> backward;  // "given d<out>: writes d<in>, ..." lines for --list
    std::function<void(OpContext&)> run;
    bool cuda = false;  // the CUDA backend implements it (forward and backward)
};

class OpRegistry {
  public:
    void add(OpDef def);
    const OpDef* find(const std::string& name) const;  // nullptr if absent
    const std::vector<OpDef>& all() const { return ops_; }

  private:
    std::vector<OpDef> ops_;
};

const OpRegistry& op_registry();

// Validates names and parameters against the op's spec (unknown input, unknown parameter,
// non-numeric value: errors that say so), runs it on the device (inputs and outputs on the host) and returns
// its outputs.
std::map<std::string, Tensor> run_op(const OpDef& op,
                                     std::map<std::string, Tensor> inputs,
                                     const std::map<std::string, std::string>& params,
                                     Device device = Device::cpu);

// The ops the CUDA backend implements, comma-separated ("none" if none).
std::string cuda_op_names();

// One line per op: "name  inputs ... | params ... | outputs ..." (for `tessera op --list`).
std::string describe_op(const OpDef& op);

}  // namespace tessera::ops
