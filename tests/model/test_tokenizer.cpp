// Hugging Face tokenizers (src/train/data/bpe_tokenizer.cpp, hf_tokenizer.cpp) against the reference libraries:
// tests/golden/tokenizers/<name>/ hold small tokenizers in the Qwen2, DeepSeek-V3, GPT-2, Digits and Kimi
// (tiktoken) formats and the ids `tokenizers` / `tiktoken` give for hard texts (tools/ref/make_tokenizer_golden.py).
// Every id must be equal, decode must give the library's text back, and decode(encode(x)) == x wherever the
// tokenizer does not normalize x. Then the refusals: every unsupported or malformed file is one clear error.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include "core/file.h"
#include "core/json.h"
#include "train/data/hf_tokenizer.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using train::HfTokenizer;
using train::load_hf_tokenizer;

std::string golden_dir(const std::string& name) { return test::golden_path("tokenizers/" + name); }

// Where two id lists first differ, for a failure message.
std::string first_difference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    return fmt::format("lengths {} vs {}, first difference at {}: {} vs {}", a.size(), b.size(), i,
                       i < a.size() ? std::to_string(a[i]) : "end", i < b.size() ? std::to_string(b[i]) : "end");
}

class GoldenTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTokenizer, IdsEqualTheReferenceLibraryAndDecodeRoundTrips) {
    HfTokenizer t = load_hf_tokenizer(golden_dir(GetParam()));
    const Json expected = parse_json(read_text(golden_dir(GetParam()) + "/expected.json"), "expected.json");
    const Json& texts = expected["texts"];
    ASSERT_GT(texts.size(), 20u);
    int checked_round_trips = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
        const std::string text = texts[i].get<std::string>();
        const std::vector<int32_t> want = expected["ids"][i].get<std::vector<int32_t>>();
        std::vector<int32_t> ids;
        t.bpe.encode(text, ids);
        EXPECT_EQ(ids, want) << GetParam() << " text " << i << " " << excerpt(text) << ": "
                             << first_difference(ids, want);
        const std::string decoded = expected["decoded"][i].get<std::string>();
        EXPECT_EQ(t.bpe.decode(want), decoded) << GetParam() << " text " << i;
        if (decoded == text) {  // the text is unchanged by the tokenizer's normalizer
            EXPECT_EQ(t.bpe.decode(ids), text) << GetParam() << " text " << i;
            ++checked_round_trips;
        }
    }
    EXPECT_GE(checked_round_trips, int(texts.size()) - 1);  // only Qwen's NFC changes one text (combining marks)
}

INSTANTIATE_TEST_SUITE_P(Families,
                         GoldenTokenizer,
                         ::testing::Values("qwen2", "deepseek_v3", "gpt2", "digits", "kimi"));

TEST(HfTokenizer, ConfigTokensAndVocabularySizes) {
    HfTokenizer qwen = load_hf_tokenizer(golden_dir("qwen2"));
    EXPECT_EQ(qwen.source, golden_dir("qwen2") + "/tokenizer.json");
    EXPECT_EQ(qwen.eos, qwen.bpe.token_id("<|endoftext|>"));
    EXPECT_EQ(qwen.eos, 1500);  // the specials come after the 1500-token vocabulary, as in Qwen's file
    EXPECT_FALSE(qwen.bos.has_value());
    EXPECT_FALSE(qwen.add_bos);
    EXPECT_EQ(qwen.bpe.vocab_size(), 1505);
    HfTokenizer ds = load_hf_tokenizer(golden_dir("deepseek_v3"));
    EXPECT_TRUE(ds.add_bos);
    EXPECT_EQ(ds.bos, 0);
    EXPECT_EQ(ds.eos, 1);
    HfTokenizer kimi = load_hf_tokenizer(golden_dir("kimi"));
    EXPECT_EQ(kimi.source, golden_dir("kimi") + "/tiktoken.model");
    const int64_t base = kimi.bpe.vocab_size() - 258;  // 256 reserved + 2, as tokenization_kimi.py builds them
    EXPECT_EQ(kimi.bos, base);
    EXPECT_EQ(kimi.eos, base + 1);
    EXPECT_EQ(kimi.bpe.token_id(fmt::format("<|reserved_token_{}|>", base + 5)), base + 5);
    EXPECT_EQ(kimi.bpe.token_id("<|im_end|>"), base + 2);
    std::vector<int32_t> ids;
    kimi.bpe.encode(fmt::format("a<|reserved_token_{}|>b", base + 257), ids);
    EXPECT_EQ(ids.size(), 3u);
    EXPECT_EQ(ids[1], base + 257);
}

