// LoRA adapters in PEFT's format (see hf_peft.h).
#include "model/hf_peft.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/model.h"

namespace tessera::model {

namespace fs = std::filesystem;

namespace {
constexpr const char* kPrefix = "base_model.model.";
constexpr const char* kA = ".lora_A.weight";
constexpr const char* kB = ".lora_B.weight";

bool ends_with(const std::string& s, const char* tail) { return s.ends_with(tail); }
std::string strip(const std::string& s, const char* tail) { return s.substr(0, s.size() - std::strlen(tail)); }

// tessera module -> the transformers module it is (the stored name of its weight without ".weight"), for every weight
// stored one-to-one; "" for those stored fused or per expert (no PEFT module of their own)
std::map<std::string, std::string> module_names(const std::vector<BufferSpec>& specs,
                                                const ModelConfig& c,
                                                const std::string& model_type) {
    std::vector<BufferSpec> base;
    for (const BufferSpec& s : specs) {
        if (!ends_with(s.name, kA) && !ends_with(s.name, kB)) base.push_back(s);
    }
    ModelConfig plain = c;
    plain.lora = {};
    std::map<std::string, std::string> out;
    for (const HfTensor& t : hf_tensor_map(base, plain, model_type)) {
        if (!ends_with(t.param, ".weight") || t.copy != HfTensor::Copy::none) continue;
        const std::string module = strip(t.param, ".weight");
        const bool one_to_one = t.expert < 0 && t.rows.groups == 0 && t.pad_to == 0 && t.offset == 0.f &&
                                ends_with(t.name, ".weight") && !out.count(module);
        out[module] = one_to_one ? strip(t.name, ".weight") : std::string();
    }
    return out;
}
}  // namespace

bool is_peft_dir(const std::string& dir) { return fs::exists(fs::path(dir) / "adapter_config.json"); }

namespace {
Json read_config(const std::string& dir) {
    const std::string path = (fs::path(dir) / "adapter_config.json").string();
    const Json j = parse_json(read_text(path, size_t(16) << 20), path);
    TESSERA_CHECK(j.is_object(), "{}: not a JSON object", path);
    return j;
}
}  // namespace

std::string peft_base(const std::string& dir) {
    const Json j = read_config(dir);
    TESSERA_CHECK(j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string() &&
                      !j["base_model_name_or_path"].get<std::string>().empty(),
                  "{}/adapter_config.json: base_model_name_or_path is missing", dir);
    const fs::path bp(j["base_model_name_or_path"].get<std::string>());
    const fs::path p = (bp.is_absolute() ? bp : fs::path(dir) / bp).lexically_normal();
    TESSERA_CHECK(fs::is_directory(p),
                  "{}/adapter_config.json: its base {} is not a local directory (tessera reads bases from disk)", dir,
                  bp.string());
    return p.string();
}

std::vector<PeftTensor> peft_tensor_map(const std::vector<BufferSpec>& specs,
                                        const ModelConfig& c,
                                        const std::string& model_type) {
    TESSERA_CHECK(c.lora.modules_to_save.empty(),
                  "PEFT adapters: model.lora.modules_to_save ({}) is not written in PEFT's form yet; export-hf "
                  "--merge-lora writes the fine-tuned model whole",
                  Json(c.lora.modules_to_save).dump());
    const std::map<std::string, std::string> names = module_names(specs, c, model_type);
    std::vector<PeftTensor> out;
    for (const BufferSpec& s : specs) {
        const bool a = ends_with(s.name, kA);
        if (!a && !ends_with(s.name, kB)) continue;
        const std::string module = strip(s.name, a ? kA : kB);
        const auto it = names.find(module);
        TESSERA_CHECK(it != names.end() && !it->second.empty(),
                      "PEFT adapters: {} has no module of its own in the {} layout (routed experts are one stacked "
                      "parameter there, fused projections one tensor), so PEFT's form of its adapter is not written "
                      "yet; export-hf --merge-lora writes the model with the adapters merged in",
                      module, model_type);
        out.push_back({s.name, kPrefix + it->second + (a ? kA : kB)});
    }
    TESSERA_CHECK(!out.empty(), "PEFT adapters: the model has no adapters");
    return out;
}

void save_peft_adapter(const std::string& dir,
                       const std::vector<PeftTensor>& map,
                       const BufferGroup& params,
                       const LoraConfig& c,
                       const std::string& base) {
    fs::create_directories(dir);
    std::vector<NamedTensor> tensors;
    std::vector<std::string> modules;
    for (const PeftTensor& t : map) {
        tensors.push_back({t.name, params.view(t.param)});
        if (ends_with(t.name, kA)) modules.push_back(strip(t.name, kA).substr(std::strlen(kPrefix)));
    }
    write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
    const Json config = {{"peft_type", "LORA"},
                         {"task_type", "CAUSAL_LM"},
                         {"base_model_name_or_path", base},
                         {"r", c.rank},
                         {"lora_alpha", c.alpha},
                         {"use_rslora", c.rslora},
                         {"target_modules", modules},  // exactly the adapted modules
                         {"modules_to_save", nullptr},
                         {"lora_dropout", c.dropout},
                         {"bias", "none"},
                         {"fan_in_fan_out", false},
                         {"use_dora", false},
                         {"init_lora_weights", true},
                         {"inference_mode", true},
                         {"rank_pattern", Json::object()},
                         {"alpha_pattern", Json::object()},
                         {"layers_to_transform", nullptr},
                         {"revision", nullptr}};
    write_text_atomic((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n");
}

PeftAdapter read_peft_config(const std::string& dir, const ModelConfig& base, const std::string& model_type) {
    const std::string path = (fs::path(dir) / "adapter_config.json").string();
    const Json j = read_config(dir);
    auto get = [&](const char* key) -> const Json* { return j.contains(key) && !j[key].is_null() ? &j[key] : nullptr; };
    const Json* type = get("peft_type");
    TESSERA_CHECK(type && type->is_string() && type->get<std::string>() == "LORA", "{}: peft_type must be LORA", path);
    for (const char* key : {"use_dora", "fan_in_fan_out"})
        TESSERA_CHECK(!get(key) || !get(key)->get<bool>(), "{}: {} is not supported", path, key);
    TESSERA_CHECK(!get("bias") || get("bias")->get<std::string>() == "none", "{}: bias must be \"none\"", path);
    for (const char* key : {"rank_pattern", "alpha_pattern"})
        TESSERA_CHECK(!get(key) || get(key)->empty(), "{}: {} (per-module ranks) is not supported", path, key);
    TESSERA_CHECK(!get("modules_to_save") || get("modules_to_save")->empty(), "{}: modules_to_save is not supported",
                  path);
    TESSERA_CHECK(!get("target_parameters") || get("target_parameters")->empty(),
                  "{}: target_parameters (adapters on stacked expert parameters) are not read yet", path);
    PeftAdapter out;
    TESSERA_CHECK(get("r") && get("r")->is_number_integer() && get("lora_alpha") && get("lora_alpha")->is_number(),
                  "{}: r and lora_alpha must be numbers", path);
    out.lora.rank = get("r")->get<int64_t>();
    out.lora.alpha = get("lora_alpha")->get<double>();
    out.lora.rslora = get("use_rslora") && get("use_rslora")->get<bool>();
    out.lora.dropout = get("lora_dropout") ? get("lora_dropout")->get<double>() : 0.0;
    out.base = peft_base(dir);
    // the adapted modules: exactly those whose adapters the file holds, by their tessera names
    ModelConfig plain = base;
    plain.lora = {};
    std::map<std::string, std::string> by_hf;  // transformers module -> tessera module
    for (const auto& [module, hf] : module_names(Model(plain).param_specs(), plain, model_type))
        if (!hf.empty()) by_hf[hf] = module;
    const std::string file = (fs::path(dir) / "adapter_model.safetensors").string();
    const SafetensorsFile f(file);
    std::set<std::string> modules;
    for (const auto& e : f.entries()) {
        TESSERA_CHECK(e.name.rfind(kPrefix, 0) == 0 && (ends_with(e.name, kA) || ends_with(e.name, kB)),
                      "{}: \"{}\" is not a LoRA adapter tensor (base_model.model.<module>.lora_A/B.weight)", file,
                      e.name);
        const std::string hf = strip(e.name, ends_with(e.name, kA) ? kA : kB).substr(std::strlen(kPrefix));
        const auto it = by_hf.find(hf);
        TESSERA_CHECK(it != by_hf.end(), "{}: \"{}\" is no module of this {} model that takes adapters one to one",
                      file, hf, model_type);
        modules.insert(it->second);
    }
    TESSERA_CHECK(!modules.empty(), "{}: holds no adapters", file);
    out.lora.target_modules.assign(modules.begin(), modules.end());
    out.lora.validate(path);
    return out;
}

void load_peft_adapter(const std::string& dir, const std::vector<PeftTensor>& map, const BufferGroup& params) {
    const std::string file = (fs::path(dir) / "adapter_model.safetensors").string();
    const SafetensorsFile f(file);
    std::set<std::string> wanted;
    for (const PeftTensor& t : map) {
        wanted.insert(t.name);
        TESSERA_CHECK(f.contains(t.name), "{}: no tensor \"{}\" (for {})", file, t.name, t.param);
        const TensorView dst = params.view(t.param);
        TESSERA_CHECK(f.entry(t.name).shape == dst.shape, "{}: \"{}\" is {}, the model needs {}", file, t.name,
                      f.entry(t.name).shape.str(), dst.shape.str());
        f.load_into(t.name, dst);
    }
    for (const auto& e : f.entries())
        TESSERA_CHECK(wanted.count(e.name), "{}: \"{}\" adapts no module of this model", file, e.name);
}

}  // namespace tessera::model
