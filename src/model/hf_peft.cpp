// LoRA adapters in PEFT's format (see hf_peft.h).
#include "model/hf_peft.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
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
// PEFT's rank_pattern / alpha_pattern key for every layer's stacked gate_up_proj (a regex matched at a key's end)
constexpr const char* kGateUpPattern = "mlp.experts.gate_up_proj";

bool ends_with(const std::string& s, const char* tail) { return s.ends_with(tail); }
std::string strip(const std::string& s, const char* tail) { return s.substr(0, s.size() - std::strlen(tail)); }

// The transformers module a stored tensor's module name is: Kimi-Linear's checkpoint names as transformers renames
// them on load (its conversion mapping)
std::string transformers_module(std::string name, const std::string& model_type) {
    if (model_type != "kimi_linear") return name;
    auto rename = [&](const std::string& from, const std::string& to) {
        if (const size_t at = name.find(from); at != std::string::npos) name.replace(at, from.size(), to);
    };
    rename(".block_sparse_moe.", ".mlp.");
    rename(".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj");
    rename(".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj");
    return name;
}

// The families whose transformers 5 classes hold routed experts stacked (gate_up_proj, down_proj under
// <layer>.mlp.experts), the form PEFT's target_parameters adapts
bool stacks_experts(const std::string& model_type) {
    return model_type == "kimi_linear" || model_type == "qwen3_next" || model_type == "deepseek_v32";
}

// A routed expert projection's kind (tessera module "<layer>.mlp.experts.gate_proj", ...): none for other modules
PeftTensor::Stacked expert_kind(const std::string& module, const std::set<std::string>& expert_weights) {
    if (!expert_weights.count(module + ".weight")) return PeftTensor::Stacked::none;
    if (module.ends_with(".gate_proj")) return PeftTensor::Stacked::gate;
    if (module.ends_with(".up_proj")) return PeftTensor::Stacked::up;
    TESSERA_CHECK(module.ends_with(".down_proj"), "PEFT adapters: unexpected routed expert module {}", module);
    return PeftTensor::Stacked::down;
}

std::set<std::string> expert_weights(const std::vector<BufferSpec>& specs) {
    std::set<std::string> out;
    for (const BufferSpec& s : specs)
        if (s.sharding == Sharding::expert && s.shape.ndim == 3 && s.name.ends_with(".weight")) out.insert(s.name);
    return out;
}

std::string experts_module(const std::string& module) { return module.substr(0, module.rfind('.')); }

// tessera parameter -> the transformers tensor it is (its stored name, renamed), for every parameter stored one to
// one; "" for those stored fused, split, padded, offset or per expert (no PEFT tensor of their own)
std::map<std::string, std::string> param_names(const std::vector<BufferSpec>& specs,
                                               const ModelConfig& c,
                                               const std::string& model_type) {
    std::vector<BufferSpec> base;
    for (const BufferSpec& s : specs) {
        if (!is_adapter(s.name)) base.push_back(s);
    }
    ModelConfig plain = c;
    plain.lora = {};
    std::map<std::string, std::string> out;
    for (const HfTensor& t : hf_tensor_map(base, plain, model_type)) {
        if (t.copy != HfTensor::Copy::none) continue;
        const bool one_to_one = t.expert < 0 && is_plain(t) && !out.count(t.param);
        out[t.param] = one_to_one ? transformers_module(t.name, model_type) : std::string();
    }
    return out;
}

// tessera module -> the transformers module it is, for every weight stored one to one ("" otherwise)
std::map<std::string, std::string> module_names(const std::vector<BufferSpec>& specs,
                                                const ModelConfig& c,
                                                const std::string& model_type) {
    std::map<std::string, std::string> out;
    for (const auto& [param, name] : param_names(specs, c, model_type)) {
        if (ends_with(param, ".weight"))
            out[strip(param, ".weight")] = ends_with(name, ".weight") ? strip(name, ".weight") : std::string();
    }
    return out;
}

