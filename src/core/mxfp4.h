// MXFP4 (OCP Microscaling FP4, OCP MX v1.0 spec): E2M1 values (bit 3 the sign, bits 0-2 indexing
// {0, 0.5, 1, 1.5, 2, 3, 4, 6}) in blocks of 32 consecutive values of a row sharing one E8M0 scale byte (value
// 2^(byte − 127); byte 255 is NaN in the MX format and is refused).
//
// Two layouts:
//  - compressed-tensors' `mxfp4-pack-quantized` checkpoints (Kimi K3's routed experts, spec/kimi_k3.md §1.2): two
//    tensors, `weight_packed` [rows, cols/2] (element 2i in the low nibble, 2i+1 in the high one) and
//    `weight_scale` [rows, cols/32]. Read in place from the files under a weight budget (train/weight_budget.h);
//  - held in memory (DType::mxfp4: frozen routed experts, model.lora.expert_dtype): 17-byte blocks, the scale byte
//    then the block's 16 packed bytes, so a block's scale sits beside its values and any run of whole blocks (an
//    expert, a row) is one contiguous range of bytes.
// Every MXFP4 value is an E2M1 value times a power of two: it widens to f32 exactly.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "core/host_device.h"

namespace tessera {

constexpr int64_t kMxfp4Block = 32;       // values per block
constexpr int64_t kMxfp4BlockBytes = 17;  // held: scale byte + 16 packed bytes

// A read position in MXFP4 values: value `index` of those starting at `blocks` (held), or, with `scales` set, of the
// checkpoint's layout (packed values at `blocks`, a scale byte per 32 values at `scales`). Adding to it moves the
// index (it stands where ops::gemm takes a pointer to its B operand; ops/gemm.h).
struct Mxfp4 {
    const uint8_t* blocks = nullptr;
    int64_t index = 0;
    const uint8_t* scales = nullptr;
    friend Mxfp4 operator+(Mxfp4 m, int64_t n) {
        m.index += n;
        return m;
    }
};

// E2M1 code (bit 3 the sign) times 2^(scale − 127) (scale byte 0: 2^−127), exactly.
TESSERA_HOST_DEVICE inline float mxfp4_decode(unsigned code, uint8_t scale_byte) {
    const unsigned m = code & 7u, e = m >> 1;  // E2M1: 0, 0.5 (e = 0), (1 + m/2)·2^(e−1)
    const float magnitude = e == 0 ? 0.5f * float(m & 1u) : (1.0f + 0.5f * float(m & 1u)) * float(1u << (e - 1));
    float scale = 0x1p-127f;
    if (scale_byte != 0) {
        const uint32_t bits = uint32_t(scale_byte) << 23;
        std::memcpy(&scale, &bits, sizeof scale);
    }
    return (code & 8u ? -magnitude : magnitude) * scale;
}

// Value m.index as f32, exactly: its code (even values in the low nibble) and its block's scale, in either layout.
// One definition for the CPU (mxfp4_to_f32) and CUDA (the linear's weight widening, held blocks).
TESSERA_HOST_DEVICE inline float mxfp4_value(Mxfp4 m) {
    const int64_t v = m.index;
    const uint8_t* block = m.blocks + v / kMxfp4Block * kMxfp4BlockBytes;
    const uint8_t byte = m.scales ? m.blocks[v / 2] : block[1 + v % kMxfp4Block / 2];
    const uint8_t scale = m.scales ? m.scales[v / kMxfp4Block] : block[0];
    return mxfp4_decode(v % 2 == 0 ? byte & 0x0Fu : unsigned(byte) >> 4, scale);
}

// n values from src (either layout) into out as f32 (exactly).
void mxfp4_to_f32(Mxfp4 src, int64_t n, float* out);

// n f32 values (n a multiple of 32, all finite) into n/32 held blocks: a block's scale is 2^(⌊log2 max|v|⌋ − 2)
// (OCP MX v1.0 §6.3: the largest power of two with max|v| / scale < 8, clamped to 2^±127) and each value
// v / scale rounds to the nearest E2M1 value, ties to the even code, saturating at ±6. Lossy unless the values
// came from MXFP4 with such scales.
void f32_to_mxfp4(const float* src, int64_t n, uint8_t* blocks);

// Checks a checkpoint's packed [rows, cols/2] and scales [rows, cols/32] (cols a multiple of 32): refuses a NaN
// scale (255) and values beyond f32 (a scale of 2^127 with a value of 2 or more), naming `what`.
void check_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, const std::string& what);

// A checkpoint's packed [rows, cols/2] and scales [rows, cols/32] interleaved into rows × cols/32 held blocks, bytes
// unchanged (checked as check_mxfp4 does).
void mxfp4_blocks(
    const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, uint8_t* blocks, const std::string& what);

// The reverse: rows × cols/32 held blocks into a checkpoint's packed [rows, cols/2] and scales [rows, cols/32].
void mxfp4_split(const uint8_t* blocks, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales);

// The checkpoint layout straight to f32: out [rows, cols] (the same checks).
void dequantize_mxfp4(
    const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out, const std::string& what);

}  // namespace tessera
