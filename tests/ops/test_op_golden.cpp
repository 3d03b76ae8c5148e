// Every op against PyTorch: golden files from tools/ref/make_op_golden.py hold inputs, output
// gradients and the float64 expected outputs and input gradients. Each case runs through the op
// registry (the `tessera op` path) in f64 (tight) and in f32 (relative RMS error bound), and its backward
// against central differences on the file's inputs (ops/verify.h, which `tessera onboard` runs too).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "core/safetensors.h"
#include "ops/registry.h"
#include "ops/verify.h"
#include "util/test_util.h"

namespace tessera {
namespace {

struct GoldenCase {
    std::string name, path;
    friend void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.name; }
};

std::vector<GoldenCase> golden_cases() {
    std::vector<GoldenCase> cases;
    for (const std::string& f : ops::golden_files(test::golden_path("ops")))
        cases.push_back({std::filesystem::path(f).stem().string(), f});
    return cases;
}

class OpGolden : public ::testing::TestWithParam<GoldenCase> {};

// ops::check_golden: f64 within 1e-12 and f32 within 2e-6 relative RMS of the reference (or the file's own
// "rtol.f64" / "rtol.f32", e.g. for fp32 references), and backward within 1e-6 of central differences on the file's
// inputs.
TEST_P(OpGolden, MatchesItsReferenceAndFiniteDifferences) {
    const ops::GoldenCheck r = ops::check_golden(GetParam().path);
    for (const std::string& p : r.problems) ADD_FAILURE() << r.name << " (" << r.op << "): " << p;
    EXPECT_TRUE(r.passed());
    EXPECT_LE(r.f64_error, r.f64_tolerance);
    EXPECT_LE(r.f32_error, r.f32_tolerance);
    if (!ops::op_registry().find(r.op)->backward.empty()) {
        EXPECT_GT(r.fd_checked, 0) << "no gradient checked by finite differences";
    }
}

// The check fails where the op and its reference disagree: a golden whose expected dx moved by 1e-3 in one element.
TEST(OpGoldenCheck, AWrongReferenceValueIsAProblem) {
    const std::string path = test::output_path("op_golden_check_linear_wrong_dx.safetensors");
    test::write_golden_with_moved_value(test::golden_path("ops/linear.safetensors"), path, "expected.dx", 3, 1e-3);
    const ops::GoldenCheck r = ops::check_golden(path);
    EXPECT_FALSE(r.passed());
    ASSERT_FALSE(r.problems.empty());
    EXPECT_NE(r.problems[0].find("dx"), std::string::npos) << r.problems[0];
    EXPECT_GT(r.fd_checked, 0);  // the op itself is right: its backward agrees with central differences
    EXPECT_LE(r.fd_error, r.fd_tolerance);
}

INSTANTIATE_TEST_SUITE_P(Golden, OpGolden, ::testing::ValuesIn(golden_cases()), [](const auto& info) {
    return info.param.name;
});

TEST(OpGoldenCoverage, EveryRegisteredOpHasAGoldenCase) {
    std::set<std::string> covered;
    for (auto& c : golden_cases()) covered.insert(SafetensorsFile(c.path).metadata().at("op"));
    for (auto& op : ops::op_registry().all()) EXPECT_TRUE(covered.count(op.name)) << op.name << " has no golden file";
}

}  // namespace
}  // namespace tessera