// The module a tensor name is of (the name without its last part)
std::string module_of(const std::string& name) { return name.substr(0, name.rfind('.')); }
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
    const std::map<std::string, std::string> names = module_names(specs, c, model_type);
    const std::set<std::string> experts = expert_weights(specs);
    std::set<std::string> adapted;
    for (const BufferSpec& s : specs)
        if (ends_with(s.name, kA)) adapted.insert(strip(s.name, kA));
    std::vector<PeftTensor> out;
    for (const BufferSpec& s : specs) {
        const bool a = ends_with(s.name, kA);
        if (!a && !ends_with(s.name, kB)) continue;
        const std::string module = strip(s.name, a ? kA : kB);
        if (const PeftTensor::Stacked kind = expert_kind(module, experts); kind != PeftTensor::Stacked::none) {
            TESSERA_CHECK(stacks_experts(model_type),
                          "PEFT adapters: {}: {} has no transformers class whose stacked experts PEFT adapts, so "
                          "PEFT's form of the routed experts' adapters is not written; export-hf --merge-lora writes "
                          "the model with the adapters merged in",
                          module, model_type);
            const std::string x = experts_module(module);
            // the wrappers nest in parameter order: gate_up_proj's inside down_proj's when both are adapted
            const bool inner = kind != PeftTensor::Stacked::down && adapted.count(x + ".down_proj");
            out.push_back({s.name, kPrefix + x + (inner ? ".base_layer" : "") + (a ? kA : kB), kind,
                           adapted.count(x + ".gate_proj") && adapted.count(x + ".up_proj")});
            continue;
        }
        const auto it = names.find(module);
        TESSERA_CHECK(it != names.end() && !it->second.empty(),
                      "PEFT adapters: {} has no module of its own in the {} layout (a fused projection is one "
                      "tensor there), so PEFT's form of its adapter is not written yet; export-hf --merge-lora writes "
                      "the model with the adapters merged in",
                      module, model_type);
        out.push_back({s.name, kPrefix + it->second + (a ? kA : kB)});
    }
    // modules_to_save: the parameters that train whole, under their transformers names (PEFT saves a wrapped
    // module's copy under the module's own name)
    const std::map<std::string, std::string> stored = param_names(specs, c, model_type);
    for (const BufferSpec& s : specs) {
        if (!s.trainable || is_adapter(s.name)) continue;
        const auto it = stored.find(s.name);
        TESSERA_CHECK(it != stored.end() && !it->second.empty(),
                      "PEFT adapters: model.lora.modules_to_save: {} is not stored as one tensor of its own in the {} "
                      "layout, so PEFT's form of it is not written; export-hf --merge-lora writes the fine-tuned "
                      "model whole",
                      s.name, model_type);
        out.push_back({s.name, kPrefix + it->second});
    }
    TESSERA_CHECK(!out.empty(), "PEFT adapters: the model has no adapters and no modules_to_save");
    return out;
}

namespace {
// Where a stacked adapter's part lies in PEFT's tensor: its experts E, its rank r, the stacked rank R, the first of
// its ranks k0 and of its output rows o0
struct Part {
    int64_t E, r, R, k0, o0;
};
Part part_of(const PeftTensor& t, const Shape& param, int64_t R) {
    const bool a = ends_with(t.param, kA);
    const int64_t E = param[0], r = a ? param[1] : param[2], out = a ? 0 : param[1];
    const bool up = t.stacked == PeftTensor::Stacked::up;
    return {E, r, R, up && R == 2 * r ? r : 0, up && !a ? out : 0};
}
// PEFT's tensor shape for a stacked part written at R (export: 2r when paired)
Shape stacked_shape(const PeftTensor& t, const Shape& param) {
    const bool a = ends_with(t.param, kA);
    const bool gate_up = t.stacked != PeftTensor::Stacked::down;
    const int64_t E = param[0], r = a ? param[1] : param[2], R = gate_up && t.paired ? 2 * r : r;
    if (a) return Shape{R * E, param[2]};
    return Shape{gate_up ? 2 * param[1] : param[1], R * E};
}
// element (e, i, j) of a tessera part <-> its index in PEFT's tensor [rows, cols]
int64_t stacked_index(bool a, const Part& p, int64_t cols, int64_t e, int64_t i, int64_t j) {
    if (a) return (e * p.R + p.k0 + i) * cols + j;    // A: i a rank, j an input
    return (p.o0 + i) * cols + (p.k0 + j) * p.E + e;  // B: i an output row, j a rank
}
}  // namespace

