// tessera export-hf: a tessera checkpoint as a Hugging Face checkpoint directory of the family its layers
// imply (Kimi-Linear, Kimi K3 with Attention Residuals, Qwen3-Next, DeepSeek-V3.2; model/hf_config.h):
// config.json and f32 or bf16 safetensors shards with model.safetensors.index.json, in the published tensor
// layout (model/hf_checkpoint.h). `tessera logits` and `inspect` read such a directory back. A LoRA fine-tune:
// its adapters as a PEFT directory (model/hf_peft.h), or with --merge-lora its base with them merged in.
#include <filesystem>
#include <optional>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/file.h"
#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/hf_peft.h"
#include "model/lora.h"
#include "model/runtime.h"
#include "train/config.h"
#include "train/data/tokenizer.h"
#include "train/model_source.h"

namespace tessera::apps {

namespace fs = std::filesystem;

void add_export_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "export-hf",
        "Write a checkpoint as a Hugging Face checkpoint directory (Kimi-Linear, Kimi K3, Qwen3-Next or DeepSeek-V3.2, "
        "by the model's layers)");
    struct Args {
        std::string checkpoint, out;
        int64_t shard_mib = 4096;
        std::string dtype = "f32", expert_dtype;
        bool merge_lora = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("--checkpoint", a->checkpoint, "A checkpoint, or a run directory (its latest checkpoint)")
        ->required();
    cmd->add_option("--out", a->out, "The directory to create (must not exist or be empty)")->required();
    add_int_option(cmd, "--shard-mib", a->shard_mib, 1, int64_t(1) << 20, "Largest shard size in MiB");
    cmd->add_option("--dtype", a->dtype, "Stored dtype: f32 (exact) or bf16 (rounded)")
        ->capture_default_str()
        ->check(CLI::IsMember({"f32", "bf16"}));
    cmd->add_option(
           "--expert-dtype", a->expert_dtype,
           "mxfp4: the routed experts as compressed-tensors' weight_packed + weight_scale, Kimi K3's "
           "release format (quantised by the OCP MX rule: lossy where adapters were merged in); default: as --dtype")
        ->check(CLI::IsMember({"mxfp4"}));
    cmd->add_flag("--merge-lora", a->merge_lora,
                  "A LoRA fine-tune: write its base with the adapters merged in (without: the adapters alone, as a "
                  "PEFT directory on the base)");
    cmd->callback([a] {
        fs::path out = fs::path(a->out).lexically_normal();
        if (out.filename().empty()) out = out.parent_path();  // "hf/"
        TESSERA_CHECK(!fs::exists(out) || (fs::is_directory(out) && fs::is_empty(out)),
                      "{} already exists and is not an empty directory", a->out);
        const train::ModelSource src = train::open_model_source(a->checkpoint);
        TESSERA_CHECK(!src.hf, "{} is already a Hugging Face directory", a->checkpoint);
        const bool lora = src.config.lora.enabled();
        TESSERA_CHECK(lora || !a->merge_lora, "--merge-lora: {} has no LoRA adapters", src.path);
        const bool peft = lora && !a->merge_lora;  // the adapters alone, as PEFT writes them
        const bool mxfp4 = a->expert_dtype == "mxfp4";
        TESSERA_CHECK(
            !peft || a->expert_dtype.empty(),
            "--expert-dtype: {} is a LoRA fine-tune whose adapters are written (add --merge-lora to write its "
            "base)",
            src.path);
        model::Model model(src.config);
        model::ModelRuntime rt(model, {1, 1}, /*with_grads=*/false, /*recompute=*/{});
        src.load(model, rt.params());
        model::ModelConfig plain_cfg = src.config;
        plain_cfg.lora = {};
        model::Model plain(plain_cfg);
        std::optional<model::ModelRuntime> merged;
        if (lora && !peft) {
            merged.emplace(plain, model::StepShape{1, 1}, false, model::Recompute{});
            model::merge_lora(src.config.lora, rt.params(), merged->params());
        }
        const BufferGroup& params = merged ? merged->params() : rt.params();
        // a fine-tune of a Hugging Face checkpoint keeps its base's config (tokenizer ids and all); otherwise the
        // config the layers imply, refusing what the format cannot express, with the byte tokenizer's
        // <|endoftext|> and <|pad|> as the special ids
        const train::ModelSource base = lora ? train::open_model_source(src.base) : train::ModelSource{};
        Json hf = base.hf ? train::load_config_json((fs::path(base.path) / "config.json").string(), {})
                          : model::export_hf_config(plain_cfg, {.bos = train::ByteTokenizer::kEndOfText,
                                                                .eos = train::ByteTokenizer::kEndOfText,
                                                                .pad = train::ByteTokenizer::kPad});
        // the weights' quantisation as written: MXFP4 experts keep a base's MXFP4 quantization_config or get one;
        // dense ones drop a base's (K3's MXFP4, DeepSeek's FP8), which would otherwise describe tensors not written
        if (!mxfp4) {
            hf.erase("quantization_config");
        } else if (!hf.contains("quantization_config") ||
                   hf["quantization_config"].value("format", "") != "mxfp4-pack-quantized") {
            hf["quantization_config"] = model::mxfp4_experts_quantization_config();
        }
        const std::string type = base.hf ? base.model_type : hf.at("model_type").get<std::string>();
        // NOTES: written under <out>.tmp-<host>-<pid> and renamed at the end, so an export that fails or is killed
        // midway leaves no half directory that the next export would refuse; a dead writer's is removed here.
        const std::string prefix = out.filename().string() + ".tmp-";
        const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(parent, ec)) {
            const std::string name = e.path().filename().string();
            if (name.rfind(prefix, 0) == 0 && writer_is_dead(name.substr(prefix.size()))) fs::remove_all(e.path(), ec);
        }
        const fs::path tmp = parent / (prefix + writer_tag());
        try {
            if (peft) {
                model::save_peft_adapter(tmp.string(), model::peft_tensor_map(model.param_specs(), src.config, type),
                                         params, src.config.lora, base.path);
            } else {
                model::save_hf_checkpoint(tmp.string(), model::hf_tensor_map(plain.param_specs(), plain_cfg, type),
                                          params, size_t(a->shard_mib) << 20,
                                          a->dtype == "bf16" ? DType::bf16 : DType::f32,
                                          mxfp4 ? DType::mxfp4 : DType::f32);
                write_text_atomic((tmp / "config.json").string(), hf.dump(2) + "\n");
            }
            if (base.hf && !peft) {  // its tokenizer and generation defaults go with it
                for (const auto& e : fs::directory_iterator(base.path)) {
                    const std::string n = e.path().filename().string();
                    if (e.is_regular_file() && n != "config.json" && !n.ends_with(".safetensors") &&
                        !n.ends_with(".index.json"))
                        fs::copy_file(e.path(), tmp / n);
                }
            }
            if (fs::exists(out)) fs::remove(out);  // the empty directory it may be
            fs::rename(tmp, out);
            fsync_path(parent.string());
        } catch (...) {
            fs::remove_all(tmp, ec);
            throw;
        }
        if (peft) {
            std::printf("wrote %s (PEFT LoRA adapters of rank %lld on %s)\n", a->out.c_str(),
                        (long long)src.config.lora.rank, base.path.c_str());
        } else {
            std::printf("wrote %s (%s layout, %lld parameters)\n", a->out.c_str(), type.c_str(),
                        (long long)plain.num_params());
        }
    });
}

}  // namespace tessera::apps
