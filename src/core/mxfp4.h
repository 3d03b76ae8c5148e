// MXFP4 (OCP Microscaling FP4) weights as stored by compressed-tensors' `mxfp4-pack-quantized` format
// (Kimi K3's routed experts, spec/kimi_k3.md §1.2): E2M1 values, two per byte along the last dimension
// (element 2i in the low nibble, 2i+1 in the high one; bit 3 is the sign, bits 0-2 index
// {0, 0.5, 1, 1.5, 2, 3, 4, 6}), and one E8M0 scale byte per group of 32 consecutive values of a row
// (value 2^(byte − 127); byte 255 is NaN in the MX format and is refused).
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

// packed [rows, cols/2] bytes, scales [rows, cols/32] bytes -> out [rows, cols] f32. cols must be a
// multiple of 32. `what` names the tensor in errors.
void dequantize_mxfp4(
    const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out, const std::string& what);

}  // namespace tessera
