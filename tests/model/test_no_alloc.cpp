// "The training step allocates nothing from the system heap after the first step": malloc and
// friends are interposed (forwarding to glibc's __libc_* entry points) and counted around training
// steps, by caller. tessera's own code must make no allocation at all. oneDNN's sgemm takes one
// packing buffer per call from posix_memalign (it has no caller-memory entry point in 2.x); those
// are counted apart and must stay within one per GEMM block call (docs/core.md).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <iostream>

#include "model/model_fixture.h"
#include "util/test_util.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
}

namespace {
std::atomic<long> g_ours{0}, g_onednn{0};

void count(void* caller) {
    Dl_info info;
    if (dladdr(caller, &info) && info.dli_fname && std::strstr(info.dli_fname, "libdnnl")) {
        g_onednn.fetch_add(1, std::memory_order_relaxed);
    } else {
        g_ours.fetch_add(1, std::memory_order_relaxed);
    }
}
}  // namespace

extern "C" {
void* malloc(size_t n) {
    count(__builtin_return_address(0));
    return __libc_malloc(n);
}
void* calloc(size_t a, size_t b) {
    count(__builtin_return_address(0));
    return __libc_calloc(a, b);
}
void* realloc(void* p, size_t n) {
    count(__builtin_return_address(0));
    return __libc_realloc(p, n);
}
void* memalign(size_t a, size_t n) {
    count(__builtin_return_address(0));
    return __libc_memalign(a, n);
}
void* aligned_alloc(size_t a, size_t n) {
    count(__builtin_return_address(0));
    return __libc_memalign(a, n);
}
int posix_memalign(void** p, size_t a, size_t n) {
    count(__builtin_return_address(0));
    *p = __libc_memalign(a, n);
    return *p ? 0 : 12;
}
}

namespace tessera {
namespace {

TEST(HotPath, TrainingStepsAfterTheFirstDoNotTouchTheHeap) {
    for (bool recompute : {false, true}) {
        test::GoldenModel g("dense_gqa", model::Recompute{.all = recompute});
        std::vector<int32_t> ids(size_t(g.shape.tokens())), tgt(size_t(g.shape.tokens()));
        const train::BatchSource batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
            auto si = g.ids("ids"), st = g.ids("targets");
            std::copy(si.begin(), si.end(), i.begin());
            std::copy(st.begin(), st.end(), t.begin());
            return g.shape;
        };
        train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, 0, batch, ids,
                          tgt);  // first step: may allocate
        const long ours = g_ours.load(), onednn = g_onednn.load();
        const int steps = 3;
        for (int64_t step = 1; step <= steps; ++step) {
            train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, step, batch, ids, tgt);
        }
        EXPECT_EQ(g_ours.load() - ours, 0)
            << "heap allocations by tessera in " << steps << " steps (recompute " << recompute << ")";
        // GEMM calls per step here: 2 layers x (5 forward + 8 backward [+5 recompute]) + head 3, each at most
        // 16 blocks (ops::gemm_grid), and the attention's per-head products
        const long per_step_bound = 16 * (2 * (13 + (recompute ? 5 : 0)) + 3) + 2 * 64 * 2;
        const long packing = g_onednn.load() - onednn;
        std::cout << "oneDNN packing buffers per step (recompute " << recompute << "): " << packing / steps << "\n";
        EXPECT_LE(packing, steps * per_step_bound);
        EXPECT_GT(g_onednn.load() - onednn, 0) << "the interposed allocator is not in use";
    }
}

// Every layer kind: MLA / gated DSA with the indexer, KDA, GDN, gated GQA, MoE (latent, capacity),
// Attention Residuals. tessera's own code allocates nothing after the first step.
class HotPathModels : public ::testing::TestWithParam<const char*> {};

TEST_P(HotPathModels, TrainingStepsAfterTheFirstMakeNoHeapAllocation) {
    test::GoldenModel g(GetParam());
    std::vector<int32_t> ids(size_t(g.shape.tokens())), tgt(size_t(g.shape.tokens()));
    const train::BatchSource batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
        auto si = g.ids("ids"), st = g.ids("targets");
        std::copy(si.begin(), si.end(), i.begin());
        std::copy(st.begin(), st.end(), t.begin());
        return g.shape;
    };
    train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, 0, batch, ids, tgt);
    const long ours = g_ours.load();
    for (int64_t step = 1; step <= 2; ++step)
        train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, step, batch, ids, tgt);
    EXPECT_EQ(g_ours.load() - ours, 0) << "heap allocations by tessera in 2 steps";
}

// The same across the step's other paths: recomputation, packed documents (cu_seqlens: the DSA ops see one
// row of B·T tokens), gradient accumulation, and the DSA dense warm-up (indices and the KL over every s <= t).
struct Variant {
    const char* golden;
    bool recompute, documents;
    void (*edit)(Json&);
};

