// Philox4x32-10 against the Random123 known-answer vectors, and the properties initialisation
// relies on: values depend only on (seed, stream, index); normals have the right moments.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"

namespace tessera {
namespace {

TEST(Philox, KnownAnswers) {
    // Random123 kat_vectors: philox4x32 with 10 rounds
    EXPECT_EQ(philox4x32({0, 0, 0, 0}, {0, 0}), (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
    EXPECT_EQ(philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
              (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
    EXPECT_EQ(philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
              (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, ValueDependsOnlyOnSeedStreamAndIndex) {
    RandomStream a{1234, hash_name("model.layers.0.mlp.up_proj.weight")};
    RandomStream b{1234, hash_name("model.layers.0.mlp.up_proj.weight")};
    RandomStream c{1234, hash_name("model.layers.1.mlp.up_proj.weight")};
    // a "shard" reading elements 1000.. sees the same values as the whole tensor
    for (uint64_t i = 1000; i < 1100; ++i) EXPECT_EQ(a.normal(i), b.normal(i));
    int same = 0;
    for (uint64_t i = 0; i < 100; ++i) same += a.normal(i) == c.normal(i);
    EXPECT_EQ(same, 0);
}

TEST(Philox, NormalMoments) {
    RandomStream s{7, 3};
    const int n = 200000;
    double m1 = 0, m2 = 0, m4 = 0;
    for (int i = 0; i < n; ++i) {
        double x = s.normal(uint64_t(i));
        m1 += x;
        m2 += x * x;
        m4 += x * x * x * x;
    }
    m1 /= n;
    m2 /= n;
    m4 /= n;
    EXPECT_NEAR(m1, 0.0, 0.01);  // std error ~0.0022
    EXPECT_NEAR(m2, 1.0, 0.015);
    EXPECT_NEAR(m4, 3.0, 0.08);
}

TEST(Philox, UniformBelowCoversRange) {
    Rng r(5, 9);
    int counts[10] = {};
    for (int i = 0; i < 100000; ++i) counts[r.below(10)]++;
    for (int c : counts) EXPECT_NEAR(c, 10000, 500);
    EXPECT_EQ(r.position(), 100000u);
}

}  // namespace
}  // namespace tessera
