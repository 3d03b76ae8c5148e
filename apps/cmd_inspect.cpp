// tessera inspect: what a model amounts to, from a tessera config, run or checkpoint, or a Hugging Face
// config.json (or checkpoint directory) of a supported family: the layer map, parameter counts (total and
// active), FLOPs per token, bytes for weights and full AdamW training, and what is not supported yet.
#include <filesystem>
#include <iostream>

#include "apps/commands.h"
#include "apps/options.h"
#include "model/hf_config.h"
#include "model/inspect.h"
#include "train/config.h"

namespace tessera::apps {

namespace fs = std::filesystem;

void add_inspect_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "inspect", "Summarise a model: a tessera config/run/checkpoint or a Hugging Face config.json or checkpoint");
    struct Args {
        std::string path;
        int64_t seq = 4096;
        std::vector<std::string> overrides;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("path", a->path, "A config JSON file, or a directory holding config.json")->required();
    add_int_option(cmd, "--seq", a->seq, 1, model::kMaxSeqLen, "Sequence length for the FLOPs per token");
    cmd->add_option("--set", a->overrides,
                    "Override a model value: model.key=value (repeatable), e.g. model.lora.rank=16 with "
                    "model.lora.target_modules=[...] for LoRA's memory");
    cmd->callback([a] {
        std::string file = a->path;
        if (fs::is_directory(file)) file = (fs::path(file) / "config.json").string();
        TESSERA_CHECK(fs::exists(file), "{}: no such file", file);
        const Json doc = train::load_config_json(file, {});
        model::ModelConfig cfg;
        std::vector<std::string> unsupported;
        Json run = doc;
        if (model::is_hf_config(doc)) {
            model::HfImport hf = model::import_hf_config(doc, file);
            std::cout << "family: " << hf.family << " (Hugging Face config " << file << ")\n";
            run = Json{{"model", model::to_json(hf.model)}};
            unsupported = hf.unsupported;
        } else {
            std::cout << "tessera config " << file << "\n";
        }
        for (const std::string& o : a->overrides) {
            TESSERA_CHECK(o.rfind("model.", 0) == 0, "--set {}: inspect takes model.* values only", o);
            apply_override(run, o);
        }
        cfg = train::parse_run_config(run, a->overrides.empty() ? file : file + " with --set").model;
        std::cout << model::summarize(cfg, a->seq).str();
        if (unsupported.empty()) {
            std::cout << "not supported yet: nothing\n";
        } else {
            std::cout << "not supported yet:\n";
            for (const auto& u : unsupported) std::cout << "  - " << u << "\n";
        }
    });
}

}  // namespace tessera::apps
