// FP8 weights as DeepSeek publishes them (DeepSeek-V3 / V3.2 checkpoints: quantization_config
// {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}): each weight is F8_E4M3
// (OCP FP8 E4M3 "fn": sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, S.1111.111 is
// NaN and refused; exponent 0 is subnormal, m/8·2^-6) and `<name>_scale_inv` holds one f32 factor per
// 128 × 128 block of [rows, cols]: w[r, c] = e4m3(r, c) · scale_inv[r / 128, c / 128].
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

float e4m3_to_float(uint8_t byte);  // NaN for S.1111.111

// values [rows, cols] bytes, scale_inv [⌈rows/block⌉, ⌈cols/block⌉] -> out [rows, cols] f32. `what` names
// the tensor in errors.
void dequantize_fp8_blocks(const uint8_t* values,
                           const float* scale_inv,
                           int64_t rows,
                           int64_t cols,
                           int64_t block,
                           float* out,
                           const std::string& what);

}  // namespace tessera
