// Tensor views: shapes, strides, slicing, reshaping; bf16 rounding.
#include <gtest/gtest.h>

#include <cmath>

#include "core/buffer_spec.h"
#include "core/tensor.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(Tensor, ContiguousStridesAndViews) {
    Tensor t(DType::f32, Shape{2, 3, 4});
    TensorView v = t.view();
    EXPECT_EQ(v.strides[0], 12);
    EXPECT_EQ(v.strides[1], 4);
    EXPECT_EQ(v.strides[2], 1);
    EXPECT_TRUE(v.is_contiguous());
    EXPECT_EQ(v.nbytes(), 96u);
    TensorView s = v.slice0(1, 2);
    EXPECT_EQ(s.shape, (Shape{1, 3, 4}));
    EXPECT_EQ(static_cast<float*>(s.data), t.ptr<float>() + 12);
    EXPECT_EQ(v.reshape(Shape{6, 4}).shape, (Shape{6, 4}));
    EXPECT_THROW(v.reshape(Shape{5, 4}), Error);
    EXPECT_THROW(v.slice0(1, 3), Error);
    EXPECT_THROW(v.ptr<double>(), Error);
    TensorView strided = v;
    strided.strides[1] = 8;
    EXPECT_FALSE(strided.is_contiguous());
    EXPECT_EQ(Shape({2, 3}).str(), "[2, 3]");
    EXPECT_FALSE(TensorView().defined());
}

// A stacked tensor whose dimension-0 slices live apart (a base's experts read in place from one tensor each): a
// buffer group placed outside in one piece per slice gives such a view; slice0 reaches each slice where
// it is, a single slice is an ordinary contiguous view, and reshaping calls that would read it as one block refuse
TEST(Tensor, SlicesStoredApartAreReachedWhereTheyAre) {
    Tensor a(DType::f32, Shape{3, 4}), b(DType::f32, Shape{3, 4}), c(DType::f32, Shape{3, 4});
    BufferGroup g("params", {{"w", DType::f32, Shape{3, 3, 4}}}, {BufferGroup::kOutside}, kBufferAlign);
    g.allocate(std::make_shared<Arena>(kBufferAlign, kBufferAlign));
    g.place_outside(0, {reinterpret_cast<std::byte*>(c.ptr<float>()), reinterpret_cast<std::byte*>(a.ptr<float>()),
                        reinterpret_cast<std::byte*>(b.ptr<float>())});
    const TensorView v = g.view(0);
    EXPECT_EQ(v.shape, (Shape{3, 3, 4}));
    EXPECT_FALSE(v.is_contiguous());
    EXPECT_EQ(v.slice0(0, 1).data, c.ptr<float>());
    EXPECT_EQ(v.slice0(2, 3).data, b.ptr<float>());
    const TensorView one = v.slice0(1, 2);
    EXPECT_TRUE(one.is_contiguous());
    EXPECT_EQ(one.data, a.ptr<float>());
    EXPECT_EQ(one.reshape(Shape{3, 4}).data, a.ptr<float>());
    const TensorView two = v.slice0(1, 3);
    EXPECT_EQ(two.shape, (Shape{2, 3, 4}));
    EXPECT_EQ(two.slice0(1, 2).data, b.ptr<float>());
    test::expect_error([&] { (void)v.reshape(Shape{9, 4}); }, "reshape of a non-contiguous tensor");
    test::expect_error([&] { (void)v.narrow(1, 0, 2); }, "slices are stored apart");
    test::expect_error([&] { (void)v.slice0(2, 4); }, "slice [2, 4) out of range");
    test::expect_error([&] { g.place_outside(0, {nullptr, nullptr}); }, "placed in 2 pieces");
    // the finiteness check of loaded weights reads every slice, and names the element's index in the whole
    b.ptr<float>()[5] = NAN;
    test::expect_error([&] { check_finite(g, "base"); }, "holds nan at index 29");
}

