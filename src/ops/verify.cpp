#include "ops/verify.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "core/check.h"
#include "core/element.h"
#include "core/safetensors.h"
#include "ops/registry.h"

namespace tessera::ops {

namespace {
Tensor as(DType dtype, Tensor t) {
    if (!dtype_is_float(t.dtype()) || t.dtype() == dtype) return t;
    Tensor c(dtype, t.shape());
    convert(t, c);
    return c;
}

double rel_rms(const Tensor& got, const Tensor& want) {
    if (got.shape() != want.shape()) return HUGE_VAL;
    double num = 0, den = 0;
    for (int64_t i = 0; i < got.numel(); ++i) {
        const double a = element_as_double(got.view(), i), b = element_as_double(want.view(), i);
        num += (a - b) * (a - b);
        den += b * b;
    }
    return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

struct Golden {
    const OpDef* op = nullptr;
    std::map<std::string, std::string> params;
    std::map<std::string, Tensor> inputs;  // as stored
    std::vector<std::string> expected;     // names of the expected tensors
};

std::map<std::string, Tensor> copies(const std::map<std::string, Tensor>& m, DType dtype) {
    std::map<std::string, Tensor> c;
    for (const auto& [k, v] : m) c.emplace(k, as(dtype, Tensor::copy_of(v)));
    return c;
}
}  // namespace

std::vector<std::string> golden_files(const std::string& dir, const std::string& op) {
    TESSERA_CHECK(std::filesystem::is_directory(dir), "{}: no such directory of golden files", dir);
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        if (e.path().extension() != ".safetensors") continue;
        if (!op.empty()) {
            const SafetensorsFile f(e.path().string());
            const auto& meta = f.metadata();
            if (auto it = meta.find("op"); it == meta.end() || it->second != op) continue;
        }
        files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    return files;
}

GoldenCheck check_golden(const std::string& path, Device device) {
    const SafetensorsFile f(path);
    const auto& meta = f.metadata();
    TESSERA_CHECK(meta.count("op") && meta.count("format_version"), "{}: not a golden op file (no op metadata)", path);
    TESSERA_CHECK(meta.at("format_version") == "1", "{}: golden format {}; regenerate with tools/ref/make_op_golden.py",
                  path, meta.at("format_version"));
    GoldenCheck r;
    r.name = std::filesystem::path(path).stem().string();
    r.op = meta.at("op");
    r.reference = meta.count("reference") ? meta.at("reference") : "PyTorch";
    if (meta.count("rtol.f64")) r.f64_tolerance = std::stod(meta.at("rtol.f64"));
    if (meta.count("rtol.f32")) r.f32_tolerance = std::stod(meta.at("rtol.f32"));
    if (device == Device::cuda) r.f32_tolerance = std::max(r.f32_tolerance, 1e-5);
    Golden g;
    g.op = op_registry().find(r.op);
    TESSERA_CHECK(g.op, "{}: golden file of an unknown op '{}'", path, r.op);
    for (const auto& [k, v] : meta) {
        if (k.rfind("param.", 0) == 0) g.params[k.substr(6)] = v;
    }
    for (const auto& e : f.entries()) {
        if (e.name.rfind("expected.", 0) == 0)
            g.expected.push_back(e.name.substr(9));
        else
            g.inputs.emplace(e.name, f.load(e.name));
    }

    // against the reference, in both compute dtypes
    for (const DType dtype : {DType::f64, DType::f32}) {
        const auto out = run_op(*g.op, copies(g.inputs, dtype), g.params, device);
        double& worst = dtype == DType::f64 ? r.f64_error : r.f32_error;
        const double tol = dtype == DType::f64 ? r.f64_tolerance : r.f32_tolerance;
        for (const std::string& name : g.expected) {
            if (!out.count(name)) {
                r.problems.push_back(fmt::format("{}: the op did not write {}", dtype_name(dtype), name));
                continue;
            }
            const double e = rel_rms(out.at(name), f.load("expected." + name));
            worst = std::max(worst, e);
            if (!(e <= tol))
                r.problems.push_back(fmt::format("{} {}: relative RMS error {:.3g} against {} > {:.3g}",
                                                 dtype_name(dtype), name, e, r.reference, tol));
        }
    }

    // finite differences: the inputs whose gradient the file expects, L over the outputs whose gradient it gives
    std::map<std::string, Tensor> fwd, dout;
    for (const auto& [k, v] : g.inputs) {
        const bool is_grad = k.size() > 1 && k[0] == 'd' &&
                             std::find(g.op->outputs.begin(), g.op->outputs.end(), k.substr(1)) != g.op->outputs.end();
        (is_grad ? dout : fwd).emplace(k, as(DType::f64, Tensor::copy_of(v)));
    }
    if (dout.empty() || device != Device::cpu) return r;  // forward only (e.g. an optimizer update), or on the GPU
    auto with_grads = copies(fwd, DType::f64);
    for (const auto& [k, v] : dout) with_grads.emplace(k, Tensor::copy_of(v));
    const auto analytic = run_op(*g.op, std::move(with_grads), g.params);
    auto objective = [&] {
        const auto out = run_op(*g.op, copies(fwd, DType::f64), g.params);
        double L = 0;
        for (const auto& [k, d] : dout) {
            const Tensor& y = out.at(k.substr(1));
            for (int64_t i = 0; i < y.numel(); ++i) L += y.ptr<double>()[i] * d.ptr<double>()[i];
        }
        return L;
    };
    for (auto& [name, x] : fwd) {
        if (x.dtype() != DType::f64 || std::find(g.expected.begin(), g.expected.end(), "d" + name) == g.expected.end())
            continue;
        if (!analytic.count("d" + name)) {
            r.problems.push_back(fmt::format("backward did not write d{}", name));
            continue;
        }
        const Tensor& grad = analytic.at("d" + name);
        const int64_t n = x.numel(), stride = std::max<int64_t>(1, n / 12);
        for (int64_t i = 0; i < n; i += stride) {
            const double h = 1e-6, x0 = x.ptr<double>()[i];
            x.ptr<double>()[i] = x0 + h;
            const double lp = objective();
            x.ptr<double>()[i] = x0 - h;
            const double lm = objective();
            x.ptr<double>()[i] = x0;
            const double fd = (lp - lm) / (2 * h), an = grad.ptr<double>()[i];
            const double e = std::abs(an - fd) / std::max(1.0, std::abs(fd));
            ++r.fd_checked;
            if (!(e <= r.fd_error)) r.fd_error = e;
            if (!(e <= r.fd_tolerance))
                r.problems.push_back(
                    fmt::format("d{}[{}]: analytic {:.9g} against central difference {:.9g}", name, i, an, fd));
        }
    }
    return r;
}

}  // namespace tessera::ops
