// MXFP4 dequantisation (see mxfp4.h; format: OCP Microscaling Formats (MX) v1.0 spec, E2M1 and E8M0).
#include "core/mxfp4.h"

#include <cmath>

#include "core/check.h"

namespace tessera {

void dequantize_mxfp4(
    const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out, const std::string& what) {
    static constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    TESSERA_CHECK(rows >= 0 && cols % 32 == 0, "{}: MXFP4 rows of {} values are not whole groups of 32", what, cols);
    const int64_t groups = cols / 32;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t e = scales[r * groups + g];
            TESSERA_CHECK(e != 255, "{}: MXFP4 scale of row {} group {} is NaN (255)", what, r, g);
            const float scale = std::ldexp(1.0f, int(e) - 127);
            for (int64_t c = g * 32; c < (g + 1) * 32; ++c) {
                const uint8_t byte = packed[r * (cols / 2) + c / 2];
                const uint8_t nib = c % 2 == 0 ? byte & 0x0F : byte >> 4;
                const float v = kE2M1[nib & 0x07] * scale;
                out[r * cols + c] = (nib & 0x08) ? -v : v;
            }
        }
    }
}

}  // namespace tessera
