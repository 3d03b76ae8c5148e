// The data pipeline: byte tokenizer, token shards (written, mapped, validated), the deterministic
// loader (same seed, same batches; resumable position; fixed eval batches), document boundaries.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "train/data/loader.h"
#include "train/data/tokenizer.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using train::ByteTokenizer;

TEST(Tokenizer, BytesRoundTripAndSpecialsAreNamed) {
    std::vector<int32_t> ids;
    ByteTokenizer::encode("h\xc3\xa9!", ids);
    EXPECT_EQ(ids, (std::vector<int32_t>{'h', 0xc3, 0xa9, '!'}));
    EXPECT_EQ(ByteTokenizer::decode(ids), "h\xc3\xa9!");
    const int32_t specials[] = {ByteTokenizer::kEndOfText, ByteTokenizer::kPad, 999};
    EXPECT_EQ(ByteTokenizer::decode(specials), "<|endoftext|><|pad|><?>");
}

TEST(Shard, WrittenShardsReadBackAndBadOnesAreRefused) {
    test::TempDir d;
    std::ofstream(d.file("a.txt")) << "abc";
    std::ofstream(d.file("b.txt")) << "de";
    train::ShardInfo info = train::write_token_shard({d.path()}, d.file("s.safetensors"));
    EXPECT_EQ(info.num_tokens, 7);  // "abc" EOT "de" EOT
    EXPECT_EQ(info.num_documents, 2);
    train::TokenSource src(d.file("s.safetensors"));
    ASSERT_EQ(src.size(), 7);
    EXPECT_EQ(src[2], 'c');
    EXPECT_EQ(src[3], ByteTokenizer::kEndOfText);
    EXPECT_EQ(src[6], ByteTokenizer::kEndOfText);
    Tensor bad(DType::u16, Shape{3});
    bad.ptr<uint16_t>()[1] = 9000;
    write_safetensors(d.file("bad.safetensors"), {{"tokens", bad}}, {{"vocab_size", "258"}});
    EXPECT_THROW(train::TokenSource(d.file("bad.safetensors")), Error);  // id outside the vocabulary
    write_safetensors(d.file("novocab.safetensors"), {{"tokens", bad}});
    EXPECT_THROW(train::TokenSource(d.file("novocab.safetensors")), Error);
    EXPECT_THROW(train::TokenSource(d.file("missing")), Error);
    Tensor ok(DType::u16, Shape{3});
    write_safetensors(d.file("junk.safetensors"), {{"tokens", ok}}, {{"vocab_size", "258abc"}});
    test::expect_error([&] { train::TokenSource(d.file("junk.safetensors")); }, "bad vocab_size '258abc'");
    // a valid shard whose data section starts at an odd offset (another writer, no header padding): read a copy
    // ("not aligned for u16; use load()" before)
    const std::string header = R"({"tokens":{"dtype":"U16","shape":[3],"data_offsets":[0,6]},)"
                               R"("__metadata__":{"vocab_size":"258"}})";
    ASSERT_EQ(header.size() % 2, 1u);
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    bytes += header + std::string("\x01\x00\x02\x00\x03\x00", 6);
    std::ofstream(d.file("odd.safetensors"), std::ios::binary) << bytes;
    train::TokenSource odd(d.file("odd.safetensors"));
    ASSERT_EQ(odd.size(), 3);
    EXPECT_EQ(odd[2], 3);
}

