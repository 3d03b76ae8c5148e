// Supervised data: JSON Lines examples (every bad line one error with its file and line, nothing written), shards
// with a loss mask (prompt tokens are no targets), the loader's targets (kIgnoreIndex exactly where the target token
// is a prompt token), shards tokenized by a checkpoint's tokenizer (bos / eos, u16 or i32), and the loss with
// ignored targets (a hand-computed value; ignored rows have zero gradient and do not move the loss).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/file.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "model/model.h"
#include "ops/cross_entropy.h"
#include "train/data/hf_tokenizer.h"
#include "train/data/jsonl.h"
#include "train/data/loader.h"
#include "train/data/token_source.h"
#include "train/data/tokenizer.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using train::ByteTokenizer;
constexpr int32_t kIgnore = model::Model::kIgnoreIndex;

std::vector<std::string> files_in(const std::string& dir) {
    std::vector<std::string> names;
    for (auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
}

std::vector<int32_t> tokens_of(const train::TokenSource& s) {
    std::vector<int32_t> t(size_t(s.size()));
    for (int64_t i = 0; i < s.size(); ++i) t[size_t(i)] = s[i];
    return t;
}
std::vector<int> mask_of(const train::TokenSource& s) {
    std::vector<int> m(size_t(s.size()));
    for (int64_t i = 0; i < s.size(); ++i) m[size_t(i)] = s.is_target(i);
    return m;
}

TEST(Jsonl, GoodLinesReadBack) {
    test::TempDir d;
    std::ofstream(d.file("a.jsonl")) << "{\"text\": \"abc\"}\r\n"
                                     << "{\"prompt\": \"Q: 1+1?\", \"completion\": \" 2\"}\n"
                                     << "{\"completion\": \"x\", \"prompt\": \"\"}";  // no final newline
    const std::vector<train::Example> e = train::read_jsonl(d.file("a.jsonl"));
    ASSERT_EQ(e.size(), 3u);
    EXPECT_EQ(e[0].completion, "abc");
    EXPECT_FALSE(e[0].supervised);
    EXPECT_EQ(e[1].prompt, "Q: 1+1?");
    EXPECT_EQ(e[1].completion, " 2");
    EXPECT_TRUE(e[1].supervised);
    EXPECT_TRUE(e[2].supervised);
    EXPECT_EQ(e[2].prompt, "");
}

TEST(Jsonl, EachBadLineIsOneErrorNamingTheLineAndNothingIsWritten) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"{\"text\": \"a\"", "data.jsonl:2: not valid JSON"},
        {"{\"text\": \"a\"} {\"text\": \"b\"}", "data.jsonl:2: not valid JSON"},
        {"{\"text\": \"\xff\"}", "data.jsonl:2: not valid JSON"},  // not UTF-8
        {"[\"text\"]", "data.jsonl:2: expected an object with \"text\", or \"prompt\" and \"completion\""},
        {"{\"text\": 5}", "data.jsonl:2: \"text\" must be a string, not 5"},
        {"{\"prompt\": null, \"completion\": \"a\"}", "data.jsonl:2: \"prompt\" must be a string, not null"},
        {"{\"txt\": \"a\"}", "data.jsonl:2: unknown key \"txt\""},
        {"{\"text\": \"a\", \"prompt\": \"b\", \"completion\": \"c\"}", "data.jsonl:2: \"text\" together with"},
        {"{\"prompt\": \"a\"}", "data.jsonl:2: \"prompt\" without \"completion\""},
        {"{\"completion\": \"a\"}", "data.jsonl:2: \"completion\" without \"prompt\""},
        {"{\"prompt\": \"a\", \"completion\": \"\"}", "data.jsonl:2: \"completion\" is empty"},
        {"{\"text\": \"\"}", "data.jsonl:2: \"text\" is empty"},
        {"", "data.jsonl:2: an empty line"},
        {"  \t", "data.jsonl:2: an empty line"},
    };
    for (auto& [line, needle] : cases) {
        test::TempDir d;
        std::ofstream(d.file("data.jsonl")) << "{\"text\": \"fine\"}\n" << line << "\n{\"text\": \"also fine\"}\n";
        test::expect_error([&] { train::write_token_shard({d.file("data.jsonl")}, d.file("out.safetensors")); },
                           d.file(needle));
        try {
            train::write_token_shard({d.file("data.jsonl")}, d.file("out.safetensors"));
        } catch (const Error& e) {
            EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
        }
        EXPECT_EQ(files_in(d.path()), std::vector<std::string>{"data.jsonl"}) << "for " << needle;
    }
    test::TempDir d;
    std::ofstream(d.file("empty.jsonl")) << "";
    test::expect_error([&] { train::read_jsonl(d.file("empty.jsonl")); }, "empty.jsonl: no examples");
    std::ofstream(d.file("trailing.jsonl")) << "{\"text\": \"a\"}\n\n";
    test::expect_error([&] { train::read_jsonl(d.file("trailing.jsonl")); }, "trailing.jsonl:2: an empty line");
}