TEST(HfTokenizer, ByteLevelAlphabetIsGpt2s) {
    EXPECT_EQ(train::byte_level_char(' '), U'\u0120');   // "Ġ"
    EXPECT_EQ(train::byte_level_char('\n'), U'\u010A');  // "Ċ"
    EXPECT_EQ(train::byte_level_char('a'), U'a');
    EXPECT_EQ(train::byte_level_char(0xAD), U'\u0143');  // the soft hyphen is the last of the 68 moved bytes
    for (int b = 0; b < 256; ++b) EXPECT_EQ(train::byte_level_byte(train::byte_level_char(uint8_t(b))), b);
    EXPECT_EQ(train::byte_level_byte(U' '), -1);
    EXPECT_EQ(train::byte_level_byte(U'\u0144'), -1);
}

TEST(HfTokenizer, LongPiecesAreNotQuadratic) {
    HfTokenizer t = load_hf_tokenizer(golden_dir("qwen2"));
    std::string word;  // one pre-tokenizer piece of 400k letters (\p{L}+)
    for (int i = 0; i < 100000; ++i) word += "ethe";
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int32_t> ids;
    t.bpe.encode(word, ids);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(t.bpe.decode(ids), word);
    EXPECT_LT(s, 10.0);  // a quadratic merge loop takes minutes here; O(n log n) well under a second
}

TEST(HfTokenizer, InvalidUtf8IsRefused) {
    HfTokenizer t = load_hf_tokenizer(golden_dir("gpt2"));
    std::vector<int32_t> ids;
    test::expect_error([&] { t.bpe.encode("ok \xC3\x28 no", ids); }, "not valid UTF-8 (at byte 3)");
    test::expect_error([&] { t.bpe.encode("\xED\xA0\x80", ids); }, "at byte 0");  // a surrogate
    test::expect_error([&] { t.bpe.encode("\xC0\xAF", ids); }, "at byte 0");      // overlong
    EXPECT_EQ(train::invalid_utf8_at("caf\xC3\xA9 \xF0\x9F\x91\x8D"), std::string::npos);
    test::expect_error([&] { (void)t.bpe.decode(std::vector<int32_t>{5, 99999}); }, "token id 99999 is not in");
}

TEST(HfTokenizer, PatternTranslation) {
    // \s is spelled as Unicode White_Space (PCRE2's own \s would add U+180E)
    const std::string s = train::translate_pattern(R"(\s+(?!\S)|[^\s\p{L}])", "p");
    EXPECT_EQ(s.find("\\s"), std::string::npos);
    EXPECT_EQ(s.find("\\S"), std::string::npos);
    train::Regex re(s, "p");
    std::vector<std::pair<size_t, size_t>> m;
    re.for_each_match("a \u180E\u00A0 b", [&](size_t b, size_t e) { m.emplace_back(b, e); });
    // U+180E (bytes 2-4) is no space, so the " " before it is followed by a non-space and does not match; U+180E
    // is [^\s\p{L}]; then \s+(?!\S) takes U+00A0 and leaves the " " before "b". PCRE2's own \s would match
    // bytes 1-6 as one run.
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[0], std::make_pair(size_t(2), size_t(5)));
    EXPECT_EQ(m[1], std::make_pair(size_t(5), size_t(7)));
    test::expect_error([] { train::translate_pattern(R"([\p{L}&&[^\p{Han}]])", "p"); },
                       "p: character class intersection");
    test::expect_error([] { train::translate_pattern(R"([a[b]])", "p"); }, "p: nested character classes");
    test::expect_error([] { train::translate_pattern(R"([a&&b])", "p"); }, "intersection");
    test::expect_error([] { train::translate_pattern(R"(\Qx\E)", "p"); }, "p: \\Q reads differently");
    test::expect_error([] { train::translate_pattern(R"([\S])", "p"); }, "\\S inside a character class");
    test::expect_error([] { train::Regex("(unclosed", "Split 3"); }, "Split 3: bad regex at offset");
    EXPECT_EQ(train::translate_pattern(R"([]a][^]b][[:alpha:]\]])", "p"), R"([]a][^]b][[:alpha:]\]])");
}

// A copy of the qwen2 golden tokenizer.json with one change, in a directory of its own.
std::string qwen_with(const test::TempDir& d, const std::function<void(Json&)>& change) {
    Json j = parse_json(read_text(golden_dir("qwen2") + "/tokenizer.json"), "qwen2");
    change(j);
    std::ofstream(d.file("tokenizer.json")) << j.dump();
    return d.path();
}

