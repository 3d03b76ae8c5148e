// Philox4x32-10 and the streams built on it. Constants from Salmon et al. (SC'11), Random123.
#include "core/rng.h"

#include <cmath>
#include <numbers>

namespace tessera {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
    uint64_t p = uint64_t(a) * uint64_t(b);
    hi = uint32_t(p >> 32);
    lo = uint32_t(p);
}
}  // namespace

PhiloxCounter philox4x32(PhiloxCounter c, PhiloxKey k) {
    for (int round = 0; round < 10; ++round) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(kMul0, c[0], hi0, lo0);
        mulhilo(kMul1, c[2], hi1, lo1);
        c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
        k[0] += kWeyl0;
        k[1] += kWeyl1;
    }
    return c;
}

uint64_t hash_name(std::string_view name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char ch : name) {
        h ^= ch;
        h *= 0x100000001b3ull;
    }
    return h;
}

std::array<uint32_t, 4> RandomStream::bits(uint64_t index) const {
    PhiloxCounter ctr = {uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)};
    PhiloxKey key = {uint32_t(seed), uint32_t(seed >> 32)};
    return philox4x32(ctr, key);
}

namespace {
// 53 random bits -> [0, 1)
inline double to_unit(uint32_t hi, uint32_t lo) {
    uint64_t x = (uint64_t(hi) << 21) ^ (uint64_t(lo) >> 11);
    return double(x & ((uint64_t(1) << 53) - 1)) * 0x1.0p-53;
}
}  // namespace

double RandomStream::uniform(uint64_t index) const {
    auto b = bits(index);
    return to_unit(b[0], b[1]);
}

double RandomStream::normal(uint64_t index) const {
    auto b = bits(index);
    double u1 = 1.0 - to_unit(b[0], b[1]);  // (0, 1]
    double u2 = to_unit(b[2], b[3]);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

uint64_t Rng::below(uint64_t n) {
    // NOTES: multiply-shift on 53 bits; the bias (n / 2^53) is negligible for the sizes we shuffle.
    return uint64_t(uniform() * double(n)) % n;
}

}  // namespace tessera