TEST(SupervisedShard, ByteTokenizerMaskMarksCompletionAndEndTokens) {
    test::TempDir d;
    std::ofstream(d.file("a.jsonl")) << "{\"prompt\": \"ab\", \"completion\": \"cd\"}\n{\"text\": \"ef\"}\n";
    std::ofstream(d.file("b.txt")) << "g";
    const train::ShardInfo info = train::write_token_shard({d.path()}, d.file("s.safetensors"));
    EXPECT_EQ(info.num_tokens, 10);
    EXPECT_EQ(info.num_documents, 3);
    EXPECT_EQ(info.num_targets, 8);
    const train::TokenSource src(d.file("s.safetensors"));
    const int32_t E = ByteTokenizer::kEndOfText;
    EXPECT_EQ(tokens_of(src), (std::vector<int32_t>{'a', 'b', 'c', 'd', E, 'e', 'f', E, 'g', E}));
    EXPECT_EQ(mask_of(src), (std::vector<int>{0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
    EXPECT_TRUE(src.has_loss_mask());
    EXPECT_EQ(src.end_of_document(), E);
    const SafetensorsFile f(d.file("s.safetensors"));
    EXPECT_EQ(f.entry("loss_mask").dtype, DType::u8);
    EXPECT_EQ(f.metadata().at("tokenizer"), "byte");
}

TEST(SupervisedShard, TextOnlyShardsAreWrittenAsBeforeWithoutAMask) {
    test::TempDir d;
    std::ofstream(d.file("a.txt")) << "abc";
    std::ofstream(d.file("b.jsonl")) << "{\"text\": \"de\"}\n";
    train::write_token_shard({d.path()}, d.file("s.safetensors"));
    const SafetensorsFile f(d.file("s.safetensors"));
    EXPECT_FALSE(f.contains("loss_mask"));
    std::vector<std::string> keys;
    for (auto& [k, v] : f.metadata()) keys.push_back(k);
    EXPECT_EQ(keys, (std::vector<std::string>{"crc32c", "num_documents", "tokenizer", "vocab_size"}));
    const train::TokenSource src(d.file("s.safetensors"));
    EXPECT_FALSE(src.has_loss_mask());
    EXPECT_EQ(src.max_token(), ByteTokenizer::kEndOfText);
}

// Every window the loader gives in one epoch, and every evaluation window, against the stream and its mask.
TEST(SupervisedShard, LoaderIgnoresExactlyTheTargetsThatArePromptTokens) {
    test::TempDir d;
    {
        std::ofstream f(d.file("sft.jsonl"));
        for (int i = 0; i < 40; ++i) {
            f << fmt::format("{{\"prompt\": \"{}\", \"completion\": \"{}\"}}\n", std::string(size_t(1 + i % 7), 'p'),
                             std::string(size_t(1 + i % 5), 'c'));
            if (i % 9 == 0) f << "{\"text\": \"plain text\"}\n";
        }
    }
    train::write_token_shard({d.file("sft.jsonl")}, d.file("s.safetensors"));
    const train::TokenSource src(d.file("s.safetensors"));
    const int64_t L = 8, B = 2;
    auto expected_window = [&](int64_t start) {
        std::vector<int32_t> w;
        for (int64_t t = 0; t < L; ++t) w.push_back(src[start + t]);
        for (int64_t t = 0; t < L; ++t) w.push_back(src.is_target(start + t + 1) ? src[start + t + 1] : kIgnore);
        return w;
    };
    train::DataLoader loader(src, L, B, 0.25, 11);
    const int64_t windows = loader.num_train_windows();
    std::vector<std::vector<int32_t>> seen, all;
    std::vector<int32_t> ids(size_t(B * L)), targets(size_t(B * L));
    for (int64_t step = 0; step < windows / B; ++step) {  // one epoch: each window at most once
        loader.next_batch(ids, targets);
        for (int64_t b = 0; b < B; ++b) {
            std::vector<int32_t> w(ids.begin() + b * L, ids.begin() + (b + 1) * L);
            w.insert(w.end(), targets.begin() + b * L, targets.begin() + (b + 1) * L);
            seen.push_back(w);
        }
    }
    int64_t ignored = 0, counted = 0;
    for (int64_t w = 0; w < windows; ++w) {
        all.push_back(expected_window(w * L));
        for (int64_t t = L; t < 2 * L; ++t) (all.back()[size_t(t)] == kIgnore ? ignored : counted)++;
    }
    std::sort(seen.begin(), seen.end());
    std::sort(all.begin(), all.end());
    EXPECT_TRUE(std::includes(all.begin(), all.end(), seen.begin(), seen.end()));  // as multisets
    EXPECT_GT(ignored, 50);
    EXPECT_GT(counted, 50);
    ASSERT_GT(loader.num_eval_batches(), 0);
    const int64_t train_tokens = int64_t(double(src.size()) * 0.75);
    for (int64_t i = 0; i < loader.num_eval_batches(); ++i) {
        loader.eval_batch(i, ids, targets);
        for (int64_t b = 0; b < B; ++b) {
            std::vector<int32_t> w(ids.begin() + b * L, ids.begin() + (b + 1) * L);
            w.insert(w.end(), targets.begin() + b * L, targets.begin() + (b + 1) * L);
            EXPECT_EQ(w, expected_window(train_tokens + (i * B + b) * L)) << "eval batch " << i << " row " << b;
        }
    }
}

TEST(SupervisedShard, CheckpointTokenizersAddBosAndTheirEndOfText) {
    test::TempDir d;
    std::ofstream(d.file("a.jsonl")) << "{\"prompt\": \"Question: café?\", \"completion\": \" Yes, 2024.\"}\n"
                                     << "{\"text\": \"中文 text\"}\n";
    auto encode = [](train::HfTokenizer& t, const std::string& s) {
        std::vector<int32_t> ids;
        t.bpe.encode(s, ids);
        return ids;
    };
    for (const std::string name : {"qwen2", "deepseek_v3", "kimi"}) {
        const std::string dir = test::golden_path("tokenizers/" + name);
        train::HfTokenizer t = train::load_hf_tokenizer(dir);
        const train::ShardInfo info =
            train::write_token_shard({d.file("a.jsonl")}, d.file(name + ".safetensors"), {.tokenizer = dir});
        std::vector<int32_t> want;
        std::vector<int> mask;
        auto add = [&](const std::vector<int32_t>& ids, int m) {
            want.insert(want.end(), ids.begin(), ids.end());
            mask.insert(mask.end(), ids.size(), m);
        };
        if (t.add_bos) add({*t.bos}, 0);
        add(encode(t, "Question: café?"), 0);
        add(encode(t, " Yes, 2024."), 1);
        add({*t.eos}, 1);
        if (t.add_bos) add({*t.bos}, 1);
        add(encode(t, "中文 text"), 1);
        add({*t.eos}, 1);
        const train::TokenSource src(d.file(name + ".safetensors"));
        EXPECT_EQ(tokens_of(src), want) << name;
        EXPECT_EQ(mask_of(src), mask) << name;
        EXPECT_EQ(src.end_of_document(), *t.eos) << name;
        EXPECT_EQ(src.vocab_size(), t.bpe.vocab_size()) << name;
        EXPECT_EQ(info.tokenizer, t.source);
        const SafetensorsFile f(d.file(name + ".safetensors"));
        EXPECT_EQ(f.entry("tokens").dtype, DType::u16);
        EXPECT_EQ(f.metadata().at("end_of_document"), std::to_string(*t.eos));
    }
    const std::string qwen = test::golden_path("tokenizers/qwen2");
    train::write_token_shard({d.file("a.jsonl")}, d.file("eos.safetensors"), {.tokenizer = qwen, .eos = "<|im_end|>"});
    EXPECT_EQ(train::TokenSource(d.file("eos.safetensors")).end_of_document(), 1502);
    // a checkpoint directory of any model: its config.json (no image tower) is not read
    std::filesystem::create_directories(d.file("qwen2_ckpt"));
    for (const auto& e : std::filesystem::directory_iterator(qwen))
        std::filesystem::copy_file(e.path(), d.file("qwen2_ckpt") + "/" + e.path().filename().string());
    write_text_atomic(d.file("qwen2_ckpt/config.json"), R"({"model_type": "qwen2", "hidden_size": 64})");
    train::write_token_shard({d.file("a.jsonl")}, d.file("ckpt.safetensors"),
                             {.tokenizer = d.file("qwen2_ckpt"), .eos = "<|im_end|>"});
    EXPECT_TRUE(test::bitwise_equal(SafetensorsFile(d.file("ckpt.safetensors")).load("tokens").view(),
                                    SafetensorsFile(d.file("eos.safetensors")).load("tokens").view()));
}

TEST(SupervisedShard, LargeVocabulariesGiveI32TokensAndBadOptionsAreRefused) {
    test::TempDir d;
    std::ofstream(d.file("a.txt")) << "hello <|endoftext|> world";
    // the qwen2 tokenizer with 68,500 more (unreachable) vocabulary entries: the added tokens move to 70000..
    Json j = parse_json(read_text(test::golden_path("tokenizers/qwen2/tokenizer.json")), "qwen2");
    for (int k = 0; k < 68500; ++k) j["model"]["vocab"][fmt::format("\u0100{}", k)] = 1500 + k;
    for (auto& t : j["added_tokens"]) t["id"] = t["id"].get<int>() + 68500;
    fs::create_directory(d.file("big"));
    std::ofstream(d.file("big/tokenizer.json")) << j.dump();  // no tokenizer_config.json: no eos_token
    test::expect_error(
        [&] { train::write_token_shard({d.file("a.txt")}, d.file("s.safetensors"), {.tokenizer = d.file("big")}); },
        "big: tokenizer_config.json names no eos_token; name the token that ends documents with --eos TOKEN");
    const train::ShardInfo info = train::write_token_shard({d.file("a.txt")}, d.file("s.safetensors"),
                                                           {.tokenizer = d.file("big"), .eos = "<|im_end|>"});
    EXPECT_EQ(info.vocab_size, 70005);
    EXPECT_EQ(SafetensorsFile(d.file("s.safetensors")).entry("tokens").dtype, DType::i32);
    const train::TokenSource src(d.file("s.safetensors"));
    EXPECT_EQ(src.max_token(), 70002);
    EXPECT_EQ(src[src.size() - 1], 70002);
    EXPECT_EQ(src.end_of_document(), 70002);
    const std::vector<int32_t> ids = tokens_of(src);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), 70000), 1);  // <|endoftext|> in the text
    test::expect_error(
        [&] {
            train::write_token_shard({d.file("a.txt")}, d.file("t.safetensors"),
                                     {.tokenizer = d.file("big"), .eos = "<|nope|>"});
        },
        "--eos <|nope|>: not a token of");
    test::expect_error([&] { train::write_token_shard({d.file("a.txt")}, d.file("t.safetensors"), {.eos = "x"}); },
                       "--eos goes with --tokenizer");
    std::ofstream(d.file("bad.txt")) << "ok \xff";
    test::expect_error(
        [&] {
            train::write_token_shard({d.file("bad.txt")}, d.file("t.safetensors"),
                                     {.tokenizer = test::golden_path("tokenizers/qwen2")});
        },
        "bad.txt: not valid UTF-8 at byte 3");
    EXPECT_FALSE(fs::exists(d.file("t.safetensors")));
    // a mask that is not 0/1, or of another length, is refused when read
    Tensor tokens(DType::u16, Shape{3}), mask(DType::u8, Shape{3});
    mask.ptr<uint8_t>()[1] = 2;
    write_safetensors(d.file("m.safetensors"), {{"tokens", tokens}, {"loss_mask", mask}}, {{"vocab_size", "258"}});
    test::expect_error([&] { train::TokenSource(d.file("m.safetensors")); }, "loss_mask[1] is 2, not 0 or 1");
    Tensor short_mask(DType::u8, Shape{2});
    write_safetensors(d.file("n.safetensors"), {{"tokens", tokens}, {"loss_mask", short_mask}},
                      {{"vocab_size", "258"}});
    test::expect_error([&] { train::TokenSource(d.file("n.safetensors")); }, "\"loss_mask\" must be a 1-D u8 tensor");
    write_safetensors(d.file("e.safetensors"), {{"tokens", tokens}},
                      {{"vocab_size", "258"}, {"end_of_document", "300"}});
    test::expect_error([&] { train::TokenSource(d.file("e.safetensors")); }, "end_of_document 300 is outside [0, 258)");
}