Tensor peft_param(const Tensor& stored, const PeftTensor& t, const Shape& shape, const std::string& file) {
    const TensorView v = stored.view();
    if (t.stacked == PeftTensor::Stacked::none) {
        TESSERA_CHECK(v.dtype == DType::f32 || v.dtype == DType::bf16, "{}: \"{}\" must be f32 or bf16", file, t.name);
        TESSERA_CHECK(v.shape == shape, "{}: \"{}\" is {}, the model needs {}", file, t.name, v.shape.str(),
                      shape.str());
        Tensor param(DType::f32, shape);
        convert(v, param.view());
        return param;
    }
    TESSERA_CHECK(v.dtype == DType::f32, "{}: \"{}\" must be f32", file, t.name);
    const bool a = ends_with(t.param, kA);
    const int64_t E = shape[0], r = a ? shape[1] : shape[2], out = shape[1];
    const int64_t rows = a ? 0 : t.stacked == PeftTensor::Stacked::down ? out : 2 * out;
    const int64_t R = v.ndim() == 2 ? (a ? v.size(0) : v.size(1)) / E : 0;
    const bool pair = t.stacked != PeftTensor::Stacked::down;
    TESSERA_CHECK(v.ndim() == 2 && (R == r || (pair && R == 2 * r)) && (a ? v.size(0) : v.size(1)) == R * E &&
                      (a ? v.size(1) == shape[2] : v.size(0) == rows),
                  "{}: \"{}\" is {}; {} experts at rank {} need {} (gate_up_proj also at rank {})", file, t.name,
                  v.shape.str(), E, r, (a ? Shape{r * E, shape[2]} : Shape{rows, r * E}).str(), 2 * r);
    const Part p = part_of(t, shape, R);
    const int64_t cols = v.size(1);
    const float* src = v.ptr<float>();
    Tensor param(DType::f32, shape);
    float* dst = param.ptr<float>();
    const int64_t ni = shape[1], nj = shape[2];
    for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < ni; ++i)
            for (int64_t j = 0; j < nj; ++j) dst[(e * ni + i) * nj + j] = src[stacked_index(a, p, cols, e, i, j)];
    if (!a && R == 2 * r) {  // gate and up apart: B block diagonal (this part's rows, the other part's ranks zero)
        const Part other{E, r, R, p.k0 == 0 ? r : 0, p.o0};
        for (int64_t e = 0; e < E; ++e)
            for (int64_t i = 0; i < ni; ++i)
                for (int64_t j = 0; j < nj; ++j)
                    TESSERA_CHECK(src[stacked_index(false, other, cols, e, i, j)] == 0.f,
                                  "{}: \"{}\" at rank {} = 2r couples gate_proj and up_proj (a nonzero element "
                                  "off B's diagonal blocks, expert {}): not two rank-{} adapters",
                                  file, t.name, R, e, r);
    }
    return param;
}

