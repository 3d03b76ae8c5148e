// MXFP4 encoding and decoding (see mxfp4.h; format: OCP Microscaling Formats (MX) v1.0 spec, E2M1 and E8M0).
#include "core/mxfp4.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/check.h"

namespace tessera {

namespace {
// E2M1 codes 0-15 (bit 3 the sign)
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(e − 127) exactly (e = 0: the subnormal 2^−127)
float scale_of(uint8_t e) { return e == 0 ? std::ldexp(1.0f, -127) : std::bit_cast<float>(uint32_t(e) << 23); }

// |v| (already divided by the scale) to the nearest E2M1 code, ties to the even code, saturating at 6
uint8_t e2m1_code(float a) {
    if (a <= 0.25f) return 0;
    if (a < 0.75f) return 1;
    if (a <= 1.25f) return 2;
    if (a < 1.75f) return 3;
    if (a <= 2.5f) return 4;
    if (a < 3.5f) return 5;
    if (a <= 5.0f) return 6;
    return 7;
}

void check_block(uint8_t e, const uint8_t* packed16, int64_t row, int64_t group, const std::string& what) {
    TESSERA_CHECK(e != 255, "{}: MXFP4 scale of row {} group {} is NaN (255)", what, row, group);
    if (e < 254) return;
    for (int64_t b = 0; b < 16; ++b) {  // 2^127 · 2 and more overflow f32
        const bool big = (packed16[b] & 0x04) || (packed16[b] & 0x40);
        TESSERA_CHECK(!big, "{}: MXFP4 row {} group {} holds a value beyond f32 (scale 2^127)", what, row, group);
    }
}
}  // namespace

void mxfp4_to_f32(Mxfp4 src, int64_t n, float* out) {
    int64_t i = src.index, k = 0;
    while (k < n) {
        const int64_t first = i % kMxfp4Block, count = std::min(kMxfp4Block - first, n - k);
        if (count == kMxfp4Block) {  // a whole block: two values a byte
            const uint8_t* block = src.blocks + i / kMxfp4Block * kMxfp4BlockBytes;
            const uint8_t* values = src.scales ? src.blocks + i / 2 : block + 1;
            const float s = scale_of(src.scales ? src.scales[i / kMxfp4Block] : block[0]);
            for (int64_t b = 0; b < 16; ++b) {
                out[k + 2 * b] = kE2M1[values[b] & 0x0F] * s;
                out[k + 2 * b + 1] = kE2M1[values[b] >> 4] * s;
            }
        } else {
            for (int64_t j = 0; j < count; ++j) out[k + j] = mxfp4_value(Mxfp4{src.blocks, i + j, src.scales});
        }
        i += count;
        k += count;
    }
}

void f32_to_mxfp4(const float* src, int64_t n, uint8_t* blocks) {
    TESSERA_CHECK(n % kMxfp4Block == 0, "MXFP4: {} values are not whole blocks of 32", n);
    for (int64_t b = 0; b < n / kMxfp4Block; ++b) {
        const float* v = src + b * kMxfp4Block;
        uint8_t* block = blocks + b * kMxfp4BlockBytes;
        float amax = 0.0f;
        for (int64_t j = 0; j < kMxfp4Block; ++j) amax = std::max(amax, std::fabs(v[j]));
        const int shared = amax == 0.0f ? -127 : std::clamp(std::ilogb(amax) - 2, -127, 127);
        block[0] = uint8_t(shared + 127);
        std::fill(block + 1, block + kMxfp4BlockBytes, uint8_t(0));
        for (int64_t j = 0; j < kMxfp4Block; ++j) {
            const uint8_t mag = e2m1_code(std::ldexp(std::fabs(v[j]), -shared));
            const uint8_t code = mag | (mag != 0 && std::signbit(v[j]) ? 0x08 : 0x00);
            block[1 + j / 2] |= j % 2 == 0 ? code : uint8_t(code << 4);
        }
    }
}

void check_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, const std::string& what) {
    TESSERA_CHECK(rows >= 0 && cols % kMxfp4Block == 0, "{}: MXFP4 rows of {} values are not whole groups of 32", what,
                  cols);
    const int64_t groups = cols / kMxfp4Block;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g)
            check_block(scales[r * groups + g], packed + r * (cols / 2) + g * 16, r, g, what);
}

void mxfp4_blocks(const uint8_t* packed,
                  const uint8_t* scales,
                  int64_t rows,
                  int64_t cols,
                  uint8_t* blocks,
                  const std::string& what) {
    check_mxfp4(packed, scales, rows, cols, what);
    for (int64_t b = 0; b < rows * (cols / kMxfp4Block); ++b) {
        blocks[b * kMxfp4BlockBytes] = scales[b];
        std::copy_n(packed + b * 16, 16, blocks + b * kMxfp4BlockBytes + 1);
    }
}

void mxfp4_split(const uint8_t* blocks, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales) {
    for (int64_t b = 0; b < rows * (cols / kMxfp4Block); ++b) {
        scales[b] = blocks[b * kMxfp4BlockBytes];
        std::copy_n(blocks + b * kMxfp4BlockBytes + 1, 16, packed + b * 16);
    }
}

void dequantize_mxfp4(
    const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out, const std::string& what) {
    check_mxfp4(packed, scales, rows, cols, what);
    mxfp4_to_f32(Mxfp4{packed, 0, scales}, rows * cols, out);
}

}  // namespace tessera
