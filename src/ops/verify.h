// One op against one golden file (tools/ref/make_op_golden.py: the inputs, the output gradients, and the reference's
// expected outputs and input gradients, computed in float64): the op through the registry (the `tessera op` path) in
// f64 and in f32 against the reference, and its backward against central differences, in f64 on the golden's own
// inputs, of L = Σ_out <out, d_out> over the outputs whose gradient the file gives. The op tests
// (tests/ops/test_op_golden.cpp) and `tessera onboard` run it.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace tessera::ops {

struct GoldenCheck {
    std::string name, op, reference;      // the case (file stem), the op, who computed the expected values
    double f64_error = 0, f32_error = 0;  // largest relative RMS error over the expected tensors
    double f64_tolerance = 1e-12, f32_tolerance = 2e-6;  // the file's own ("rtol.f64" / "rtol.f32") if it has them
    int fd_checked = 0;                                  // input elements checked by finite differences
    double fd_error = 0;  // largest |analytic − central difference| / max(1, |central difference|)
    double fd_tolerance = 1e-6;
    std::vector<std::string> problems;  // one line each: a tensor missing, an error over its tolerance
    bool passed() const { return problems.empty(); }
};

// Throws (one line) for a file that is not a golden file of a registered op. On Device::cuda the op runs on the GPU
// (inputs copied there, outputs back) against the same expected values, at f32 tolerance max(file's, 1e-5); the
// finite-difference check, which tests the math rather than a backend, runs on the CPU only.
GoldenCheck check_golden(const std::string& path, Device device = Device::cpu);

// The golden files (*.safetensors) of a directory, by name; `op` non-empty: only that op's.
std::vector<std::string> golden_files(const std::string& dir, const std::string& op = "");

}  // namespace tessera::ops
