// Opening tessera and Hugging Face checkpoints for inference (see model_source.h).
#include "apps/model_source.h"

#include <filesystem>

#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace tessera::apps {

namespace fs = std::filesystem;

ModelSource open_model_source(const std::string& path) {
    ModelSource s;
    const fs::path config = fs::path(path) / "config.json";
    if (fs::exists(config)) {
        const Json doc = train::load_config_json(config.string(), {});
        if (model::is_hf_config(doc)) {
            model::HfImport imported = model::import_hf_config(doc, config.string());
            model::require_supported(imported, config.string());  // never a silently different model
            s.path = path;
            s.hf = true;
            s.model_type = imported.model_type;
            s.config = imported.model;
            model::untie_stored_head(path, s.config, s.model_type);  // Kimi: the stored head transformers uses
            return s;
        }
    }
    s.path = train::resolve_checkpoint(path);
    const train::RunConfig cfg =
        train::parse_run_config(train::load_checkpoint_config(s.path), (fs::path(s.path) / "config.json").string());
    s.config = cfg.model;
    s.context = cfg.train.seq_len;
    return s;
}

void ModelSource::load(const model::Model& m, const BufferGroup& params) const {
    if (hf) {
        model::load_hf_checkpoint(path, model::hf_tensor_map(m.param_specs(), config, model_type), params);
        check_finite(params, path);  // (tessera checkpoints: load_params checks)
    } else {
        train::load_params(path, params);
    }
}

}  // namespace tessera::apps
