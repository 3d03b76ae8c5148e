// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11 "Parallel random numbers: as easy
// as 1, 2, 3"). A value depends only on (key, counter), so a parameter's initial value depends only
// on (seed, parameter name, element index), however the parameter is later sharded.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "core/mix64.h"

namespace tessera {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

PhiloxCounter philox4x32(PhiloxCounter ctr, PhiloxKey key);

// 64-bit FNV-1a of a string: the stream id of a named parameter.
uint64_t hash_name(std::string_view name);

// The random stream (seed, stream). Element i of the stream uses counter (i, stream-derived words).
struct RandomStream {
    uint64_t seed = 0;
    uint64_t stream = 0;

    std::array<uint32_t, 4> bits(uint64_t index) const;
    double uniform(uint64_t index) const;  // in [0, 1)
    double normal(uint64_t index) const;   // standard normal (Box-Muller)
};

// Sequential generator over a RandomStream (sampling, shuffling): its whole state is the position.
class Rng {
  public:
    Rng(uint64_t seed, uint64_t stream) : s_{seed, stream} {}
    double uniform() { return s_.uniform(pos_++); }
    uint64_t below(uint64_t n);  // uniform integer in [0, n)
    uint64_t position() const { return pos_; }
    void set_position(uint64_t p) { pos_ = p; }

  private:
    RandomStream s_;
    uint64_t pos_ = 0;
};

}  // namespace tessera