TEST(Loader, SameSeedSameBatchesAndPositionsResume) {
    test::TempDir d;
    std::string text;
    for (int i = 0; i < 3000; ++i) text += char('a' + i % 26);
    std::ofstream(d.file("t.txt")) << text;
    train::TokenSource src(d.file("t.txt"));
    train::DataLoader a(src, 16, 4, 0.1, 7), b(src, 16, 4, 0.1, 7), c(src, 16, 4, 0.1, 8);
    std::vector<int32_t> ia(64), ta(64), ib(64), tb(64);
    for (int step = 0; step < 100; ++step) {  // several epochs
        a.next_batch(ia, ta);
        b.next_batch(ib, tb);
        ASSERT_EQ(ia, ib) << "step " << step;
        for (int i = 0; i < 64; ++i) {
            if (i % 16 != 15) {
                ASSERT_EQ(ta[size_t(i)], ia[size_t(i) + 1]);  // targets are the next tokens
            }
        }
    }
    c.next_batch(ib, tb);
    train::DataLoader fresh(src, 16, 4, 0.1, 7);
    fresh.next_batch(ia, ta);
    EXPECT_NE(ia, ib) << "another seed gives another order";
    train::DataLoader resumed(src, 16, 4, 0.1, 7);
    resumed.set_position(a.position());
    a.next_batch(ia, ta);
    resumed.next_batch(ib, tb);
    EXPECT_EQ(ia, ib);
    ASSERT_GT(a.num_eval_batches(), 0);
    a.eval_batch(0, ia, ta);
    b.eval_batch(0, ib, tb);
    EXPECT_EQ(ia, ib);
    EXPECT_EQ(ia[0], int32_t(text[size_t(2700)]));  // eval reads the held-out tail in order
}

// W ranks with A micro-batches each read what one loader with W·A micro-batches reads, micro-batch-major
// (rank r's micro-batch m is the single loader's m·W + r), across epoch boundaries, and their position
// between steps is that loader's.
TEST(Loader, RanksShareEachStepsWindowsMicroBatchMajor) {
    test::TempDir d;
    std::string text;
    for (int i = 0; i < 3000; ++i) text += char('a' + (i * 7) % 26);
    std::ofstream(d.file("t.txt")) << text;
    train::TokenSource src(d.file("t.txt"));
    const int W = 3, A = 2, mb = 2, T = 16;  // 168 training windows: an epoch ends inside a step
    train::DataLoader one(src, T, mb, 0.1, 7, {0, 1, W * A});
    std::vector<train::DataLoader> ranks;
    for (int r = 0; r < W; ++r) ranks.emplace_back(src, T, mb, 0.1, 7, train::DataShard{r, W, A});
    std::vector<int32_t> i1(mb * T), t1(mb * T), ir(mb * T), tr(mb * T);
    for (int step = 0; step < 40; ++step) {
        std::vector<std::vector<int32_t>> want;
        for (int k = 0; k < W * A; ++k) {
            one.next_batch(i1, t1);
            want.push_back(i1);
        }
        for (int r = 0; r < W; ++r) {
            for (int m = 0; m < A; ++m) {
                ranks[size_t(r)].next_batch(ir, tr);
                ASSERT_EQ(ir, want[size_t(m * W + r)]) << "step " << step << " rank " << r << " micro " << m;
            }
        }
    }
    // the position between steps is the single loader's (the last rank never reads past its share)
    EXPECT_EQ(ranks[W - 1].position().epoch, one.position().epoch);
    EXPECT_EQ(ranks[W - 1].position().cursor, one.position().cursor);
    ranks[0].next_batch(ir, tr);
    EXPECT_THROW(ranks[0].position(), Error) << "mid-step: no position to save";
}

TEST(Loader, DocumentStartsFollowEndOfTextTokens) {
    const int32_t E = ByteTokenizer::kEndOfText;
    const std::vector<int32_t> ids = {1, E, 2, 3, /*row 2*/ E, 4, 5, E};
    std::vector<int64_t> cu(9);
    const int64_t n = train::document_starts(ids, 2, 4, E, cu);
    cu.resize(size_t(n));
    // row starts 0 and 4, after the EOTs at 1 and 4; the EOT ending a row starts nothing
    EXPECT_EQ(cu, (std::vector<int64_t>{0, 2, 4, 5, 8}));
}

}  // namespace
}  // namespace tessera