// A group read with copies (the views a model binds over bf16 weight copies, train/weight_copies.h): the buffers the
// copies name are read there, in their dtype, the others where the group holds them, the group itself unchanged
TEST(Tensor, AGroupReadWithCopiesReadsTheNamedBuffersThere) {
    BufferGroup params(
        "params", {{"norm", DType::f32, Shape{4}}, {"w", DType::f32, Shape{2, 8}}, {"v", DType::f32, Shape{8, 2}}});
    params.allocate(std::make_shared<Arena>(1 << 12, kBufferAlign));
    BufferGroup copies("params.bf16", {{"w", DType::bf16, Shape{2, 8}}});
    copies.allocate(std::make_shared<Arena>(1 << 12, kBufferAlign));
    const BufferGroup read = params.reading(copies);
    EXPECT_EQ(read.view("w").data, copies.view(0).data);
    EXPECT_EQ(read.view("w").dtype, DType::bf16);
    EXPECT_EQ(read.view("w").shape, (Shape{2, 8}));
    EXPECT_EQ(read.view("w").device, copies.device());
    for (const char* kept : {"norm", "v"}) {
        EXPECT_EQ(read.view(kept).data, params.view(kept).data) << kept;
        EXPECT_EQ(read.view(kept).dtype, DType::f32) << kept;
    }
    EXPECT_EQ(params.view("w").dtype, DType::f32) << "the held group is unchanged";
    EXPECT_EQ(params.view("w").data, params.base() + params.offset(1));
    BufferGroup stray("params.bf16", {{"u", DType::bf16, Shape{2, 8}}}),
        reshaped("params.bf16", {{"w", DType::bf16, Shape{8, 2}}});
    stray.allocate(std::make_shared<Arena>(1 << 12, kBufferAlign));
    reshaped.allocate(std::make_shared<Arena>(1 << 12, kBufferAlign));
    test::expect_error([&] { (void)params.reading(stray); }, "no buffer \"u\" [2, 8] to read from params.bf16");
    test::expect_error([&] { (void)params.reading(reshaped); }, "no buffer \"w\" [8, 2]");
}

TEST(Tensor, Bf16RoundsToNearestEven) {
    EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
    EXPECT_EQ(bf16_to_float(float_to_bf16(3.140625f)), 3.140625f);  // exactly representable
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0)
    EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-8f)), 1.0f);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6)
    EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
    EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(INFINITY))));
}

TEST(Tensor, ConvertBetweenFloatTypes) {
    Tensor a(DType::f32, Shape{3}), b(DType::bf16, Shape{3}), c(DType::f64, Shape{3});
    a.ptr<float>()[0] = 1.5f;
    a.ptr<float>()[1] = -2.0f;
    a.ptr<float>()[2] = 1e-3f;
    convert(a, b);
    convert(b, c);
    EXPECT_EQ(c.ptr<double>()[0], 1.5);
    EXPECT_EQ(c.ptr<double>()[1], -2.0);
    EXPECT_NEAR(c.ptr<double>()[2], 1e-3, 1e-5);
    Tensor i(DType::i32, Shape{3});
    EXPECT_THROW(convert(a, i), Error);
}

// Sizes from configs and files: a product that wrapped (vocab_size 2^62 · d_model) sized a tiny buffer that the
// step then wrote past. Every product is checked where sizes are computed.
TEST(Tensor, SizeProductsAreChecked) {
    EXPECT_EQ((Shape{int64_t(1) << 31, int64_t(1) << 31}).numel(), int64_t(1) << 62);
    test::expect_error([] { (Shape{int64_t(1) << 62, 32}).numel(); }, "[4611686018427387904, 32] has more than 2^63");
    test::expect_error([] { (Shape{4, -1}).numel(); }, "negative dimension");
    test::expect_error([] { Tensor(DType::f64, Shape{int64_t(1) << 61, 2}); }, "is too large");
    const BufferSpec big{"w", DType::f32, Shape{int64_t(1) << 31, int64_t(1) << 31}};
    test::expect_error([&] { big.nbytes(); }, "buffer w f32 [2147483648, 2147483648] is too large");
    auto quarter = [](const char* name) {  // 2^62 bytes each
        return BufferSpec{name, DType::f32, Shape{int64_t(1) << 30, int64_t(1) << 30}};
    };
    test::expect_error([&] { BufferGroup("params", {quarter("a"), quarter("b")}); }, "more than 2^62 bytes");
}

}  // namespace
}  // namespace tessera
