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
        const ModelDoc doc = load_model_doc(a->path);
        const std::string& file = doc.file;
        if (!doc.family.empty())
            std::cout << "family: " << doc.family << " (Hugging Face config " << file << ")\n";
        else
            std::cout << "tessera config " << file << "\n";
        Json run = doc.run;
        const std::vector<std::string>& unsupported = doc.unsupported;
        for (const std::string& o : a->overrides) {
            TESSERA_CHECK(o.rfind("model.", 0) == 0, "--set {}: inspect takes model.* values only", o);
            apply_override(run, o);
        }
        const model::ModelConfig cfg =
            train::parse_run_config(run, a->overrides.empty() ? file : file + " with --set").model;
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
