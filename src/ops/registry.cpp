// The op registry, the op context and run_op (the core of `tessera op`).
#include "ops/registry.h"

#include "core/element.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/json.h"
#include "ops/bindings/bindings.h"

namespace tessera::ops {

namespace {
std::string join(const std::vector<std::string>& xs, std::string_view sep) {
    std::string s;
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? std::string(sep) : "") + xs[i];
    return s;
}

bool parse_f64(const std::string& s, double& out) {
    const char* end = s.data() + s.size();
    auto r = std::from_chars(s.data(), end, out);
    return r.ec == std::errc() && r.ptr == end && std::isfinite(out);
}

std::string range_text(const OpParamSpec& p) {
    if (std::isinf(p.max)) return fmt::format(">= {}", p.min);
    if (std::isinf(p.min)) return fmt::format("<= {}", p.max);
    return fmt::format("in [{}, {}]", p.min, p.max);
}

bool parse_i64(const std::string& s, int64_t& out) {
    const char* end = s.data() + s.size();
    auto r = std::from_chars(s.data(), end, out);
    return r.ec == std::errc() && r.ptr == end;
}
}  // namespace

OpContext::OpContext(std::map<std::string, Tensor> inputs, std::map<std::string, std::string> params, Device device)
    : device_(device), inputs_(std::move(inputs)), params_(std::move(params)) {
    // bf16 inputs compute in f32; all float inputs must then share one dtype.
    bool seen = false;
    for (auto& [name, t] : inputs_) {
        if (t.dtype() == DType::bf16) {
            Tensor f(DType::f32, t.shape());
            convert(t.view(), f.view());
            t = std::move(f);
        }
        if (!dtype_is_float(t.dtype())) continue;
        if (!seen) {
            float_dtype_ = t.dtype();
            seen = true;
        }
        TESSERA_CHECK(t.dtype() == float_dtype_, "input \"{}\" is {} but other float inputs are {}", name,
                      dtype_name(t.dtype()), dtype_name(float_dtype_));
    }
    if (device_ != Device::cpu) {
        for (const auto& [name, t] : inputs_) device_inputs_.emplace(name, t.to(device_));
    }
}

TensorView OpContext::host_in(const std::string& name) const {
    auto it = inputs_.find(name);
    TESSERA_CHECK(it != inputs_.end(), "missing input tensor \"{}\"", name);
    return it->second.view();
}

double OpContext::host_value(const std::string& name) const {
    const TensorView t = host_in(name);
    TESSERA_CHECK(t.numel() == 1 && (t.dtype == DType::f32 || t.dtype == DType::f64),
                  "{} must be one f32 or f64 value, not {} {}", name, dtype_name(t.dtype), t.shape.str());
    return element_as_double(t, 0);
}

void OpContext::set_value(const std::string& name, DType dtype, Shape shape, double v) {
    Tensor t(dtype, std::move(shape));
    TESSERA_CHECK(t.numel() == 1, "{}: one value, not {}", name, t.shape().str());
    if (dtype == DType::i64) {
        *t.ptr<int64_t>() = int64_t(v);
    } else if (dtype == DType::f32) {
        *t.ptr<float>() = float(v);
    } else {
        *t.ptr<double>() = v;
    }
    set_output(name, std::move(t));
}

TensorView OpContext::in(const std::string& name) const {
    if (device_ == Device::cpu) return host_in(name);
    auto it = device_inputs_.find(name);
    TESSERA_CHECK(it != device_inputs_.end(), "missing input tensor \"{}\"", name);
    return it->second.view();
}

TensorView OpContext::in_or_absent(const std::string& name) const { return has(name) ? in(name) : TensorView(); }

std::span<const int64_t> OpContext::index_span(const std::string& name) const {
    if (!has(name)) return {};
    TensorView t = host_in(name);
    check_dtype(t, DType::i64, name);
    TESSERA_CHECK(t.ndim() == 1, "{} must be 1-D, not {}", name, t.shape.str());
    return {t.ptr<int64_t>(), size_t(t.numel())};
}

double OpContext::param_f64(const std::string& name) const {
    double v = 0;
    TESSERA_CHECK(parse_f64(params_.at(name), v), "parameter {} = '{}' is not a number", name, params_.at(name));
    return v;
}

int64_t OpContext::param_i64(const std::string& name) const {
    int64_t v = 0;
    TESSERA_CHECK(parse_i64(params_.at(name), v), "parameter {} = '{}' is not an integer", name, params_.at(name));
    return v;
}

const std::string& OpContext::param_str(const std::string& name) const { return params_.at(name); }

TensorView OpContext::out(const std::string& name, DType dtype, Shape shape) {
    if (auto in = inputs_.find(name); in != inputs_.end()) {  // updated in place (e.g. adamw's param)
        TESSERA_CHECK(in->second.shape() == shape && in->second.dtype() == dtype,
                      "input \"{}\" is {} {} but the op updates it as {} {}", name, dtype_name(in->second.dtype()),
                      in->second.shape().str(), dtype_name(dtype), shape.str());
        outputs_[name] = Tensor::copy_of(this->in(name));
        return outputs_[name].view();
    }
    outputs_[name] = Tensor(dtype, shape, device_);
    return outputs_[name].view();
}

std::span<std::byte> OpContext::workspace(size_t bytes) {
    if (device_ == Device::cuda) return {};  // the CUDA kernels take no host workspace (ops/cuda/cuda_ops.h)
    workspace_.assign(bytes, std::byte{0});
    return workspace_;
}

