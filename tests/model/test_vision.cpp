// Kimi K3's image tower and projector (model/vision.h) against the float64 PyTorch reference written from the spec
// (tools/ref/make_vision_golden.py): three images, one at the position table's size and two resized, through two
// blocks, the 2x2 merge and the projector; and the Hugging Face vision_config import with the spec's parameter count.
#include <gtest/gtest.h>
#include <omp.h>

#include <fstream>
#include <memory>

#include "core/arena.h"
#include "core/safetensors.h"
#include "model/hf_config.h"
#include "model/lora.h"
#include "model/runtime.h"
#include "model/vision.h"
#include "util/test_util.h"

namespace tessera {
namespace {

model::VisionConfig config_of(const Json& j) {
    model::VisionConfig c;
    c.layers = j["layers"];
    c.width = j["width"];
    c.heads = j["heads"];
    c.head_dim = j["head_dim"];
    c.ffn_dim = j["ffn_dim"];
    c.patch_size = j["patch_size"];
    c.channels = j["channels"];
    c.pos_height = j["pos_height"];
    c.pos_width = j["pos_width"];
    c.merge_h = j["merge_h"];
    c.merge_w = j["merge_w"];
    c.rope_theta = j["rope_theta"];
    c.norm_eps = j["norm_eps"];
    c.projector_eps = j["projector_eps"];
    c.text_width = j["text_width"];
    return c;
}

// The tower bound to its own arena, parameters from the golden file.
struct Rig {
    explicit Rig(const SafetensorsFile& f, int64_t max_patches, int64_t max_images)
        : tower(config_of(Json::parse(f.metadata().at("config")))) {
        std::vector<BufferSpec> specs;
        std::vector<model::ParamInit> inits;
        tower.declare_params(specs, inits);
        params = BufferGroup("params", specs);
        acts = BufferGroup("acts", tower.activation_specs(max_patches));
        ws = BufferGroup(
            "ws", {{"ws", DType::u8, Shape{int64_t(tower.workspace_bytes(max_patches, omp_get_max_threads())) + 1},
                    BufferKind::workspace}});
        arena = std::make_shared<Arena>(predict_arena_bytes({&params, &acts, &ws}, 256), 256);
        allocate_groups(arena, {&params, &acts, &ws});
        for (const BufferSpec& s : specs) convert(f.load(s.name), params.view(s.name));
        tower.bind(params, acts, std::span(ws.base(), ws.nbytes()), max_images);
    }
    model::VisionTower tower;
    BufferGroup params, acts, ws;
    std::shared_ptr<Arena> arena;
};

std::vector<ops::PatchGrid> grids_of(const SafetensorsFile& f) {
    const Tensor g = f.load("grids");
    std::vector<ops::PatchGrid> out;
    for (int64_t i = 0; i < g.shape()[0]; ++i) out.push_back({g.ptr<int64_t>()[2 * i], g.ptr<int64_t>()[2 * i + 1]});
    return out;
}

TEST(VisionTower, MatchesTheReference) {
    const SafetensorsFile f(test::golden_path("model/vision_tower.safetensors"));
    const std::vector<ops::PatchGrid> grids = grids_of(f);
    const Tensor patches = f.load("patches"), want = f.load("out");
    Rig rig(f, patches.shape()[0] + 8, 4);  // buffers larger than the call: views of their first rows
    ASSERT_EQ(rig.tower.tokens(grids), want.shape()[0]);
    Tensor out(DType::f32, want.shape());
    rig.tower.forward(grids, patches, out);
    Tensor wide(DType::f64, want.shape());
    convert(out, wide);
    EXPECT_TRUE(test::rel_rms_close(wide, want, 2e-6));
    EXPECT_TRUE(test::all_close(wide, want, 1e-4, 1e-5));

    // one image alone gives its rows of the batch: images do not see each other
    Tensor one(DType::f32, Shape{6, want.shape()[1]});
    rig.tower.forward(std::span(grids).first(1), patches.view().prefix(Shape{24, patches.shape()[1]}), one);
    Tensor first(DType::f64, one.shape());
    convert(one, first);
    EXPECT_TRUE(test::all_close(first, want.view().prefix(one.shape()), 1e-4, 1e-5));
}

TEST(VisionTower, RefusesGridsItCannotMerge) {
    const SafetensorsFile f(test::golden_path("model/vision_tower.safetensors"));
    Rig rig(f, 64, 2);
    const std::vector<ops::PatchGrid> odd{{3, 4}};
    test::expect_error([&] { (void)rig.tower.tokens(odd); }, "not whole 2x2 cells");
    const std::vector<ops::PatchGrid> many{{2, 2}, {2, 2}, {2, 2}};
    Tensor p(DType::f32, Shape{12, 12}), out(DType::f32, Shape{3, 40});
    test::expect_error([&] { rig.tower.forward(many, p, out); }, "at most 2 were bound");
}

// The tower's rows put into a language model at its image tokens (model.vision), against the reference that does
// the same in float64: logits, loss and every trained parameter's gradient; the tower frozen (no gradient buffers)
// in a model that otherwise trains in full, and the image token's embedding row getting no gradient from the
// positions the images took.
TEST(VisionModel, ImageRowsTakeTheImageTokensPlaces) {
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    const model::ModelConfig cfg =
        model::parse_model_config(Json::parse(f.metadata().at("config"))["model"], "vision_lm golden");
    ASSERT_TRUE(cfg.vision.enabled());
    model::Model m(cfg);
    EXPECT_EQ(m.frozen_params(), size_t(2 + 2 * 6 + 1 + 3));  // the tower and projector, nothing else
    for (size_t i = 0; i < m.frozen_params(); ++i) EXPECT_TRUE(model::is_vision_param(m.param_specs()[i].name));
    const model::StepShape shape{2, 24};
    model::ModelRuntime rt(m, shape, true, {});
    for (const BufferSpec& s : m.param_specs()) f.load_into("param." + s.name, rt.params().view(s.name));
    const std::vector<ops::PatchGrid> grids = grids_of(f);
    const Tensor patches = f.load("patches"), ids_t = f.load("ids"), targets_t = f.load("targets");
    const std::span<const int32_t> ids(ids_t.ptr<int32_t>(), size_t(ids_t.numel())),
        targets(targets_t.ptr<int32_t>(), size_t(targets_t.numel()));
    m.set_images(grids, patches);

    const Tensor want_logits = f.load("expected.logits");
    Tensor logits(DType::f32, want_logits.shape()), wide(DType::f64, want_logits.shape());
    m.forward_logits(shape, ids, logits);
    convert(logits, wide);
    EXPECT_TRUE(test::rel_rms_close(wide, want_logits, 1e-5));

    rt.grads().zero();
    const model::LossResult r = m.forward_backward(shape, ids, targets, 1.0);
    EXPECT_NEAR(r.loss, f.load("expected.loss").ptr<double>()[0], 1e-5);
    for (const BufferSpec& s : m.trained_specs()) {
        const Tensor want = f.load("expected.grad." + s.name);
        Tensor got(DType::f64, want.shape());
        convert(rt.grads().view(s.name), got);
        EXPECT_TRUE(test::rel_rms_close(got, want, 1e-4)) << s.name;
    }
    // windows that cut images: each image's rows inside them (the tower still sees whole images)
    const Tensor cut_t = f.load("cut.ids"), cut_rows = f.load("cut.rows"), want_cut = f.load("cut.expected.logits");
    std::vector<ops::ImageRows> rows;
    for (int64_t i = 0; i < cut_rows.shape()[0]; ++i)
        rows.push_back({cut_rows.ptr<int64_t>()[2 * i], cut_rows.ptr<int64_t>()[2 * i + 1]});
    const std::span<const int32_t> cut(cut_t.ptr<int32_t>(), size_t(cut_t.numel()));
    m.set_images(grids, patches, rows);
    m.forward_logits(shape, cut, logits);
    convert(logits, wide);
    EXPECT_TRUE(test::rel_rms_close(wide, want_cut, 1e-5));
    test::expect_error([&] { m.set_images(grids, patches, std::span(rows).first(2)); }, "rows of 2 images for 3");
    rows[2] = {0, 13};
    test::expect_error([&] { m.set_images(grids, patches, rows); }, "rows [0, 13) of image 2, which has 12");
    // text only: the same model without images refuses ids that hold image tokens
    m.set_images({}, {});
    test::expect_error([&] { m.forward_logits(shape, ids, logits); }, "the ids hold 20 image tokens");
}

// Decoding with images (generate): token by token over the caches, each image token takes the next row of the
// images, and the logits follow the float64 reference's full forward (the first sequence of the golden: images 0
// and 1 at positions 2-7 and 15-16); more image tokens than the images give is an error.
TEST(VisionModel, DecodingPlacesTheImagesRowsInOrder) {
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    const model::ModelConfig cfg =
        model::parse_model_config(Json::parse(f.metadata().at("config"))["model"], "vision_lm golden");
    model::Model m(cfg);
    const int64_t T = 24, V = cfg.vocab_size;
    BufferGroup cache("cache", m.cache_specs(1, T));
    model::ModelRuntime rt(m, {1, 1}, false, {}, {&cache});
    m.bind_cache(cache);
    for (const BufferSpec& s : m.param_specs()) f.load_into("param." + s.name, rt.params().view(s.name));
    const std::vector<ops::PatchGrid> all = grids_of(f), grids(all.begin(), all.begin() + 2);
    const Tensor patches = f.load("patches"), ids = f.load("ids"), want = f.load("expected.logits");
    m.set_images(grids, patches.view().slice0(0, grids[0].patches() + grids[1].patches()));
    Tensor logits(DType::f32, Shape{1, V}), got(DType::f64, Shape{1, V}), ref(DType::f64, Shape{1, V});
    for (int64_t pos = 0; pos < T; ++pos) {
        m.decode_step(pos, std::span(ids.ptr<int32_t>() + pos, 1), logits);
        convert(logits, got);
        std::copy_n(want.ptr<double>() + pos * V, V, ref.ptr<double>());
        EXPECT_TRUE(test::rel_rms_close(got, ref, 1e-5)) << "position " << pos;
    }
    const int32_t image = cfg.vision.image_token;
    test::expect_error([&] { m.decode_step(T - 1, std::span(&image, 1), logits); },
                       "image token 9 decoded, but the images give 8");
}

// A LoRA fine-tune with its base held in bf16 (model.lora.base_dtype) holds the tower's and projector's GEMM weights in
// bf16 too (the norms and the position table stay f32), and computes bit for bit what the f32-held model computes on
// the same weights rounded to bf16.
TEST(VisionModel, ABf16BaseHoldsTheTowersGemmWeightsInBf16) {
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    Json doc = Json::parse(f.metadata().at("config"))["model"];
    doc["lora"] = {{"rank", 2}, {"target_modules", {"o_proj"}}, {"base_dtype", "f32"}};
    const model::ModelConfig wide_cfg = model::parse_model_config(doc, "f32 base");
    doc["lora"]["base_dtype"] = "bf16";
    const model::ModelConfig narrow_cfg = model::parse_model_config(doc, "bf16 base");
    model::Model wide(wide_cfg), narrow(narrow_cfg);
    const model::StepShape shape{2, 24};
    model::ModelRuntime wrt(wide, shape, false, {}), nrt(narrow, shape, false, {});
    wide.init_params(wrt.params(), 5);  // the adapters (B = 0)
    narrow.init_params(nrt.params(), 5);
    int64_t narrowed = 0;
    for (const BufferSpec& s : narrow.param_specs()) {
        if (model::is_adapter(s.name)) continue;
        f.load_into("param." + s.name, nrt.params().view(s.name));
        f.load_into("param." + s.name, wrt.params().view(s.name));
        if (s.dtype != DType::bf16) continue;
        convert(nrt.params().view(s.name), wrt.params().view(s.name));  // the f32 model's: the same rounded values
        if (model::is_vision_param(s.name)) ++narrowed;
    }
    EXPECT_EQ(narrowed, 1 + 2 * 4 + 2);  // the patch embedding, 2 layers' wqkv, wo, fc0, fc1, the projector's two
    EXPECT_EQ(narrow.param_specs()[size_t(nrt.params().index_of("vision_tower.patch_embed.pos_emb.weight"))].dtype,
              DType::f32);
    const std::vector<ops::PatchGrid> grids = grids_of(f);
    const Tensor patches = f.load("patches"), ids_t = f.load("ids");
    const std::span<const int32_t> ids(ids_t.ptr<int32_t>(), size_t(ids_t.numel()));
    Tensor a(DType::f32, Shape{shape.tokens(), wide_cfg.vocab_size}), b(DType::f32, a.shape());
    wide.set_images(grids, patches);
    narrow.set_images(grids, patches);
    wide.forward_logits(shape, ids, a);
    narrow.forward_logits(shape, ids, b);
    EXPECT_TRUE(test::bitwise_equal(a.view(), b.view()));
}

TEST(VisionTower, BadVisionSectionsAreOneLineErrorsNamingTheKey) {
    const Json lm = Json::parse(R"({"vocab_size": 40, "d_model": 48, "n_layers": 1, "n_heads": 4, "ffn_dim": 64})");
    auto with = [&](const char* vision) {
        Json m = lm;
        m["vision"] = Json::parse(vision);
        return m;
    };
    test::expect_error([&] { (void)model::parse_model_config(with(R"({"layers": 2, "patch_size": 0})"), "c.json"); },
                       "vision patch_size = 0 must be in [1, 64]");
    test::expect_error([&] { (void)model::parse_model_config(with(R"({"layers": 2, "head_dim": 6})"), "c.json"); },
                       "vision head_dim 6 must be a multiple of 4");
    test::expect_error([&] { (void)model::parse_model_config(with(R"({"layers": 2, "image_token": 40})"), "c.json"); },
                       "model.vision.image_token = 40 must be in [0, 39]");
    test::expect_error([&] { (void)model::parse_model_config(with(R"({"layers": 2, "depth": 3})"), "c.json"); },
                       "depth");
}

TEST(VisionTower, KimiK3VisionConfigImportsWithTheSpecsParameterCount) {
    std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/configs/hf/kimi_k3.json");
    const Json doc = Json::parse(in);
    const model::HfImport r = model::import_hf_config(doc, "kimi_k3.json");
    ASSERT_TRUE(r.model.vision.enabled());
    EXPECT_EQ(r.model.vision.layers, 27);
    EXPECT_EQ(r.model.vision.width, 1024);
    EXPECT_EQ(r.model.vision.heads, 12);
    EXPECT_EQ(r.model.vision.head_dim, 128);
    EXPECT_EQ(r.model.vision.text_width, 7168);
    // spec/kimi_k3.md §5: tower 401,214,464 + projector 46,144,512 (the "447M")
    EXPECT_EQ(r.model.vision.num_params(), 447358976);
    std::vector<BufferSpec> specs;
    std::vector<model::ParamInit> inits;
    model::VisionTower(r.model.vision).declare_params(specs, inits);
    int64_t declared = 0;
    for (const BufferSpec& s : specs) declared += s.shape.numel();
    EXPECT_EQ(declared, 447358976);
    EXPECT_EQ(specs.size(), size_t(2 + 27 * 6 + 1 + 3));

    Json bad = doc;
    bad["vision_config"]["attn_bias"] = true;
    const model::HfImport b = model::import_hf_config(bad, "k.json");
    ASSERT_EQ(b.unsupported.size(), 1u);
    EXPECT_EQ(b.unsupported[0], "vision_config.attn_bias true (the tower has no biases)");
    bad["vision_config"].erase("vt_hidden_size");
    test::expect_error([&] { (void)model::import_hf_config(bad, "k.json"); }, "vision_config.vt_hidden_size");
}

}  // namespace
}  // namespace tessera
