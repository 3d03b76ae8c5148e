// bfloat16 as CUDA's cuda_bf16.h provides it, for the CUDA emulator (src/cuda_emulator): the storage type and the
// conversions tessera's kernels use. __float2bfloat16 rounds to nearest even, as CUDA's does (and core/dtype.h).
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t __x;
};

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};  // a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
}

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t u = uint32_t(h.__x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