void OpContext::set_output(const std::string& name, Tensor host) { outputs_[name] = std::move(host); }

std::map<std::string, Tensor> OpContext::take_outputs() {
    std::map<std::string, Tensor> out;
    for (auto& [name, t] : outputs_) out.emplace(name, t.device() == Device::cpu ? std::move(t) : t.to(Device::cpu));
    outputs_.clear();
    return out;
}

void OpRegistry::add(OpDef def) {
    TESSERA_CHECK(find(def.name) == nullptr, "op {} registered twice", def.name);
    ops_.push_back(std::move(def));
}

const OpDef* OpRegistry::find(const std::string& name) const {
    for (const auto& op : ops_) {
        if (op.name == name) return &op;
    }
    return nullptr;
}

const OpRegistry& op_registry() {
    static const OpRegistry registry = [] {
        OpRegistry r;
        register_dense_ops(r);
        register_kda_ops(r);
        register_moe_ops(r);
        register_dsa_ops(r);
        return r;
    }();
    return registry;
}

std::map<std::string, Tensor> run_op(const OpDef& op,
                                     std::map<std::string, Tensor> inputs,
                                     const std::map<std::string, std::string>& params,
                                     Device device) {
    TESSERA_CHECK(device == Device::cpu || op.cuda,
                  "op {}: the CUDA backend has no implementation of it yet (ops on CUDA: {})", op.name,
                  cuda_op_names());
    std::map<std::string, std::string> values;
    std::vector<std::string> param_names;
    for (const auto& spec : op.params) {
        values[spec.name] = spec.default_value;
        param_names.push_back(spec.name);
    }
    for (const auto& param : params) {
        const std::string &name = param.first, &value = param.second;  // (clang 14 cannot capture a binding)
        auto it = std::find_if(op.params.begin(), op.params.end(), [&](auto& s) { return s.name == name; });
        TESSERA_CHECK(it != op.params.end(), "op {}: unknown parameter \"{}\" (parameters: {})", op.name, excerpt(name),
                      op.params.empty() ? "none" : join(param_names, ", "));
        double f;
        int64_t i;
        switch (it->kind) {
            case ParamKind::number:
                TESSERA_CHECK(parse_f64(value, f), "op {}: parameter {}='{}' is not a number", op.name, name,
                              excerpt(value));
                TESSERA_CHECK(f >= it->min && f <= it->max, "op {}: parameter {}={} must be {}", op.name, name,
                              excerpt(value), range_text(*it));
                break;
            case ParamKind::integer:
                TESSERA_CHECK(parse_i64(value, i), "op {}: parameter {}='{}' is not an integer", op.name, name,
                              excerpt(value));
                TESSERA_CHECK(double(i) >= it->min && double(i) <= it->max, "op {}: parameter {}={} must be {}",
                              op.name, name, value, range_text(*it));
                break;
            case ParamKind::choice:
                TESSERA_CHECK(std::find(it->choices.begin(), it->choices.end(), value) != it->choices.end(),
                              "op {}: parameter {}='{}' must be one of: {}", op.name, name, excerpt(value),
                              join(it->choices, ", "));
                break;
        }
        values[name] = value;
    }
    std::vector<std::string> names;
    for (const auto& spec : op.inputs) names.push_back(spec.name);
    for (const auto& [name, t] : inputs) {
        TESSERA_CHECK(std::find(names.begin(), names.end(), name) != names.end(),
                      "op {}: unknown input tensor \"{}\" (inputs: {})", op.name, name, join(names, ", "));
    }
    for (const auto& spec : op.inputs) {
        TESSERA_CHECK(spec.optional || inputs.count(spec.name), "op {}: missing input tensor \"{}\" {}", op.name,
                      spec.name, spec.shape);
    }
    for (const auto& [name, t] : inputs) {  // the kernels divide by their dimensions
        TESSERA_CHECK(t.numel() > 0, "op {}: input \"{}\" {} is empty", op.name, name, t.shape().str());
    }
    try {
        OpContext ctx(std::move(inputs), std::move(values), device);
        op.run(ctx);
        return ctx.take_outputs();
    } catch (const Error& e) {
        throw Error(fmt::format("op {}: {}", op.name, e.what()), e.origin());
    }
}

std::string cuda_op_names() {
    std::vector<std::string> names;
    for (const auto& op : op_registry().all()) {
        if (op.cuda) names.push_back(op.name);
    }
    return names.empty() ? "none" : join(names, ", ");
}

std::string describe_op(const OpDef& op) {
    std::string s = fmt::format("{}: {}\n  inputs:", op.name, op.summary);
    for (const auto& t : op.inputs) s += fmt::format(" {}{}{}", t.name, t.shape, t.optional ? "?" : "");
    s += "\n  params:";
    if (op.params.empty()) s += " none";
    for (const auto& p : op.params) {
        s += fmt::format(" {}={}", p.name, p.default_value);
        if (p.kind == ParamKind::choice) s += fmt::format("({})", join(p.choices, "|"));
        if (!p.doc.empty()) s += fmt::format(" ({})", p.doc);
    }
    s += "\n  outputs: " + join(op.outputs, ", ");
    s += op.cuda ? "\n  devices: cpu, cuda" : "\n  devices: cpu";
    for (const auto& b : op.backward) s += "\n  backward: " + b;
    return s;
}

}  // namespace tessera::ops
