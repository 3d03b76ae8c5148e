// tessera logits: score token ids with a checkpoint: ids [B, T] (i32 or i64) in, logits [B, T, V] (f32) out,
// from one full forward pass (every batch row its own sequence). With an image tower (Kimi K3), images too: the
// processor's pixel_values (patches) and image_grid_hws, their image tokens already expanded in the ids.
#include <algorithm>
#include <filesystem>

#include "apps/commands.h"
#include "core/safetensors.h"
#include "model/runtime.h"
#include "train/model_source.h"

namespace tessera::apps {

void add_logits_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("logits", "Write the logits of token ids under a checkpoint");
    struct Args {
        std::string checkpoint, in, out;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("--checkpoint", a->checkpoint,
                    "A checkpoint, a run directory (its latest checkpoint), or a Hugging Face checkpoint directory "
                    "(Kimi-Linear, Kimi K3, Qwen3-Next or DeepSeek-V3.2; a feature tessera does not build is an error)")
        ->required();
    cmd->add_option("--in", a->in,
                    "safetensors file with ids [B, T] (i32 or i64); for a model with an image tower also "
                    "pixel_values [N, 3, 14, 14] (or [N, 588]) and image_grid_hws [images, 2], as Kimi's processor "
                    "writes them, with each image's h·w/4 image tokens in the ids")
        ->required();
    cmd->add_option("--out", a->out, "safetensors file to write: logits [B, T, V] (f32)")->required();
    cmd->callback([a] {
        const train::ModelSource src = train::open_model_source(a->checkpoint);
        const model::ModelConfig& mc = src.config;
        SafetensorsFile in(a->in);
        TESSERA_CHECK(in.contains("ids"), "{}: no tensor \"ids\"", a->in);
        const Tensor raw = in.load("ids");
        TESSERA_CHECK(raw.view().ndim() == 2 && (raw.view().dtype == DType::i32 || raw.view().dtype == DType::i64),
                      "{}: ids must be [B, T] i32 or i64, not {} {}", a->in, dtype_name(raw.view().dtype),
                      raw.view().shape.str());
        const int64_t B = raw.view().size(0), T = raw.view().size(1), V = mc.vocab_size;
        TESSERA_CHECK(B > 0 && T > 0, "{}: ids is empty", a->in);
        std::vector<int32_t> ids(size_t(B * T));
        for (int64_t i = 0; i < B * T; ++i) {
            const int64_t v =
                raw.view().dtype == DType::i32 ? raw.view().ptr<int32_t>()[i] : raw.view().ptr<int64_t>()[i];
            TESSERA_CHECK(v >= 0 && v < V, "{}: ids[{}, {}] = {} is outside the vocabulary [0, {})", a->in, i / T,
                          i % T, v, V);
            ids[size_t(i)] = int32_t(v);
        }
        model::ModelConfig run = mc;
        std::vector<ops::PatchGrid> grids;
        Tensor patches;
        if (in.contains("pixel_values") || in.contains("image_grid_hws")) {
            TESSERA_CHECK(mc.vision.enabled(), "{}: images given, but {} has no image tower", a->in, src.path);
            patches = model::read_processor_images(in, a->in, mc.vision, grids);
            run.vision.max_patches = std::max<int64_t>(patches.shape()[0], 1);  // this call's images
        }
        model::Model model(run);
        const model::StepShape shape{B, T};
        model::ModelRuntime rt(model, shape, /*with_grads=*/false, /*recompute=*/{});
        src.load(model, rt.params());
        if (!grids.empty()) model.set_images(grids, patches);
        Tensor logits(DType::f32, Shape{B * T, V});
        model.forward_logits(shape, ids, logits);
        write_safetensors(a->out, {{"logits", logits.view().reshape(Shape{B, T, V})}}, {{"checkpoint", src.path}});
    });
}

}  // namespace tessera::apps
