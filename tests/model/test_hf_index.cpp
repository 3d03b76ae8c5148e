// model.safetensors.index.json: the weight map is read strictly (file names inside the directory only).
#include <gtest/gtest.h>

#include "model/hf_index.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(HfIndex, ReadsTheWeightMap) {
    const auto m = model::parse_hf_index(
        R"({"metadata": {"total_size": 8}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "sub/model-00002-of-00002.safetensors"}})",
        "index.json");
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m.at("a.weight"), "model-00001-of-00002.safetensors");
    EXPECT_EQ(m.at("b.weight"), "sub/model-00002-of-00002.safetensors");
}

TEST(HfIndex, RefusesWhatIsNotAFileInTheDirectory) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {R"({"weight_map": {"a": 3}})", "weight_map[\"a\"] must be a file name, not 3"},
        {R"({"weight_map": {"a": ["x"]}})", "must be a file name"},
        {R"({"weight_map": {"a": "../../etc/passwd"}})", "not a file inside the checkpoint directory"},
        {R"({"weight_map": {"a": "/etc/passwd"}})", "not a file inside the checkpoint directory"},
        {R"({"weight_map": {"a": ""}})", "not a file inside the checkpoint directory"},
        {R"({"weight_map": []})", "no \"weight_map\" object"},
        {R"([1, 2])", "no \"weight_map\" object"},
        {R"({"weight_map": )" + std::string(100000, '[') + std::string(100000, ']') + "}", "nested deeper"},
        {R"({"weight_map": {"a": "x"})", "index.json: not valid JSON"},
    };
    for (const auto& [text, needle] : cases) {
        SCOPED_TRACE(text.substr(0, 100));
        test::expect_error([&] { model::parse_hf_index(text, "index.json"); }, needle);
    }
}

}  // namespace
}  // namespace tessera
