// Element types of tensors, their sizes and names (ours and safetensors'), and bf16 conversion.
// f64 exists for the double-precision reference paths used by finite-difference tests.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace tessera {

// f8e4m3: storage only (FP8 checkpoints, core/fp8.h), never computed on. mxfp4: frozen routed experts held in
// MXFP4 (core/mxfp4.h), blocks of 32 values in 17 bytes: no whole bytes per element (dtype_size 0, dtype_bytes).
enum class DType : uint8_t { f32, f64, bf16, i32, i64, u8, u16, f8e4m3, mxfp4 };

// bytes per element; 0 for mxfp4 (dtype_bytes sizes it)
constexpr size_t dtype_size(DType t) {
    switch (t) {
        case DType::f32:
            return 4;
        case DType::f64:
            return 8;
        case DType::bf16:
            return 2;
        case DType::i32:
            return 4;
        case DType::i64:
            return 8;
        case DType::u8:
            return 1;
        case DType::u16:
            return 2;
        case DType::f8e4m3:
            return 1;
        case DType::mxfp4:
            return 0;
    }
    return 0;
}

// Bytes of n elements (mxfp4: 17 per started block of 32); SIZE_MAX when that does not fit in a size_t.
constexpr size_t dtype_bytes(DType t, int64_t n) {
    const size_t u = size_t(n);
    if (t == DType::mxfp4) return (u / 32 + (u % 32 != 0)) * 17;
    const size_t s = dtype_size(t);
    return s != 0 && u > SIZE_MAX / s ? SIZE_MAX : u * s;
}

constexpr bool dtype_is_float(DType t) {
    return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::mxfp4;
}
constexpr bool dtype_is_int(DType t) { return !dtype_is_float(t); }

// "f32", "bf16", ...
std::string_view dtype_name(DType t);
// safetensors spelling: "F32", "BF16", "I64", ...
std::string_view dtype_safetensors_name(DType t);
std::optional<DType> dtype_from_safetensors_name(std::string_view name);

// C++ type -> DType
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
    return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
    return DType::f64;
}
template <>
constexpr DType dtype_of<int32_t>() {
    return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
    return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
    return DType::u8;
}
template <>
constexpr DType dtype_of<uint16_t>() {
    return DType::u16;
}

// bfloat16 storage: the top 16 bits of an IEEE float; conversion rounds to nearest even.
struct bf16 {
    uint16_t bits = 0;
};
template <>
constexpr DType dtype_of<bf16>() {
    return DType::bf16;
}

inline float bf16_to_float(bf16 h) { return std::bit_cast<float>(uint32_t(h.bits) << 16); }
inline bf16 float_to_bf16(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16{uint16_t(u >> 16)};
}

}  // namespace tessera
