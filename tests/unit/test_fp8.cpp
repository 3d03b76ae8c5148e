// FP8 E4M3 decoding against values worked out by hand from the OFP8 spec (bias 7, 3 mantissa bits,
// subnormals at exponent 0, S.1111.111 = NaN), and DeepSeek's 128 × 128 block scaling.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/fp8.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(Fp8, E4M3DecodesKnownCodes) {
    EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
    EXPECT_EQ(e4m3_to_float(0x38), 1.0f);          // 0 0111 000
    EXPECT_EQ(e4m3_to_float(0x3C), 1.5f);          // 0 0111 100
    EXPECT_EQ(e4m3_to_float(0x40), 2.0f);          // 0 1000 000
    EXPECT_EQ(e4m3_to_float(0xC0), -2.0f);         // sign bit
    EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);        // 0 1111 110: the largest finite value
    EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);  // subnormal 1/8 · 2^-6
    EXPECT_EQ(e4m3_to_float(0x08), 0.015625f);     // smallest normal 2^-6
    EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));  // 0 1111 111
    EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(Fp8, BlocksOf128TakeTheirOwnScale) {
    const int64_t rows = 130, cols = 260;               // 2 × 3 blocks, the last ones partial
    std::vector<uint8_t> v(size_t(rows * cols), 0x3C);  // 1.5 everywhere
    const std::vector<float> scale{1, 2, 4, 8, 16, 32};
    std::vector<float> out(v.size());
    dequantize_fp8_blocks(v.data(), scale.data(), rows, cols, 128, out.data(), "w");
    for (int64_t r : {0, 127, 128, 129}) {
        for (int64_t c : {0, 127, 128, 255, 256, 259}) {
            EXPECT_EQ(out[size_t(r * cols + c)], 1.5f * scale[size_t((r / 128) * 3 + c / 128)]) << r << "," << c;
        }
    }
    v[5] = 0x7F;
    test::expect_error([&] { dequantize_fp8_blocks(v.data(), scale.data(), rows, cols, 128, out.data(), "w"); },
                       "w: FP8 value at [0, 5] is NaN");
}

}  // namespace
}  // namespace tessera