TEST(HfTokenizer, UnsupportedOrMalformedFilesAreOneLineErrors) {
    const std::vector<std::pair<std::function<void(Json&)>, std::string>> cases = {
        {[](Json& j) { j["model"]["type"] = "Unigram"; }, "model type \"Unigram\" is not supported"},
        {[](Json& j) {
             j["normalizer"] = Json{{"type", "NFKC"}};
         },
         "normalizer NFKC is not supported"},
        {[](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
         "Split behavior \"Removed\" is not supported"},
        {[](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }, "invert true is not supported"},
        {[](Json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
         "add_prefix_space true is not supported"},
        {[](Json& j) {
             j["pre_tokenizer"] = Json{{"type", "Metaspace"}};
         },
         "pre-tokenizer Metaspace is not supported"},
        {[](Json& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; }, "has no ByteLevel step"},
        {[](Json& j) {
             j["pre_tokenizer"]["pretokenizers"].push_back(Json{{"type", "Digits"}});
         },
         "Digits after ByteLevel"},
        {[](Json& j) {
             j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = Json{{"Regex", "(a"}};
         },
         "bad regex"},
        {[](Json& j) {
             j["model"]["merges"][7] = Json::array({"Ġ", "nope"});
         },
         "merges[7]: \"nope\" is not in"},
        {[](Json& j) { j["model"]["merges"][7] = "a b c"; }, "merges[7]: \"a b c\" is not two tokens"},
        {[](Json& j) {  // the byte 0x00's token renamed (the vocabulary keeps its size)
             j["model"]["vocab"]["\u0100\u0100\u0100"] = j["model"]["vocab"]["\u0100"];
             j["model"]["vocab"].erase("\u0100");
         },
         "no token for the byte 0x00"},
        {[](Json& j) { j["model"]["dropout"] = 0.1; }, "BPE dropout 0.1 is not supported"},
        {[](Json& j) { j["added_tokens"][1]["lstrip"] = true; }, "<|im_start|> with lstrip true is not supported"},
        {[](Json& j) {
             j["decoder"] = Json{{"type", "WordPiece"}};
         },
         "decoder WordPiece is not supported"},
        {[](Json& j) { j["model"]["vocab"]["zzz"] = 5; }, "id 5 is given to two tokens"},
        // the tokenizers library ignores the ids of added tokens (those outside the vocabulary follow it in order)
        {[](Json& j) { j["added_tokens"][0]["id"] = 70000; },
         "<|endoftext|> has id 70000, but the tokenizers library gives it 1500"},
        {[](Json& j) { std::swap(j["added_tokens"][0]["id"], j["added_tokens"][1]["id"]); }, "gives it 1500"},
        {[](Json& j) { j["added_tokens"][1]["content"] = "<|endoftext|>"; }, "<|endoftext|> is added twice"},
    };
    for (auto& [change, needle] : cases) {
        test::TempDir d;
        const std::string dir = qwen_with(d, change);
        test::expect_error([&] { load_hf_tokenizer(dir); }, needle);
        try {
            load_hf_tokenizer(dir);
        } catch (const Error& e) {
            EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(d.file("tokenizer.json")), std::string::npos) << e.what();
        }
    }
    test::TempDir d;
    std::ofstream(d.file("tokenizer.json")) << "{\"model\": ";
    test::expect_error([&] { load_hf_tokenizer(d.path()); }, "tokenizer.json: not valid JSON");
    test::expect_error([&] { load_hf_tokenizer(d.file("nothing")); }, "not a directory");
    test::TempDir empty;
    test::expect_error([&] { load_hf_tokenizer(empty.path()); }, "holds neither tokenizer.json nor tiktoken.model");
}

TEST(HfTokenizer, BadTiktokenAndConfigFilesAreOneLineErrors) {
    const std::string model = read_text(golden_dir("kimi") + "/tiktoken.model");
    const std::string config = read_text(golden_dir("kimi") + "/tokenizer_config.json");
    auto dir_with = [&](const test::TempDir& d, const std::string& m, const std::string& c) {
        std::ofstream(d.file("tiktoken.model")) << m;
        if (!c.empty()) std::ofstream(d.file("tokenizer_config.json")) << c;
        return d.path();
    };
    {
        test::TempDir d;
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, model, "")); }, "needs tokenizer_config.json");
    }
    {
        test::TempDir d;
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, "IQ== 0\nIg== 1\n@@@@ 2\n", config)); },
                           "tiktoken.model:3: \"@@@@\" is not base64");
    }
    {
        test::TempDir d;
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, "IQ== 0\nIg== x1\n", config)); },
                           "tiktoken.model:2: bad rank \"x1\"");
    }
    {
        test::TempDir d;
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, "IQ== 0\nIQ== 1\n", config)); },
                           "tiktoken.model:2: the same bytes as the token of rank 0");
    }
    {
        test::TempDir d;
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, "IQ== 0\nIg== 1\n", "{}")); },
                           "no token for the byte 0x00");
    }
    {
        test::TempDir d;
        Json c = parse_json(config, "c");
        c["eos_token"] = "<|not_there|>";
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, model, c.dump())); },
                           "eos_token \"<|not_there|>\" is not a token of");
    }
    {
        test::TempDir d;
        Json c = parse_json(config, "c");
        c["added_tokens_decoder"]["3"] = Json{{"content", "<x>"}};
        test::expect_error([&] { load_hf_tokenizer(dir_with(d, model, c.dump())); },
                           "added_tokens_decoder[3]: Kimi's special tokens take the ids");
    }
}

}  // namespace
}  // namespace tessera
