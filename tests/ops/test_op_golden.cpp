// Every op against PyTorch: golden files from tools/ref/make_op_golden.py hold inputs, output
// gradients and the float64 expected outputs and input gradients. Each case runs through the op
// registry (the `tessera op` path) in f64 (tight) and in f32 (relative RMS error bound).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "core/safetensors.h"
#include "ops/registry.h"
#include "util/test_util.h"

namespace tessera {
namespace {

struct GoldenCase {
    std::string name, path;
    friend void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.name; }
};

std::vector<GoldenCase> golden_cases() {
    std::vector<GoldenCase> cases;
    for (auto& e : std::filesystem::directory_iterator(test::golden_path("ops"))) {
        if (e.path().extension() == ".safetensors") cases.push_back({e.path().stem().string(), e.path().string()});
    }
    std::sort(cases.begin(), cases.end(), [](auto& a, auto& b) { return a.name < b.name; });
    return cases;
}

class OpGolden : public ::testing::TestWithParam<GoldenCase> {};

// Files may carry their own tolerance ("rtol.f64" / "rtol.f32"), e.g. those from fp32 references.
void run_case(const GoldenCase& c, DType dtype, double tol) {
    SafetensorsFile f(c.path);
    if (auto it = f.metadata().find(dtype == DType::f64 ? "rtol.f64" : "rtol.f32"); it != f.metadata().end()) {
        tol = std::stod(it->second);
    }
    ASSERT_EQ(f.metadata().at("format_version"), "1") << "regenerate with python3 tools/ref/make_op_golden.py";
    const std::string op_name = f.metadata().at("op");
    const ops::OpDef* op = ops::op_registry().find(op_name);
    ASSERT_NE(op, nullptr) << "golden file for unknown op " << op_name;
    std::map<std::string, Tensor> inputs;
    std::map<std::string, std::string> params;
    for (auto& [k, v] : f.metadata()) {
        if (k.rfind("param.", 0) == 0) params[k.substr(6)] = v;
    }
    const std::string ref = f.metadata().count("reference") ? f.metadata().at("reference") : "PyTorch";
    std::vector<std::string> expected;
    for (auto& e : f.entries()) {
        if (e.name.rfind("expected.", 0) == 0) {
            expected.push_back(e.name.substr(9));
            continue;
        }
        Tensor t = f.load(e.name);
        if (dtype_is_float(t.dtype()) && t.dtype() != dtype) {
            Tensor conv(dtype, t.shape());
            convert(t, conv);
            t = std::move(conv);
        }
        inputs.emplace(e.name, std::move(t));
    }
    auto outputs = ops::run_op(*op, std::move(inputs), params);
    for (const auto& name : expected) {
        SCOPED_TRACE(
            fmt::format("case {} ({}) vs {}, tensor {}, tolerance {}", c.name, dtype_name(dtype), ref, name, tol));
        ASSERT_TRUE(outputs.count(name)) << "op did not write " << name;
        Tensor want = f.load("expected." + name);
        EXPECT_TRUE(test::rel_rms_close(outputs.at(name), want, tol));
    }
}

TEST_P(OpGolden, Float64MatchesPyTorch) { run_case(GetParam(), DType::f64, 1e-12); }
TEST_P(OpGolden, Float32MatchesPyTorch) { run_case(GetParam(), DType::f32, 2e-6); }

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
