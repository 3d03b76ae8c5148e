// Every input under tests/fuzz/corpus/<target>/ (hand-written seeds and what the fuzzers found) replayed through
// its target in the ordinary build: a clean error or success, never a crash or a stray exception.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

struct Target {
    std::string name;
    void (*run)(fuzz::Input);
};
const Target kTargets[] = {{"safetensors", fuzz::safetensors},
                           {"config", fuzz::config},
                           {"hf_index", fuzz::hf_index},
                           {"token_shard", fuzz::token_shard},
                           {"op", fuzz::op}};

class FuzzCorpus : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzCorpus, EveryInputEndsCleanly) {
    const fs::path dir = fs::path(TESSERA_FUZZ_CORPUS) / GetParam().name;
    ASSERT_TRUE(fs::is_directory(dir)) << dir;
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
        if (!e.is_regular_file()) continue;
        std::ifstream in(e.path(), std::ios::binary);
        const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        SCOPED_TRACE(e.path().string());
        EXPECT_NO_THROW(GetParam().run(bytes));
        ++n;
    }
    EXPECT_GE(n, 3) << "seed inputs missing under " << dir;
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus, ::testing::ValuesIn(kTargets), [](const auto& info) {
    return info.param.name;
});

}  // namespace
}  // namespace tessera
