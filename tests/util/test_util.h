// Test helpers: deterministic random tensors, tolerance checks that report the worst element,
// temporary directories, and the golden-file location.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/check.h"
#include "core/tensor.h"

namespace tessera::test {

std::string golden_path(const std::string& relative);  // under tests/golden/
// Where a test leaves what a person may want to look at (screenshots): BUILD/test-output/NAME (made if missing).
std::string output_path(const std::string& name);

// Normal(0, std) values from (seed, stream); f32 or f64.
Tensor randn(DType dtype, Shape shape, uint64_t seed, double std = 1.0);
Tensor uniform(DType dtype, Shape shape, uint64_t seed, double lo, double hi);

double to_double(const TensorView& t, int64_t i);  // f32 / f64 / bf16 / int element

// |a - b| <= atol + rtol·|b| everywhere; the failure names the worst element and both values.
::testing::AssertionResult all_close(const TensorView& actual, const TensorView& expected, double rtol, double atol);
// ||a - b|| / ||b|| <= tol (relative RMS error; robust for tensors with near-zero entries).
::testing::AssertionResult rel_rms_close(const TensorView& actual, const TensorView& expected, double tol);
::testing::AssertionResult bitwise_equal(const TensorView& a, const TensorView& b);

// Copies a golden file (safetensors, f64 tensors) to `to` with element `index` of `tensor` moved by `delta`: a golden
// whose reference disagrees with the op, for tests of the checks.
void write_golden_with_moved_value(
    const std::string& from, const std::string& to, const std::string& tensor, int64_t index, double delta);

// Runs f and expects a tessera::Error whose message contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& needle) {
    try {
        f();
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

// A fresh empty directory under the system temp dir, removed by the destructor.
class TempDir {
  public:
    TempDir();
    ~TempDir();
    const std::string& path() const { return path_; }
    std::string file(const std::string& name) const { return path_ + "/" + name; }

  private:
    std::string path_;
};

}  // namespace tessera::test