TEST(HotPath, RecomputeDocumentsAccumulationAndTheDsaWarmupMakeNoHeapAllocation) {
    const Variant variants[] = {
        {"attn_res_mla_moe", true, false, nullptr},
        {"hybrid_kda_dsa", false, true, nullptr},
        {"hybrid_kda_dsa", true, true,
         [](Json& d) { d["train"]["micro_batch_size"] = d["train"]["batch_size"].get<int64_t>() / 2; }},
        {"dsa_sparse", true, false, [](Json& d) { d["model"]["mla"]["dsa"]["stage"] = "dense_warmup"; }},
        {"moe_capacity", false, true,
         [](Json& d) { d["train"]["micro_batch_size"] = d["train"]["batch_size"].get<int64_t>() / 2; }},
        // quantile balancing moves routing, so expert segments (the weight gradients' K) change every step
        {"moe_latent_situ", false, false,
         [](Json& d) {
             d["model"]["moe"]["balance"] = "quantile";
             d["model"]["moe"].erase("bias_update_rate");
         }},
    };
    for (const Variant& v : variants) {
        test::GoldenModel g(v.golden, model::Recompute{.all = v.recompute}, [&](Json& d) {
            if (v.edit) v.edit(d);
        });
        std::vector<int32_t> ids(size_t(g.shape.tokens())), tgt(size_t(g.shape.tokens()));
        std::vector<int64_t> cu;  // two documents per row
        for (int64_t b = 0; b < g.shape.batch; ++b) {
            cu.push_back(b * g.shape.seq);
            cu.push_back(b * g.shape.seq + g.shape.seq / 3);
        }
        cu.push_back(g.shape.tokens());
        const train::BatchSource batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
            auto si = g.ids("ids"), st = g.ids("targets");
            std::copy(si.begin(), si.end(), i.begin());
            std::copy(st.begin(), st.end(), t.begin());
            return v.documents ? model::StepShape{g.shape.batch, g.shape.seq, cu} : g.shape;
        };
        train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, 0, batch, ids, tgt);
        const long ours = g_ours.load();
        for (int64_t step = 1; step <= 2; ++step)
            train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, step, batch, ids, tgt);
        EXPECT_EQ(g_ours.load() - ours, 0) << "heap allocations by tessera in 2 steps of " << v.golden << " (recompute "
                                           << v.recompute << ", documents " << v.documents << ")";
    }
}

// Image input (Kimi K3's tower): each pass's images set anew, whole or cut by the windows (Model::set_images with
// rows), then forward and backward: nothing from the heap after the first pass (the tower's buffers and the image
// lists are sized at bind for model.vision.max_patches).
TEST(HotPath, PassesWithImagesMakeNoHeapAllocation) {
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    const model::ModelConfig cfg =
        model::parse_model_config(Json::parse(f.metadata().at("config"))["model"], "vision_lm golden");
    model::Model m(cfg);
    const model::StepShape shape{2, 24};
    model::ModelRuntime rt(m, shape, true, {});
    for (const BufferSpec& s : m.param_specs()) f.load_into("param." + s.name, rt.params().view(s.name));
    const Tensor g = f.load("grids"), patches = f.load("patches"), ids = f.load("ids"), cut = f.load("cut.ids"),
                 targets = f.load("targets"), rows = f.load("cut.rows");
    std::vector<ops::PatchGrid> grids;
    for (int64_t i = 0; i < g.shape()[0]; ++i) grids.push_back({g.ptr<int64_t>()[2 * i], g.ptr<int64_t>()[2 * i + 1]});
    std::vector<ops::ImageRows> kept;
    for (int64_t i = 0; i < rows.shape()[0]; ++i)
        kept.push_back({rows.ptr<int64_t>()[2 * i], rows.ptr<int64_t>()[2 * i + 1]});
    auto pass = [&](int k) {
        const Tensor& in = k % 2 ? cut : ids;
        m.set_images(grids, patches, k % 2 ? std::span<const ops::ImageRows>(kept) : std::span<const ops::ImageRows>());
        m.forward_backward(shape, std::span(in.ptr<int32_t>(), size_t(in.numel())),
                           std::span(targets.ptr<int32_t>(), size_t(targets.numel())), 1.0);
    };
    pass(0);
    pass(1);  // first passes: may allocate
    const long ours = g_ours.load();
    for (int k = 2; k < 6; ++k) pass(k);
    EXPECT_EQ(g_ours.load() - ours, 0) << "heap allocations by tessera in 4 passes with images";
}

INSTANTIATE_TEST_SUITE_P(Models,
                         HotPathModels,
                         ::testing::Values("attn_res_mla_moe",
                                           "hybrid_kda_dsa",
                                           "hybrid_gdn_gqa",
                                           "dsa_sparse",
                                           "mla_nope_moe",
                                           "moe_latent_situ",
                                           "moe_capacity",
                                           "gated_gqa"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace tessera
