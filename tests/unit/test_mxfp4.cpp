// MXFP4 dequantisation on hand-packed bytes whose values are known from the format's definition.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/mxfp4.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(Mxfp4, HandPackedBytesGiveTheirE2M1ValuesTimesTheScale) {
    // one row of 64 values = 2 groups of 32; group 0 scale 2^1 (byte 128), group 1 scale 2^-3 (byte 124)
    std::vector<uint8_t> packed(32, 0x00), scales = {128, 124};
    packed[0] = 0x21;   // elements 0, 1: low nibble 1 = 0.5, high nibble 2 = 1.0
    packed[1] = 0xF7;   // elements 2, 3: 7 = 6.0, 15 = −6.0
    packed[2] = 0x9B;   // elements 4, 5: 11 = −1.5, 9 = −0.5
    packed[16] = 0x53;  // elements 32, 33 (group 1): 3 = 1.5, 5 = 3.0
    packed[31] = 0xC6;  // elements 62, 63: 6 = 4.0, 12 = −2.0
    std::vector<float> out(64, -1.f);
    dequantize_mxfp4(packed.data(), scales.data(), 1, 64, out.data(), "w");
    const std::vector<std::pair<int, float>> want = {{0, 1.0f},     {1, 2.0f},    {2, 12.0f}, {3, -12.0f},
                                                     {4, -3.0f},    {5, -1.0f},   {6, 0.0f},  {31, 0.0f},
                                                     {32, 0.1875f}, {33, 0.375f}, {62, 0.5f}, {63, -0.25f}};
    for (auto [i, v] : want) EXPECT_EQ(out[size_t(i)], v) << "element " << i;
    for (int i = 7; i < 31; ++i) EXPECT_EQ(out[size_t(i)], 0.0f) << i;
}

TEST(Mxfp4, RefusesNanScalesAndPartialGroups) {
    std::vector<uint8_t> packed(16, 0x11), scales = {255};
    std::vector<float> out(32);
    test::expect_error([&] { dequantize_mxfp4(packed.data(), scales.data(), 1, 32, out.data(), "experts.0.w1"); },
                       "experts.0.w1: MXFP4 scale of row 0 group 0 is NaN");
    test::expect_error([&] { dequantize_mxfp4(packed.data(), scales.data(), 1, 30, out.data(), "w"); },
                       "not whole groups of 32");
}

}  // namespace
}  // namespace tessera
