// tessera generate: sample text from a checkpoint (temperature, top-k), streaming tokens as made.
#include <filesystem>
#include <iostream>
#include <optional>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/device.h"
#include "core/safetensors.h"
#include "model/image_input.h"
#include "model/runtime.h"
#include "model/sampling.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/data/hf_tokenizer.h"
#include "train/data/tokenizer.h"
#include "train/model_source.h"

namespace tessera::apps {

void add_generate_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("generate", "Sample text from a checkpoint");
    struct Args {
        std::string checkpoint, prompt;
        model::SampleParams p;
        int64_t context = 0;
        std::string tokenizer, images, device = "cpu";
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("--checkpoint", a->checkpoint,
                    "A checkpoint, a run directory (its latest checkpoint), or a Hugging Face checkpoint directory "
                    "(Kimi-Linear, Kimi K3, Qwen3-Next or DeepSeek-V3.2; a feature tessera does not build is an error)")
        ->required();
    cmd->add_option("--prompt", a->prompt, "Text to continue")->required();
    add_int_option(cmd, "--max-new-tokens", a->p.max_new_tokens, 0, int64_t(1) << 30, "Tokens to generate");
    add_number_option(cmd, "--temperature", a->p.temperature, 0, 1e6, "Sampling temperature (0 = greedy)");
    add_int_option(cmd, "--top-k", a->p.top_k, 0, INT32_MAX, "Sample from the k most likely tokens (0 = all)");
    add_uint_option(cmd, "--seed", a->p.seed, "Sampling seed");
    add_int_option(cmd, "--context", a->context, 0, model::kMaxSeqLen,
                   "Tokens the caches hold (0: the trained sequence length; 4096 for Hugging Face directories)");
    cmd->add_option("--tokenizer", a->tokenizer,
                    "A Hugging Face directory whose tokenizer reads the prompt and writes the text (default: the "
                    "model's own, or its fine-tuning base's; else the byte tokenizer)");
    cmd->add_option("--device", a->device,
                    "Where the model decodes: cpu, or cuda (the weights and caches on the GPU; the logits of each "
                    "step come back to sample)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    cmd->add_option("--images", a->images,
                    "A model with an image tower (Kimi K3): a safetensors file of Kimi's processor (pixel_values, "
                    "image_grid_hws); the prompt holds the image token (<|media_pad|>) once per image");
    cmd->callback([a] {
        const train::ModelSource src = train::open_model_source(a->checkpoint);
        model::ModelConfig run = src.config;
        std::vector<ops::PatchGrid> grids;
        Tensor patches;
        if (!a->images.empty()) {
            TESSERA_CHECK(run.vision.enabled(), "--images: {} has no image tower", src.path);
            TESSERA_CHECK(std::filesystem::is_regular_file(a->images), "--images {}: no such file", a->images);
            patches = model::read_processor_images(SafetensorsFile(a->images), a->images, run.vision, grids);
            run.vision.max_patches = std::max<int64_t>(patches.shape()[0], 1);  // this prompt's images
        }
        const Device device = a->device == "cuda" ? Device::cuda : Device::cpu;
        TESSERA_CHECK(
            device == Device::cpu || cuda_available(), "--device cuda: {}",
            cuda_built() ? "no CUDA device on this machine" : "this build has no CUDA backend (-DTESSERA_CUDA=ON)");
        model::Model model(run);
        const int64_t context = a->context > 0 ? a->context : src.context;  // default: the trained length
        BufferGroup cache("cache", model.cache_specs(1, context));
        model::ModelRuntime rt(model, {1, 1}, /*with_grads=*/false, /*recompute=*/{}, {&cache}, nullptr, device);
        model.bind_cache(cache);
        src.load(model, rt.params());
        std::vector<int32_t> tokens;
        const std::string dir = a->tokenizer.empty() ? src.tokenizer_dir() : a->tokenizer;
        std::optional<train::HfTokenizer> tok;
        int32_t eos = train::ByteTokenizer::kEndOfText;
        if (!dir.empty()) {
            tok.emplace(train::load_hf_tokenizer(dir));
            TESSERA_CHECK(tok->bpe.vocab_size() <= src.config.vocab_size,
                          "--tokenizer {}: {} ids, more than the model's vocabulary of {}", dir, tok->bpe.vocab_size(),
                          src.config.vocab_size);
            if (tok->add_bos && tok->bos) tokens.push_back(*tok->bos);
            tok->bpe.encode(a->prompt, tokens);
            eos = tok->eos.value_or(-1);  // none: only --max-new-tokens stops
        } else {
            train::ByteTokenizer::encode(a->prompt, tokens);
        }
        if (tokens.empty()) throw Error("--prompt is empty");
        if (!grids.empty()) {  // each image token of the prompt: its image's h·w/4 image tokens
            model.set_images(grids, patches);
            std::vector<int32_t> expanded;
            size_t image = 0;
            for (const int32_t t : tokens) {
                if (t != run.vision.image_token) {
                    expanded.push_back(t);
                    continue;
                }
                TESSERA_CHECK(image < grids.size(),
                              "--prompt holds more image tokens (id {}) than the {} image(s) of {}", t, grids.size(),
                              a->images);
                expanded.insert(expanded.end(), size_t(model::image_tokens(run.vision, grids[image++])), t);
            }
            TESSERA_CHECK(image == grids.size(), "--prompt holds {} image token(s) (id {}) for the {} image(s) of {}",
                          image, run.vision.image_token, grids.size(), a->images);
            tokens = std::move(expanded);
        }
        std::cout << a->prompt << std::flush;
        model::generate(model, context, tokens, a->p, eos, [&](int32_t t) {
            std::cout << (tok ? tok->bpe.decode(std::span(&t, 1)) : train::ByteTokenizer::decode(std::span(&t, 1)))
                      << std::flush;
        });
        std::cout << '\n';
    });
}

}  // namespace tessera::apps