// The loss over targets with ignored rows: the mean over the counted rows only (a value computed here by hand),
// gradient zero on ignored rows, and moving an ignored row's logits leaves the loss bitwise unchanged.
TEST(LossMask, IgnoredTargetsDoNotCountInTheLossOrItsGradient) {
    const int64_t N = 4, V = 5;
    Tensor logits = test::randn(DType::f64, Shape{N, V}, 3);
    Tensor targets(DType::i32, Shape{N}), lse(DType::f64, Shape{N}), dlogits(DType::f64, Shape{N, V});
    const int32_t tg[] = {1, kIgnore, 4, kIgnore};
    std::copy(std::begin(tg), std::end(tg), targets.ptr<int32_t>());
    const ops::CrossEntropyParams p{.ignore_index = kIgnore};
    const ops::CrossEntropyResult r = ops::cross_entropy_forward(p, logits, targets, lse);
    double want = 0;
    for (int64_t n : {0, 2}) {
        const double* x = logits.ptr<double>() + n * V;
        double s = 0;
        for (int64_t v = 0; v < V; ++v) s += std::exp(x[v]);
        want += std::log(s) - x[tg[n]];
    }
    want /= 2;
    EXPECT_EQ(r.count, 2);
    EXPECT_NEAR(r.loss, want, 1e-12);
    ops::cross_entropy_backward(p, 1.0, logits, targets, lse, dlogits);
    const double* g = dlogits.ptr<double>();
    for (int64_t n : {1, 3}) {
        for (int64_t v = 0; v < V; ++v) EXPECT_EQ(g[n * V + v], 0.0) << "row " << n;
    }
    for (int64_t n = 0; n < N; ++n) {  // central differences against the analytic gradient
        for (int64_t v = 0; v < V; ++v) {
            double& x = logits.ptr<double>()[n * V + v];
            const double x0 = x, h = 1e-5;
            x = x0 + h;
            const double up = ops::cross_entropy_forward(p, logits, targets, lse).loss;
            x = x0 - h;
            const double down = ops::cross_entropy_forward(p, logits, targets, lse).loss;
            x = x0;
            if (tg[n] == kIgnore) {
                EXPECT_EQ(up, r.loss);
                EXPECT_EQ(down, r.loss);
            } else {
                EXPECT_NEAR((up - down) / (2 * h), g[n * V + v], 1e-8);
            }
        }
    }
}

}  // namespace
}  // namespace tessera
