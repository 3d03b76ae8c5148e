// Counter hashes shared by host and device code (plain C++: the CUDA kernels include this header too).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace tessera {

// splitmix64's finaliser (Steele, Lea and Flood, OOPSLA 2014): a cheap counter hash where Philox's quality is more
// than needed per element (LoRA's dropout masks, a frozen base's content hash).
TESSERA_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// A counter-based dropout draw: whether element `index` of the mask of (seed, stream) survives drop probability p
// (a uniform double in [0, 1) from 53 hash bits, kept when >= p). A pure function of its arguments, so forward,
// backward and a recomputed forward see the same mask on either device.
TESSERA_HOST_DEVICE inline bool dropout_keep(uint64_t seed, uint64_t stream, uint64_t index, double p) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull ^ mix64(stream + index * 0xd1b54a32d192ed03ull));
    return double(h >> 11) * 0x1.0p-53 >= p;
}

}  // namespace tessera
