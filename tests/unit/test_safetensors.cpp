// safetensors: round trips, a file written by the reference Python implementation, and strict
// rejection of malformed files (each with a message that names the problem).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::TempDir;

std::string slurp(const std::string& path) { return read_text(path); }
void spit(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// A raw file from a header string and data bytes
std::string raw_file(const std::string& header, const std::string& data) {
    uint64_t n = header.size();
    std::string s(8, '\0');
    std::memcpy(s.data(), &n, 8);
    return s + header + data;
}

void expect_error(const std::string& path, const std::string& needle) {
    try {
        SafetensorsFile f(path);
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "message must name the file: " << e.what();
        EXPECT_LT(std::string(e.what()).size(), 1000u) << "inputs are echoed in excerpts only";
    }
}

TEST(Safetensors, RoundTripAllDtypes) {
    TempDir dir;
    Tensor a(DType::f32, Shape{2, 3}), b(DType::i64, Shape{4}), c(DType::bf16, Shape{3}), d(DType::f64, Shape{});
    for (int i = 0; i < 6; ++i) a.ptr<float>()[i] = float(i) * 0.5f;
    int64_t bv[4] = {1, -2, 3, -4};
    std::memcpy(b.ptr<int64_t>(), bv, sizeof bv);
    c.ptr<bf16>()[1] = float_to_bf16(-2.5f);
    *d.ptr<double>() = 0.25;
    write_safetensors(dir.file("t.safetensors"), {{"a", a}, {"b", b}, {"c", c}, {"d", d}}, {{"k", "v"}});
    SafetensorsFile f(dir.file("t.safetensors"));
    ASSERT_EQ(f.entries().size(), 4u);
    EXPECT_EQ(f.metadata().at("k"), "v");
    EXPECT_TRUE(test::bitwise_equal(f.view("a"), a));
    EXPECT_TRUE(test::bitwise_equal(f.view("b"), b));
    EXPECT_TRUE(test::bitwise_equal(f.view("c"), c));
    EXPECT_TRUE(test::bitwise_equal(f.load("d"), d));
    EXPECT_EQ(f.entry("d").shape.ndim, 0);
    // load_into converts between float dtypes and checks the shape
    Tensor a64(DType::f64, Shape{2, 3});
    f.load_into("a", a64);
    EXPECT_EQ(a64.ptr<double>()[5], 2.5);
    Tensor wrong(DType::f32, Shape{3, 2});
    EXPECT_THROW(f.load_into("a", wrong), Error);
    EXPECT_THROW(f.entry("missing"), Error);
}

TEST(Safetensors, ReadsAFileWrittenByTheReferenceImplementation) {
    // tools/ref/make_safetensors_golden.py (huggingface safetensors, numpy)
    SafetensorsFile f(test::golden_path("safetensors/python_written.safetensors"));
    EXPECT_EQ(f.metadata().at("writer"), "huggingface-safetensors");
    Tensor a = f.load("a");
    ASSERT_EQ(a.shape(), (Shape{2, 3}));
    for (int i = 0; i < 6; ++i) EXPECT_EQ(a.ptr<float>()[i], float(i) - 1.5f);
    Tensor b = f.load("b");
    EXPECT_EQ(b.ptr<int64_t>()[3], -4);
    Tensor c = f.load("c");
    EXPECT_EQ(bf16_to_float(c.ptr<bf16>()[2]), 3.140625f);
    EXPECT_EQ(*f.load("d").ptr<double>(), 0.5);
}

TEST(Safetensors, RejectsTruncatedFiles) {
    TempDir dir;
    Tensor a(DType::f32, Shape{100});
    write_safetensors(dir.file("ok.safetensors"), {{"a", a}});
    std::string bytes = slurp(dir.file("ok.safetensors"));
    spit(dir.file("short.safetensors"), bytes.substr(0, bytes.size() - 10));
    expect_error(dir.file("short.safetensors"), "truncated");
    spit(dir.file("tiny.safetensors"), bytes.substr(0, 5));
    expect_error(dir.file("tiny.safetensors"), "header length is missing");
    spit(dir.file("head.safetensors"), bytes.substr(0, 20));
    expect_error(dir.file("head.safetensors"), "runs past the end");
}

TEST(Safetensors, RejectsCorruptedData) {
    TempDir dir;
    Tensor a(DType::f32, Shape{100});
    write_safetensors(dir.file("ok.safetensors"), {{"a", a}});
    std::string bytes = slurp(dir.file("ok.safetensors"));
    bytes[bytes.size() - 7] ^= 0x10;
    spit(dir.file("flip.safetensors"), bytes);
    expect_error(dir.file("flip.safetensors"), "checksum mismatch");
}

TEST(Safetensors, RejectsMalformedHeaders) {
    TempDir dir;
    const std::string data(24, '\0');
    struct Case {
        std::string header, needle;
    };
    std::vector<Case> cases = {
        {"not json", "JSON object"},
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 3]", "not valid JSON"},
        {R"({"a": {"dtype": "Q7", "shape": [6], "data_offsets": [0, 24]}})", "unsupported dtype"},
        {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 24]}})", "needs 16 bytes"},
        {R"({"a": {"dtype": "F32", "shape": [-6], "data_offsets": [0, 24]}})", "bad shape"},
        {R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [24, 0]}})", "reversed"},
        {R"({"a": {"dtype": "F32", "shape": [6]}})", "exactly dtype, shape and data_offsets"},
        {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}, "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}})",
         "overlap or gap"},
        {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})", "trailing bytes"},
        {R"({"__metadata__": {"x": 3}, "a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}})", "not a string"},
        // nested a few hundred thousand levels: copying or printing the value recursed past the stack
        {R"({"a": {"dtype": "F32", "shape": )" + std::string(300000, '[') + std::string(300000, ']') +
             R"(, "data_offsets": [0, 24]}})",
         "nested deeper than 64 levels"},
        {R"({"a": {"dtype": ")" + std::string(1 << 20, 'x') + R"(", "shape": [6], "data_offsets": [0, 24]}})",
         "more bytes)"},
    };
    for (size_t i = 0; i < cases.size(); ++i) {
        std::string path = dir.file("bad" + std::to_string(i) + ".safetensors");
        spit(path, raw_file(cases[i].header, data));
        SCOPED_TRACE(cases[i].header.substr(0, 200));
        expect_error(path, cases[i].needle);
    }
}

TEST(Safetensors, AtomicWriteLeavesThePreviousFileOnError) {
    TempDir dir;
    Tensor a(DType::f32, Shape{4});
    a.ptr<float>()[0] = 7;
    write_safetensors(dir.file("x.safetensors"), {{"a", a}});
    Tensor b(DType::f32, Shape{4});
    EXPECT_THROW(write_safetensors(dir.file("x.safetensors"), {{"a", a}, {"a", b}}), Error);  // duplicate name
    SafetensorsFile f(dir.file("x.safetensors"));
    EXPECT_EQ(f.view("a").ptr<float>()[0], 7);
    for (auto& e : std::filesystem::directory_iterator(dir.path())) {
        EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
    }
}

}  // namespace
}  // namespace tessera