void save_peft_adapter(const std::string& dir,
                       const std::vector<PeftTensor>& map,
                       const BufferGroup& params,
                       const LoraConfig& c,
                       const std::string& base) {
    fs::create_directories(dir);
    std::vector<NamedTensor> tensors;
    std::vector<std::string> modules;
    std::set<std::string> saved;            // modules_to_save
    std::set<std::string> stacked_params;   // target_parameters
    std::map<std::string, Tensor> stacked;  // PEFT key -> the tensor its parts are written into
    bool paired = false;
    for (const PeftTensor& t : map) {
        if (t.stacked == PeftTensor::Stacked::none) {
            tensors.push_back({t.name, params.view(t.param)});
            if (ends_with(t.name, kA)) modules.push_back(strip(t.name, kA).substr(std::strlen(kPrefix)));
            if (!is_adapter(t.param)) saved.insert(module_of(t.name.substr(std::strlen(kPrefix))));
            continue;
        }
        const bool a = ends_with(t.param, kA);
        const TensorView v = params.view(t.param);
        const Shape shape = stacked_shape(t, v.shape);
        auto [it, fresh] = stacked.try_emplace(t.name, DType::f32, shape);  // zero: B's off-diagonal blocks stay so
        const Part p = part_of(t, v.shape, a ? shape[0] / v.size(0) : shape[1] / v.size(0));
        const float* src = v.ptr<float>();
        float* dst = it->second.ptr<float>();
        const int64_t ni = v.size(1), nj = v.size(2);
        for (int64_t e = 0; e < v.size(0); ++e)
            for (int64_t i = 0; i < ni; ++i)
                for (int64_t j = 0; j < nj; ++j)
                    dst[stacked_index(a, p, shape[1], e, i, j)] = src[(e * ni + i) * nj + j];
        const std::string x = experts_module(strip(t.param, a ? kA : kB));
        stacked_params.insert(x + (t.stacked == PeftTensor::Stacked::down ? ".down_proj" : ".gate_up_proj"));
        paired = paired || t.paired;
    }
    for (const auto& [name, tensor] : stacked) tensors.push_back({name, tensor.view()});
    write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
    // gate and up apart: gate_up_proj's adapters at rank 2r, alpha scaled so that their scale is r's
    Json rank_pattern = Json::object(), alpha_pattern = Json::object();
    if (paired) {
        rank_pattern[kGateUpPattern] = 2 * c.rank;
        alpha_pattern[kGateUpPattern] = c.alpha * (c.rslora ? std::sqrt(2.0) : 2.0);
    }
    const Json config = {
        {"peft_type", "LORA"},
        {"task_type", "CAUSAL_LM"},
        {"base_model_name_or_path", base},
        {"r", c.rank},
        {"lora_alpha", c.alpha},
        {"use_rslora", c.rslora},
        {"target_modules", modules},  // exactly the adapted modules
        {"target_parameters", std::vector<std::string>(stacked_params.begin(), stacked_params.end())},
        {"modules_to_save", saved.empty() ? Json(nullptr) : Json(std::vector<std::string>(saved.begin(), saved.end()))},
        // (PEFT's stacked-parameter wrapper refuses dropout; at inference it is the identity)
        {"lora_dropout", stacked_params.empty() ? c.dropout : 0.0},
        {"bias", "none"},
        {"fan_in_fan_out", false},
        {"use_dora", false},
        {"init_lora_weights", true},
        {"inference_mode", true},
        {"rank_pattern", rank_pattern},
        {"alpha_pattern", alpha_pattern},
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
    std::vector<std::string> to_save;  // PEFT's modules_to_save: names matched at a module name's end
    if (const Json* m = get("modules_to_save")) {
        TESSERA_CHECK(m->is_array(), "{}: modules_to_save must be a list", path);
        for (const Json& n : *m) {
            TESSERA_CHECK(n.is_string() && !n.get<std::string>().empty(),
                          "{}: modules_to_save must be a list of module names", path);
            to_save.push_back(n.get<std::string>());
        }
    }
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
    const std::vector<BufferSpec> specs = Model(plain).param_specs();
    std::map<std::string, std::string> by_hf;  // transformers module -> tessera module
    for (const auto& [module, hf] : module_names(specs, plain, model_type))
        if (!hf.empty()) by_hf[hf] = module;
    std::map<std::string, std::string> by_tensor;  // transformers tensor -> tessera parameter (modules_to_save)
    for (const auto& [param, hf] : param_names(specs, plain, model_type))
        if (!hf.empty()) by_tensor[hf] = param;
    // stacked expert parameters (target_parameters): "<experts module>.gate_up_proj" adapts tessera's gate_proj and
    // up_proj of those experts, ".down_proj" its down_proj; an entry names every key that ends with it (as PEFT)
    std::map<std::string, std::vector<std::string>> by_param;  // transformers parameter -> tessera modules
    if (stacks_experts(model_type)) {
        for (const std::string& w : expert_weights(specs)) {
            if (!w.ends_with(".gate_proj.weight")) continue;
            const std::string x = experts_module(strip(w, ".weight"));
            by_param[x + ".gate_up_proj"] = {x + ".gate_proj", x + ".up_proj"};
            by_param[x + ".down_proj"] = {x + ".down_proj"};
        }
    }
    std::set<std::string> modules, stacked_modules;  // experts modules with a stacked adapter
    std::set<std::string> gate_up;                   // the keys of adapted gate_up_proj parameters
    if (const Json* tp = get("target_parameters")) {
        TESSERA_CHECK(tp->is_array(), "{}: target_parameters must be a list", path);
        for (const Json& name : *tp) {
            TESSERA_CHECK(name.is_string(), "{}: target_parameters must be a list of strings", path);
            const std::string n = name.get<std::string>();
            bool any = false;
            for (const auto& [key, tessera] : by_param) {
                if (key != n && !key.ends_with("." + n)) continue;
                any = true;
                modules.insert(tessera.begin(), tessera.end());
                stacked_modules.insert(experts_module(key));
                if (key.ends_with(".gate_up_proj")) gate_up.insert(key);
            }
            TESSERA_CHECK(any, "{}: target_parameters entry \"{}\" names no stacked expert parameter of this {} model",
                          path, n, model_type);
        }
    }
    // per-parameter ranks: only gate_up_proj's, at r (gate and up from one A) or 2r (apart), with the same scale
    std::map<std::string, Json> patterns[2];
    for (int k = 0; k < 2; ++k) {
        const char* key = k == 0 ? "rank_pattern" : "alpha_pattern";
        if (const Json* pat = get(key)) {
            TESSERA_CHECK(pat->is_object(), "{}: {} must be an object", path, key);
            for (const auto& [name, value] : pat->items()) {
                const std::regex re("(.*\\.)?(" + name + ")$");
                bool only_gate_up = !gate_up.empty();
                for (const auto& [hf, module] : by_hf) only_gate_up = only_gate_up && !std::regex_match(hf, re);
                for (const auto& [p, tessera] : by_param)
                    if (std::regex_match(p, re)) only_gate_up = only_gate_up && gate_up.count(p);
                TESSERA_CHECK(only_gate_up && value.is_number(),
                              "{}: {} \"{}\" (per-module ranks) is not supported: only the stacked experts' "
                              "gate_up_proj may differ (rank r or 2r, the same scale)",
                              path, key, name);
                patterns[k][name] = value;
            }
        }
    }
    const std::string file = (fs::path(dir) / "adapter_model.safetensors").string();
    const SafetensorsFile f(file);
    std::set<std::string> saved;        // tessera modules_to_save (modules of the saved parameters)
    std::set<std::string> saved_names;  // the modules_to_save entries some saved tensor is of
    for (const auto& e : f.entries()) {
        if (e.name.rfind(kPrefix, 0) == 0 && !ends_with(e.name, kA) && !ends_with(e.name, kB)) {
            const std::string hf = e.name.substr(std::strlen(kPrefix)), module = module_of(hf);
            bool listed = false;
            for (const std::string& n : to_save) {
                if (LoraConfig::names({n}, module)) saved_names.insert(n), listed = true;
            }
            const auto it = by_tensor.find(hf);
            TESSERA_CHECK(listed && it != by_tensor.end(),
                          "{}: \"{}\" is neither a LoRA adapter tensor (base_model.model.<module>.lora_A/B.weight) "
                          "nor a tensor of a module in modules_to_save that this {} model stores one to one",
                          file, e.name, model_type);
            saved.insert(module_of(it->second));
            continue;
        }
        TESSERA_CHECK(e.name.rfind(kPrefix, 0) == 0,
                      "{}: \"{}\" is not a LoRA adapter tensor (base_model.model.<module>.lora_A/B.weight)", file,
                      e.name);
        std::string hf = strip(e.name, ends_with(e.name, kA) ? kA : kB).substr(std::strlen(kPrefix));
        if (hf.ends_with(".base_layer")) hf = strip(hf, ".base_layer");
        if (stacked_modules.count(hf)) continue;  // a stacked parameter's adapter (load checks the keys)
        const auto it = by_hf.find(hf);
        TESSERA_CHECK(it != by_hf.end(), "{}: \"{}\" is no module of this {} model that takes adapters one to one",
                      file, hf, model_type);
        modules.insert(it->second);
    }
    for (const std::string& n : to_save)
        TESSERA_CHECK(saved_names.count(n), "{}: modules_to_save entry \"{}\": {} holds no tensor of it", path, n,
                      file);
    TESSERA_CHECK(!modules.empty() || !saved.empty(), "{}: holds no adapters", file);
    out.lora.target_modules.assign(modules.begin(), modules.end());
    out.lora.modules_to_save.assign(saved.begin(), saved.end());
    out.lora.validate(path);
    const double r = double(out.lora.rank), scale = out.lora.scale();
    for (const auto& [name, value] : patterns[0]) {
        const double R = value.get<double>();
        const double alpha = patterns[1].count(name) ? patterns[1][name].get<double>() : out.lora.alpha;
        const double s_gu = out.lora.rslora ? alpha / std::sqrt(R) : alpha / R;
        TESSERA_CHECK((R == r || R == 2 * r) && std::fabs(s_gu - scale) <= 1e-9 * scale,
                      "{}: rank_pattern \"{}\" = {} with alpha {} scales gate_up_proj by {}, the other adapters by "
                      "{} at rank {}: tessera holds gate_proj and up_proj at one rank and scale (r or 2r = 2·{})",
                      path, name, R, alpha, s_gu, scale, r, r);
    }
    for (const auto& [name, value] : patterns[1])
        TESSERA_CHECK(patterns[0].count(name) || value.get<double>() == out.lora.alpha,
                      "{}: alpha_pattern \"{}\" without a rank_pattern of its own changes gate_up_proj's scale: "
                      "tessera holds every adapter at one scale",
                      path, name);
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
        convert(peft_param(f.load(t.name), t, dst.shape, file).view(), dst);
    }
    for (const auto& e : f.entries())
        TESSERA_CHECK(wanted.count(e.name), "{}: \"{}\" adapts no module of this model", file, e.name);
}

}  // namespace tessera::model
