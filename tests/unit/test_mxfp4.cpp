// MXFP4 on hand-packed bytes whose values are known from the format's definition: dequantisation of a checkpoint's
// tensors, the held 17-byte blocks (interleaving keeps the bytes; reading from any position), and quantisation by
// the OCP MX v1.0 rules (the shared scale, round to nearest with ties to the even code, saturation).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// mxfp4_value (the arithmetic the CUDA widening kernel runs too) against the format's table: every scale byte but
// NaN's, every code, in either nibble of any byte of a block after another block, held and in the checkpoint's
// layout; bitwise, -0 included.
TEST(Mxfp4, EveryCodeAtEveryScaleDecodesToItsTableValue) {
    const float table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    uint8_t blocks[2 * kMxfp4BlockBytes] = {};
    uint8_t* block = blocks + kMxfp4BlockBytes;  // the second block: values 32-63
    uint8_t packed[32] = {}, scales[2] = {};     // the same values as the checkpoint stores them
    for (int e = 0; e < 255; ++e) {
        block[0] = uint8_t(e);
        scales[1] = uint8_t(e);
        for (int code = 0; code < 16; ++code) {
            const int byte = (e + code) % 16;
            block[1 + byte] = uint8_t(code | (15 - code) << 4);  // the low nibble: code; the high one: 15 - code
            packed[16 + byte] = block[1 + byte];
            const float want_lo = std::ldexp(table[code], e == 0 ? -127 : e - 127),
                        want_hi = std::ldexp(table[15 - code], e == 0 ? -127 : e - 127);
            for (const Mxfp4 m : {Mxfp4{blocks}, Mxfp4{packed, 0, scales}}) {
                const float lo = mxfp4_value(m + (32 + 2 * byte)), hi = mxfp4_value(m + (32 + 2 * byte + 1));
                ASSERT_EQ(std::memcmp(&lo, &want_lo, 4), 0) << "scale " << e << " code " << code << ": " << lo;
                ASSERT_EQ(std::memcmp(&hi, &want_hi, 4), 0) << "scale " << e << " code " << 15 - code << ": " << hi;
            }
        }
    }
}

TEST(Mxfp4, RefusesNanScalesAndPartialGroups) {
    std::vector<uint8_t> packed(16, 0x11), scales = {255};
    std::vector<float> out(32);
    test::expect_error([&] { dequantize_mxfp4(packed.data(), scales.data(), 1, 32, out.data(), "experts.0.w1"); },
                       "experts.0.w1: MXFP4 scale of row 0 group 0 is NaN");
    test::expect_error([&] { dequantize_mxfp4(packed.data(), scales.data(), 1, 30, out.data(), "w"); },
                       "not whole groups of 32");
}

// the held values of a whole block, decoded
std::vector<float> decoded(const std::vector<uint8_t>& blocks, int64_t n) {
    std::vector<float> out(size_t(n), -99.f);
    mxfp4_to_f32(Mxfp4{blocks.data()}, n, out.data());
    return out;
}

// (and the checkpoint's layout, read in place under a weight budget, reads the same from any position)
TEST(Mxfp4, HeldBlocksKeepTheCheckpointsBytesAndReadFromAnyPosition) {
    std::vector<uint8_t> packed(32), scales = {128, 124};  // one row of 64: scales 2^1, 2^-3
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = uint8_t(i * 37 + 11);
    std::vector<uint8_t> blocks(34, 0xAA);
    mxfp4_blocks(packed.data(), scales.data(), 1, 64, blocks.data(), "w");
    EXPECT_EQ(blocks[0], 128);
    EXPECT_EQ(blocks[17], 124);
    for (int b = 0; b < 16; ++b) {
        EXPECT_EQ(blocks[size_t(1 + b)], packed[size_t(b)]);
        EXPECT_EQ(blocks[size_t(18 + b)], packed[size_t(16 + b)]);
    }
    std::vector<float> want(64);
    dequantize_mxfp4(packed.data(), scales.data(), 1, 64, want.data(), "w");
    EXPECT_EQ(decoded(blocks, 64), want);
    for (int64_t at : {0, 5, 31, 32, 33}) {  // a run starting inside a block and crossing into the next
        const int64_t n = 64 - at;
        std::vector<float> part(static_cast<size_t>(n));
        mxfp4_to_f32(Mxfp4{blocks.data()} + at, n, part.data());
        EXPECT_EQ(part, std::vector<float>(want.begin() + at, want.end())) << at;
        mxfp4_to_f32(Mxfp4{packed.data(), 0, scales.data()} + at, n, part.data());
        EXPECT_EQ(part, std::vector<float>(want.begin() + at, want.end())) << "in place, " << at;
    }
    // 2^127 · 2 is beyond f32: refused, as a NaN scale is
    std::vector<uint8_t> big(16, 0x00), top = {254};
    big[3] = 0x40;
    test::expect_error([&] { mxfp4_blocks(big.data(), top.data(), 1, 32, blocks.data(), "e.w2"); },
                       "e.w2: MXFP4 row 0 group 0 holds a value beyond f32");
    big[3] = 0x33;  // 1.5 · 2^127 fits
    mxfp4_blocks(big.data(), top.data(), 1, 32, blocks.data(), "e.w2");
    EXPECT_EQ(decoded(blocks, 32)[6], std::ldexp(1.5f, 127));
}

