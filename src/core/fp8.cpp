// FP8 E4M3 block dequantisation (see fp8.h; format: OCP 8-bit Floating Point Specification (OFP8) v1.0,
// E4M3; block scaling as in DeepSeek-V3's released checkpoints and its inference/kernel.py weight_dequant).
#include "core/fp8.h"

#include <cmath>

#include "core/check.h"

namespace tessera {

float e4m3_to_float(uint8_t byte) {
    const int e = (byte >> 3) & 0x0F, m = byte & 0x07;
    if (e == 0x0F && m == 0x07) return NAN;
    const float v = e == 0 ? std::ldexp(float(m) / 8.0f, -6) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
    return (byte & 0x80) ? -v : v;
}

void dequantize_fp8_blocks(const uint8_t* values,
                           const float* scale_inv,
                           int64_t rows,
                           int64_t cols,
                           int64_t block,
                           float* out,
                           const std::string& what) {
    TESSERA_CHECK(block > 0, "{}: FP8 block size must be positive", what);
    const int64_t bc = (cols + block - 1) / block;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            const float v = e4m3_to_float(values[r * cols + c]);
            TESSERA_CHECK(!std::isnan(v), "{}: FP8 value at [{}, {}] is NaN", what, r, c);
            out[r * cols + c] = v * scale_inv[(r / block) * bc + c / block];
        }
    }
}

}  // namespace tessera
