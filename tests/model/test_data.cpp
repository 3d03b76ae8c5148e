// The data pipeline: byte tokenizer, token shards (written, mapped, validated), the deterministic
// loader (same seed, same batches; resumable position; fixed eval batches), document boundaries.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <fstream>
#include <map>

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

// A shard with images (token_source.h): each window's images are the ones whose tokens it meets, with the rows of
// each that fall inside it, and their whole patches; a shard whose image spans are wrong is refused in one line.
TEST(Loader, WindowsTakeTheRowsOfTheImagesTheyCut) {
    test::TempDir d;
    const int32_t kImage = 9;
    std::vector<uint16_t> ids(101);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t(10 + i % 40);
    // images A [55, 63) and B [63, 65) back to back, C [78, 92) across three windows; patches of 2 values
    const std::vector<std::array<int64_t, 4>> images = {
        {2, 4, 55, 8}, {1, 2, 63, 2}, {4, 4, 78, 14}};  // h, w, first, n
    std::vector<int32_t> grids;
    std::vector<int64_t> spans;
    std::vector<float> patches;
    for (size_t k = 0; k < images.size(); ++k) {
        const auto [h, w, first, n] = images[k];
        grids.insert(grids.end(), {int32_t(h), int32_t(w)});
        spans.insert(spans.end(), {first, n});
        for (int64_t t = first; t < first + n; ++t) ids[size_t(t)] = kImage;
        for (int64_t p = 0; p < 2 * h * w; ++p) patches.push_back(float(100 * (k + 1) + p));
    }
    auto write = [&](const std::string& name) {
        write_safetensors(
            d.file(name),
            {{"tokens", TensorView(ids.data(), DType::u16, Shape{int64_t(ids.size())})},
             {"image_patches", TensorView(patches.data(), DType::f32, Shape{int64_t(patches.size()) / 2, 2})},
             {"image_grids", TensorView(grids.data(), DType::i32, Shape{3, 2})},
             {"image_tokens", TensorView(spans.data(), DType::i64, Shape{3, 2})}},
            {{"vocab_size", "64"}, {"image_token", std::to_string(kImage)}});
    };
    write("img.safetensors");
    const train::TokenSource src(d.file("img.safetensors"));
    ASSERT_EQ(src.images().size(), 3u);
    // val_fraction 0.5: the evaluation windows of 10 tokens start at 50, 60, 70, 80 and 90
    train::DataLoader loader(src, 10, 1, 0.5, 1);
    ASSERT_EQ(loader.num_eval_batches(), 5);
    std::vector<int32_t> in(10), tgt(10);
    train::ImageBatch batch;
    // window -> (image, rows begin, rows end) in order
    const std::vector<std::vector<std::array<int64_t, 3>>> want = {
        {{0, 0, 5}}, {{0, 5, 8}, {1, 0, 2}}, {{2, 0, 2}}, {{2, 2, 12}}, {{2, 12, 14}}};
    for (int64_t w = 0; w < 5; ++w) {
        loader.eval_batch(w, in, tgt, &batch);
        ASSERT_EQ(batch.grids.size(), want[size_t(w)].size()) << "window " << w;
        std::vector<float> patches_want;
        for (size_t k = 0; k < want[size_t(w)].size(); ++k) {
            const auto [image, begin, end] = want[size_t(w)][k];
            const auto [h, w_, first, n] = images[size_t(image)];
            EXPECT_EQ(batch.grids[k].h, h);
            EXPECT_EQ(batch.grids[k].w, w_);
            EXPECT_EQ(batch.rows[k].begin, begin) << "window " << w;
            EXPECT_EQ(batch.rows[k].end, end) << "window " << w;
            for (int64_t p = 0; p < 2 * h * w_; ++p) patches_want.push_back(float(100 * (image + 1) + p));
        }
        EXPECT_EQ(batch.patches, patches_want) << "window " << w;
        int64_t tokens = 0;  // the image tokens of the window are the rows it takes
        for (int32_t id : in) tokens += id == kImage;
        int64_t rows = 0;
        for (const ops::ImageRows& r : batch.rows) rows += r.end - r.begin;
        EXPECT_EQ(tokens, rows) << "window " << w;
    }
    // a step over all ten windows: each window's images, an image two windows cut in both (the tower's work)
    train::DataLoader all(src, 10, 10, 0.0, 1);
    std::vector<ops::PatchGrid> step;
    all.step_images(step);
    std::map<std::pair<int64_t, int64_t>, int> seen;
    for (const ops::PatchGrid& g : step) ++seen[{g.h, g.w}];
    EXPECT_EQ(seen, (std::map<std::pair<int64_t, int64_t>, int>{{{2, 4}, 2}, {{1, 2}, 1}, {{4, 4}, 3}}));
    // spans that do not hold the image token, or overlap
    spans[0] = 54;
    write("bad1.safetensors");
    test::expect_error([&] { train::TokenSource(d.file("bad1.safetensors")); },
                       "image 0's token 54 is 24, not the image token 9");
    spans[0] = 55;
    spans[2] = 62;
    write("bad2.safetensors");
    test::expect_error([&] { train::TokenSource(d.file("bad2.safetensors")); },
                       "image 1's 2 tokens from 62 are not after the image before it");
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