TEST(Mxfp4, QuantisationTakesTheSharedScaleAndRoundsToNearestEven) {
    // block 0: max |v| = 6 → scale 2^(2 − 2) = 1; the E2M1 grid's midpoints go to the even code
    std::vector<float> v(64, 0.0f);
    const std::vector<std::pair<float, float>> ties = {{6.0f, 6.0f},   {0.25f, 0.0f},  {0.75f, 1.0f}, {1.25f, 1.0f},
                                                       {1.75f, 2.0f},  {2.5f, 2.0f},   {3.5f, 4.0f},  {5.0f, 4.0f},
                                                       {0.3f, 0.5f},   {0.7f, 0.5f},   {2.6f, 3.0f},  {5.1f, 6.0f},
                                                       {-2.5f, -2.0f}, {-5.5f, -6.0f}, {-0.1f, 0.0f}};
    for (size_t i = 0; i < ties.size(); ++i) v[i] = ties[i].first;
    // block 1: max |v| = 1 → scale 2^(0 − 2) = 1/4: 1 → 4 · 1/4, 0.1 → 0.4 → 0.5 · 1/4
    v[32] = 1.0f;
    v[33] = 0.1f;
    v[34] = -0.99f;  // 3.96 → 4
    std::vector<uint8_t> blocks(34);
    f32_to_mxfp4(v.data(), 64, blocks.data());
    EXPECT_EQ(blocks[0], 127);
    EXPECT_EQ(blocks[17], 125);
    const std::vector<float> got = decoded(blocks, 64);
    for (size_t i = 0; i < ties.size(); ++i) EXPECT_EQ(got[i], ties[i].second) << ties[i].first;
    EXPECT_FALSE(std::signbit(got[14]));  // a negative that rounds to zero is +0
    EXPECT_EQ(got[32], 1.0f);
    EXPECT_EQ(got[33], 0.125f);
    EXPECT_EQ(got[34], -1.0f);
    // values already on a block's grid (an MXFP4 checkpoint's, widened) come back unchanged, byte for byte
    std::vector<uint8_t> packed(16), scale = {120};
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = uint8_t(0x70 | (i % 8));  // a 6 (the max) in each byte
    std::vector<float> wide(32);
    dequantize_mxfp4(packed.data(), scale.data(), 1, 32, wide.data(), "w");
    std::vector<uint8_t> again(17), held(17);
    f32_to_mxfp4(wide.data(), 32, again.data());
    mxfp4_blocks(packed.data(), scale.data(), 1, 32, held.data(), "w");
    EXPECT_EQ(again, held);
    // an all-zero block; magnitudes past the scale range clamp to 2^±127
    std::vector<float> edge(96, 0.0f);
    edge[32] = std::ldexp(1.0f, -140);
    edge[64] = 3.0e38f;
    std::vector<uint8_t> eb(51);
    f32_to_mxfp4(edge.data(), 96, eb.data());
    EXPECT_EQ(eb[0], 0);
    EXPECT_EQ(eb[17], 0);          // 2^-127: the tiny value is 0
    EXPECT_EQ(eb[34], 127 + 125);  // ⌊log2 3e38⌋ = 127
    const std::vector<float> e = decoded(eb, 96);
    EXPECT_EQ(e[32], 0.0f);
    EXPECT_EQ(e[64], std::ldexp(1.0f, 127) * 1.5f);  // 3e38 / 2^125 = 7.05 saturates at 6 → 1.5 · 2^127
    test::expect_error([&] { f32_to_mxfp4(edge.data(), 40, eb.data()); }, "not whole blocks of 32");
}

TEST(Mxfp4, QuantisationErrorIsWithinHalfTheGridStep) {
    // random blocks: every value lands on the nearest grid point of its block's scale (the grid's step is at most
    // 2 · scale, between 4 and 6; values past 6 · scale saturate, at most 2 · scale away since max|v| < 8 · scale)
    std::vector<float> v(32 * 64);
    uint32_t x = 12345;
    for (float& f : v) {
        x = x * 1664525u + 1013904223u;
        f = (float(x >> 8) / float(1 << 24) - 0.5f) * std::ldexp(1.0f, int(x % 13) - 6);
    }
    std::vector<uint8_t> blocks(17 * 64);
    f32_to_mxfp4(v.data(), int64_t(v.size()), blocks.data());
    const std::vector<float> q = decoded(blocks, int64_t(v.size()));
    for (size_t b = 0; b < 64; ++b) {
        const float scale = std::ldexp(1.0f, int(blocks[b * 17]) - 127);
        for (size_t j = 0; j < 32; ++j) {
            const float a = std::fabs(v[b * 32 + j]) / scale, err = std::fabs(v[b * 32 + j] - q[b * 32 + j]) / scale;
            const float half_step = a < 2 ? 0.25f : a < 4 ? 0.5f : a <= 6 ? 1.0f : 2.0f;
            EXPECT_LE(err, half_step) << b << "," << j;
        }
    }
}

}  // namespace
}  // namespace tessera
