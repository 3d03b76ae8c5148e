// Test helpers (see test_util.h).
#include "util/test_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/element.h"
#include "core/rng.h"
#include "core/safetensors.h"

namespace tessera::test {

std::string golden_path(const std::string& relative) {
    // TESSERA_GOLDEN_DIR in the environment: a test binary run from another checkout (scripts/device-check.sh run)
    const char* dir = std::getenv("TESSERA_GOLDEN_DIR");
    return std::string(dir && *dir ? dir : TESSERA_GOLDEN_DIR) + "/" + relative;
}

std::string output_path(const std::string& name) {
    std::filesystem::create_directories(TESSERA_TEST_OUTPUT_DIR);
    return std::string(TESSERA_TEST_OUTPUT_DIR) + "/" + name;
}

namespace {
void store(const TensorView& t, int64_t i, double x) {
    if (t.dtype == DType::f32) {
        static_cast<float*>(t.data)[i] = float(x);
    } else if (t.dtype == DType::f64) {
        static_cast<double*>(t.data)[i] = x;
    } else {
        TESSERA_FAIL("test: random fill of {} is not supported", dtype_name(t.dtype));
    }
}
}  // namespace

Tensor randn(DType dtype, Shape shape, uint64_t seed, double std) {
    Tensor t(dtype, shape);
    RandomStream rs{seed, 7};
    for (int64_t i = 0; i < t.numel(); ++i) store(t.view(), i, std * rs.normal(uint64_t(i)));
    return t;
}

Tensor uniform(DType dtype, Shape shape, uint64_t seed, double lo, double hi) {
    Tensor t(dtype, shape);
    RandomStream rs{seed, 11};
    for (int64_t i = 0; i < t.numel(); ++i) store(t.view(), i, lo + (hi - lo) * rs.uniform(uint64_t(i)));
    return t;
}

double to_double(const TensorView& t, int64_t i) { return element_as_double(t, i); }

::testing::AssertionResult all_close(const TensorView& a, const TensorView& b, double rtol, double atol) {
    if (a.shape != b.shape) {
        return ::testing::AssertionFailure() << "shape " << a.shape.str() << " vs expected " << b.shape.str();
    }
    int64_t worst = -1;
    double worst_excess = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
        double x = to_double(a, i), y = to_double(b, i);
        if (x == y) continue;  // equal, infinities included (an lse of +inf: no entry)
        double excess = std::abs(x - y) - (atol + rtol * std::abs(y));
        if (!(excess <= 0) || std::isnan(x) != std::isnan(y)) {
            if (std::isnan(x) && std::isnan(y)) continue;
            ++bad;
            if (worst < 0 || excess > worst_excess || std::isnan(excess)) {
                worst = i;
                worst_excess = excess;
            }
        }
    }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << bad << " of " << a.numel() << " elements differ (rtol " << rtol << ", atol "
                                         << atol << "); worst at flat index " << worst << ": " << to_double(a, worst)
                                         << " vs expected " << to_double(b, worst);
}

::testing::AssertionResult rel_rms_close(const TensorView& a, const TensorView& b, double tol) {
    if (a.shape != b.shape) {
        return ::testing::AssertionFailure() << "shape " << a.shape.str() << " vs expected " << b.shape.str();
    }
    double num = 0, den = 0, worst = 0;
    int64_t wi = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
        double d = to_double(a, i) - to_double(b, i);
        num += d * d;
        den += to_double(b, i) * to_double(b, i);
        if (!(std::abs(d) <= worst)) {
            worst = std::abs(d);
            wi = i;
        }
    }
    double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
    if (rel <= tol) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "relative RMS error " << rel << " > " << tol << "; worst at flat index "
                                         << wi << ": " << to_double(a, wi) << " vs expected " << to_double(b, wi);
}

::testing::AssertionResult bitwise_equal(const TensorView& a, const TensorView& b) {
    if (a.shape != b.shape || a.dtype != b.dtype) return ::testing::AssertionFailure() << "shape or dtype differ";
    if (std::memcmp(a.data, b.data, a.nbytes()) == 0) return ::testing::AssertionSuccess();
    for (int64_t i = 0; i < a.numel(); ++i) {
        if (std::memcmp(static_cast<const char*>(a.data) + i * dtype_size(a.dtype),
                        static_cast<const char*>(b.data) + i * dtype_size(b.dtype), dtype_size(a.dtype)) != 0) {
            return ::testing::AssertionFailure()
                   << "first difference at flat index " << i << ": " << to_double(a, i) << " vs " << to_double(b, i);
        }
    }
    return ::testing::AssertionFailure() << "bytes differ";
}

TempDir::TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tessera-test-XXXXXX").string();
    TESSERA_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory");
    path_ = tmpl;
}

TempDir::~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
}

void write_golden_with_moved_value(
    const std::string& from, const std::string& to, const std::string& tensor, int64_t index, double delta) {
    const SafetensorsFile f(from);
    std::vector<Tensor> held;
    std::vector<NamedTensor> tensors;
    for (const auto& e : f.entries()) {
        held.push_back(f.load(e.name));
        if (e.name == tensor) held.back().ptr<double>()[index] += delta;
        tensors.push_back({e.name, held.back().view()});
    }
    std::map<std::string, std::string> meta = f.metadata();
    meta.erase("crc32c");  // the writer adds the new data's
    write_safetensors(to, tensors, meta);
}

}  // namespace tessera::test
