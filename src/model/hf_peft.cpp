// LoRA adapters in PEFT's format (see hf_peft.h).
#include "model/hf_peft.h"

#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <span>

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

std::set<std::string> expert_weights(const std::vector<BufferSpec>& specs) {
    std::set<std::string> out;
    for (const BufferSpec& s : specs)
        if (s.sharding == Sharding::expert && s.shape.ndim == 3 && s.name.ends_with(".weight")) out.insert(s.name);
    return out;
}

std::string experts_module(const std::string& module) { return module.substr(0, module.rfind('.')); }

// The Hugging Face tensors of a model's base parameters (the adapters left out)
std::vector<HfTensor> base_tensors(const std::vector<BufferSpec>& specs,
                                   const ModelConfig& c,
                                   const std::string& model_type) {
    std::vector<BufferSpec> base;
    for (const BufferSpec& s : specs) {
        if (!is_adapter(s.name)) base.push_back(s);
    }
    ModelConfig plain = c;
    plain.lora = {};
    return hf_tensor_map(base, plain, model_type);
}

// A tessera parameter as transformers stores it: its tensor's name, and what the stored value is less than tessera's
// (Qwen3NextRMSNorm keeps w of its scale 1 + w: offset 1)
struct Stored {
    std::string name;
    float offset = 0.f;
};

// tessera parameter -> the transformers tensor it is (its stored name, renamed), for every parameter stored one to
// one (whole, perhaps with an offset); name "" for those stored fused, split, padded or per expert (no PEFT tensor of
// their own)
std::map<std::string, Stored> param_names(const std::vector<BufferSpec>& specs,
                                          const ModelConfig& c,
                                          const std::string& model_type) {
    std::map<std::string, Stored> out;
    for (const HfTensor& t : base_tensors(specs, c, model_type)) {
        if (t.copy != HfTensor::Copy::none) continue;
        const bool one_to_one = t.expert < 0 && t.rows.groups == 0 && t.pad_to == 0 && !out.count(t.param);
        out[t.param] = one_to_one ? Stored{transformers_module(t.name, model_type), t.offset} : Stored{};
    }
    return out;
}

// tessera module -> the transformers module it is, for every weight stored one to one ("" otherwise)
std::map<std::string, std::string> module_names(const std::vector<BufferSpec>& specs,
                                                const ModelConfig& c,
                                                const std::string& model_type) {
    std::map<std::string, std::string> out;
    for (const auto& [param, stored] : param_names(specs, c, model_type)) {
        const std::string& name = stored.name;
        if (ends_with(param, ".weight"))
            out[strip(param, ".weight")] =
                ends_with(name, ".weight") && stored.offset == 0.f ? strip(name, ".weight") : std::string();
    }
    return out;
}

// A tessera projection that is a part of a PEFT module with several: its transformers module and where it lies
struct Part {
    std::string module;  // transformers module (the routed experts': <layer>.mlp.experts)
    std::string target;  // what PEFT adapts: the module, or the stacked experts' gate_up_proj or down_proj
    int part = 0, parts = 0;
    HfTensor::Rows rows;
    int64_t out = 0;
};

// tessera module -> its part, for every projection stored as row groups of a fused 2-D weight (in_proj_qkvz, ...)
// and every routed expert projection of a family whose transformers class stacks them (gate_up_proj: gate's rows
// then up's; down_proj alone)
std::map<std::string, Part> parts_of(const std::vector<BufferSpec>& specs,
                                     const ModelConfig& c,
                                     const std::string& model_type) {
    std::map<std::string, std::vector<const HfTensor*>> fused;  // stored tensor -> its parts
    const std::vector<HfTensor> map = base_tensors(specs, c, model_type);
    for (const HfTensor& t : map) {
        if (t.rows.groups > 0 && t.shape.ndim == 2 && t.expert < 0 && t.copy == HfTensor::Copy::none &&
            ends_with(t.param, ".weight") && ends_with(t.name, ".weight"))
            fused[t.name].push_back(&t);
    }
    std::map<std::string, Part> out;
    for (auto& [name, ts] : fused) {
        std::sort(ts.begin(), ts.end(), [](auto* x, auto* y) { return x->rows.offset < y->rows.offset; });
        const std::string m = transformers_module(strip(name, ".weight"), model_type);
        for (size_t k = 0; k < ts.size(); ++k)
            out[strip(ts[k]->param, ".weight")] = {m, m, int(k), int(ts.size()), ts[k]->rows, ts[k]->shape[0]};
    }
    if (!stacks_experts(model_type)) return out;
    for (const BufferSpec& s : specs) {
        if (s.sharding != Sharding::expert || s.shape.ndim != 3 || !ends_with(s.name, ".weight")) continue;
        const std::string module = strip(s.name, ".weight"), x = experts_module(module);
        const int64_t n = s.shape[1];  // rows of this projection
        const std::string gate_up = x + ".gate_up_proj";
        if (module.ends_with(".gate_proj")) out[module] = {x, gate_up, 0, 2, {0, n, 0, 0}, 2 * n};
        if (module.ends_with(".up_proj")) out[module] = {x, gate_up, 1, 2, {n, n, 0, 0}, 2 * n};
        if (module.ends_with(".down_proj")) out[module] = {x, x + ".down_proj", 0, 1, {0, n, 0, 0}, n};
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
    const std::map<std::string, Part> parts = parts_of(specs, c, model_type);
    const std::set<std::string> experts = expert_weights(specs);
    std::set<std::string> adapted;
    std::map<std::string, int> adapted_parts;  // PEFT module with several parts -> how many are adapted
    for (const BufferSpec& s : specs) {
        if (!ends_with(s.name, kA)) continue;
        adapted.insert(strip(s.name, kA));
        if (const auto it = parts.find(strip(s.name, kA)); it != parts.end()) ++adapted_parts[it->second.target];
    }
    std::vector<PeftTensor> out;
    for (const BufferSpec& s : specs) {
        const bool a = ends_with(s.name, kA);
        if (!a && !ends_with(s.name, kB)) continue;
        const std::string module = strip(s.name, a ? kA : kB);
        TESSERA_CHECK(!experts.count(module + ".weight") || stacks_experts(model_type),
                      "PEFT adapters: {}: {} has no transformers class whose stacked experts PEFT adapts, so "
                      "PEFT's form of the routed experts' adapters is not written; export-hf --merge-lora writes "
                      "the model with the adapters merged in",
                      module, model_type);
        if (const auto it = parts.find(module); it != parts.end()) {
            const Part& p = it->second;
            // the experts' wrappers nest in parameter order: gate_up_proj's inside down_proj's when both are adapted
            const bool inner = experts.count(module + ".weight") && !module.ends_with(".down_proj") &&
                               adapted.count(p.module + ".down_proj");
            out.push_back({s.name, kPrefix + p.module + (inner ? ".base_layer" : "") + (a ? kA : kB), p.part, p.parts,
                           p.rows, p.out, adapted_parts[p.target] >= 2});
            continue;
        }
        const auto it = names.find(module);
        TESSERA_CHECK(it != names.end() && !it->second.empty(),
                      "PEFT adapters: {} has no module of its own in the {} layout, so PEFT's form of its adapter is "
                      "not written; export-hf --merge-lora writes the model with the adapters merged in",
                      module, model_type);
        out.push_back({s.name, kPrefix + it->second + (a ? kA : kB)});
    }
    // modules_to_save: the parameters that train whole, under their transformers names (PEFT saves a wrapped
    // module's copy under the module's own name)
    const std::map<std::string, Stored> stored = param_names(specs, c, model_type);
    for (const BufferSpec& s : specs) {
        if (!s.trainable || is_adapter(s.name)) continue;
        const auto it = stored.find(s.name);
        TESSERA_CHECK(it != stored.end() && !it->second.name.empty(),
                      "PEFT adapters: model.lora.modules_to_save: {} is not stored as one tensor of its own in the {} "
                      "layout, so PEFT's form of it is not written; export-hf --merge-lora writes the fine-tuned "
                      "model whole",
                      s.name, model_type);
        PeftTensor t{s.name, kPrefix + it->second.name};
        t.offset = it->second.offset;
        out.push_back(t);
    }
    TESSERA_CHECK(!out.empty(), "PEFT adapters: the model has no adapters and no modules_to_save");
    return out;
}

namespace {
// Where a part's adapter lies in PEFT's tensor: E experts (1: a 2-D parameter), the part's rank r, the PEFT tensor's
// rank R and the first of the part's ranks k0 (0 when R = r: one A shared by every part)
struct RankBlock {
    int64_t E, r, R, k0;
};
RankBlock block_of(const PeftTensor& t, const Shape& param, int64_t R) {
    const int nd = param.ndim;
    const int64_t r = ends_with(t.param, kA) ? param[nd - 2] : param[nd - 1];
    return {nd == 3 ? param[0] : 1, r, R, R == r ? 0 : t.part * r};
}
// element (e, i, j) of a tessera part ([E,] rows, cols) <-> its index in PEFT's tensor [., cols]
int64_t peft_index(bool a, const PeftTensor& t, const RankBlock& b, int64_t cols, int64_t e, int64_t i, int64_t j) {
    if (a) return (e * b.R + b.k0 + i) * cols + j;  // A: i a rank, j an input
    const HfTensor::Rows& g = t.rows;               // B: i a row of the part, j a rank
    const int64_t row = g.groups > 0 ? (i / g.count) * g.stride + g.offset + i % g.count : g.offset + i;
    return row * cols + (b.k0 + j) * b.E + e;
}
// every element of a part: f(e, i, j, index in the part)
template <class F>
void each_element(const Shape& param, F f) {
    const int nd = param.ndim;
    const int64_t E = nd == 3 ? param[0] : 1, ni = param[nd - 2], nj = param[nd - 1];
    for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < ni; ++i)
            for (int64_t j = 0; j < nj; ++j) f(e, i, j, (e * ni + i) * nj + j);
}
}  // namespace

Tensor peft_param(const Tensor& stored, const PeftTensor& t, const Shape& shape, const std::string& file) {
    const TensorView v = stored.view();
    if (t.parts == 0) {
        TESSERA_CHECK(v.dtype == DType::f32 || v.dtype == DType::bf16, "{}: \"{}\" must be f32 or bf16", file, t.name);
        TESSERA_CHECK(v.shape == shape, "{}: \"{}\" is {}, the model needs {}", file, t.name, v.shape.str(),
                      shape.str());
        Tensor param(DType::f32, shape);
        convert(v, param.view());
        if (t.offset != 0.f)
            for (float& x : std::span(param.ptr<float>(), size_t(param.view().numel()))) x += t.offset;
        return param;
    }
    TESSERA_CHECK(v.dtype == DType::f32, "{}: \"{}\" must be f32", file, t.name);
    const bool a = ends_with(t.param, kA);
    const RankBlock one = block_of(t, shape, 0);
    const int64_t E = one.E, r = one.r, in = shape[shape.ndim - 1];
    const int64_t R = v.ndim() == 2 ? (a ? v.size(0) : v.size(1)) / E : 0;
    TESSERA_CHECK(v.ndim() == 2 && (R == r || (t.parts > 1 && R == t.parts * r)) &&
                      (a ? v.size(0) : v.size(1)) == R * E && (a ? v.size(1) == in : v.size(0) == t.out),
                  "{}: \"{}\" is {}; {} at rank {} needs {} (a module of {} parts also at rank {})", file, t.name,
                  v.shape.str(), E > 1 ? fmt::format("{} experts", E) : std::string("an adapter"), r,
                  (a ? Shape{r * E, in} : Shape{t.out, r * E}).str(), t.parts, t.parts * r);
    const RankBlock b = block_of(t, shape, R);
    const int64_t cols = v.size(1);
    const float* src = v.ptr<float>();
    Tensor param(DType::f32, shape);
    float* dst = param.ptr<float>();
    each_element(shape,
                 [&](int64_t e, int64_t i, int64_t j, int64_t k) { dst[k] = src[peft_index(a, t, b, cols, e, i, j)]; });
    if (!a && R > r) {  // the parts apart: B block diagonal (this part's rows zero in the other parts' ranks)
        for (int q = 0; q < t.parts; ++q) {
            if (q == t.part) continue;
            const RankBlock other{E, r, R, q * r};
            each_element(shape, [&](int64_t e, int64_t i, int64_t j, int64_t) {
                TESSERA_CHECK(src[peft_index(false, t, other, cols, e, i, j)] == 0.f,
                              "{}: \"{}\" at rank {} = {}·r couples the projections it fuses (a nonzero element off "
                              "B's diagonal blocks{}): not {} rank-{} adapters",
                              file, t.name, R, t.parts, E > 1 ? fmt::format(", expert {}", e) : std::string(), t.parts,
                              r);
            });
        }
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
    // several parts adapted: the module's adapter at rank parts·r, alpha scaled so that its scale is r's
    Json rank_pattern = Json::object(), alpha_pattern = Json::object();
    std::deque<Tensor> stored;  // modules_to_save kept less an offset (a deque: the views stay put)
    for (const PeftTensor& t : map) {
        if (t.parts == 0) {
            if (t.offset != 0.f) {
                const TensorView v = params.view(t.param);
                Tensor& w = stored.emplace_back(DType::f32, v.shape);
                const float* src = v.ptr<float>();
                float* dst = w.ptr<float>();
                for (int64_t i = 0; i < v.numel(); ++i) dst[i] = src[i] - t.offset;
            }
            tensors.push_back({t.name, t.offset != 0.f ? stored.back().view() : params.view(t.param)});
            if (ends_with(t.name, kA)) modules.push_back(strip(t.name, kA).substr(std::strlen(kPrefix)));
            if (!is_adapter(t.param)) saved.insert(module_of(t.name.substr(std::strlen(kPrefix))));
            continue;
        }
        const bool a = ends_with(t.param, kA);
        const TensorView v = params.view(t.param);
        const RankBlock one = block_of(t, v.shape, 0);
        const int64_t R = t.wide ? t.parts * one.r : one.r;
        const Shape shape = a ? Shape{R * one.E, v.shape[v.shape.ndim - 1]} : Shape{t.out, R * one.E};
        auto [it, fresh] = stacked.try_emplace(t.name, DType::f32, shape);  // zero: B's off-diagonal blocks stay so
        const RankBlock b = t.wide ? RankBlock{one.E, one.r, R, t.part * one.r} : RankBlock{one.E, one.r, R, 0};
        const float* src = v.ptr<float>();
        float* dst = it->second.ptr<float>();
        each_element(v.shape, [&](int64_t e, int64_t i, int64_t j, int64_t k) {
            dst[peft_index(a, t, b, shape[1], e, i, j)] = src[k];
        });
        std::string module = strip(t.name, a ? kA : kB).substr(std::strlen(kPrefix));
        if (module.ends_with(".base_layer")) module = strip(module, ".base_layer");
        const bool experts = v.shape.ndim == 3;
        const std::string target =
            experts ? module + (strip(t.param, a ? kA : kB).ends_with(".down_proj") ? ".down_proj" : ".gate_up_proj")
                    : module;
        if (experts) {
            stacked_params.insert(target);
        } else if (a && std::find(modules.begin(), modules.end(), module) == modules.end()) {
            modules.push_back(module);
        }
        if (t.wide) {
            rank_pattern[target] = R;
            alpha_pattern[target] = c.alpha * (c.rslora ? std::sqrt(double(t.parts)) : double(t.parts));
        }
    }
    for (const auto& [name, tensor] : stacked) tensors.push_back({name, tensor.view()});
    write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
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
        if (!hf.name.empty()) by_tensor[hf.name] = param;
    // the PEFT modules of several tessera projections -> those (in part order) and their number of parts: the
    // stacked expert parameters (target_parameters; "<experts module>.gate_up_proj" adapts tessera's gate_proj and
    // up_proj of those experts, ".down_proj" its down_proj; an entry names every key that ends with it, as PEFT) and
    // the fused projections (in_proj_qkvz, ...: their adapters in the file)
    std::map<std::string, std::vector<std::string>> by_param, by_fused;
    std::map<std::string, int> parts;
    const std::set<std::string> experts = expert_weights(specs);
    for (const auto& [module, p] : parts_of(specs, plain, model_type)) {
        const bool stacked = experts.count(module + ".weight") > 0;
        std::vector<std::string>& list = (stacked ? by_param : by_fused)[p.target];
        list.resize(size_t(p.parts));
        list[size_t(p.part)] = module;
        parts[p.target] = p.parts;
    }
    std::set<std::string> modules, stacked_modules;  // experts modules with a stacked adapter
    std::set<std::string> multi;                     // the adapted PEFT modules of several parts
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
                multi.insert(key);
            }
            TESSERA_CHECK(any, "{}: target_parameters entry \"{}\" names no stacked expert parameter of this {} model",
                          path, n, model_type);
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
        if (const auto fused = by_fused.find(hf); fused != by_fused.end()) {  // every projection it fuses
            modules.insert(fused->second.begin(), fused->second.end());
            multi.insert(hf);
            continue;
        }
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
    // per-module ranks: only those of PEFT modules of several parts, at r (every part from one A) or parts·r (apart),
    // with the same scale
    std::map<std::string, Json> patterns[2];
    std::map<std::string, std::vector<int>> matched;  // pattern -> the parts of each adapted module it matches
    for (int k = 0; k < 2; ++k) {
        const char* key = k == 0 ? "rank_pattern" : "alpha_pattern";
        if (const Json* pat = get(key)) {
            TESSERA_CHECK(pat->is_object(), "{}: {} must be an object", path, key);
            for (const auto& [name, value] : pat->items()) {
                const std::regex re("(.*\\.)?(" + name + ")$");
                bool ok = value.is_number();
                for (const auto& [hf, module] : by_hf) ok = ok && !std::regex_match(hf, re);
                for (const std::string& m : multi)
                    if (std::regex_match(m, re) && parts.at(m) > 1) matched[name].push_back(parts.at(m));
                TESSERA_CHECK(ok && !matched[name].empty(),
                              "{}: {} \"{}\" (per-module ranks) is not supported: only a module that adapts several "
                              "projections at once (the stacked experts' gate_up_proj, a fused in_proj_qkvz, ...) may "
                              "differ (rank r or parts·r, the same scale)",
                              path, key, name);
                patterns[k][name] = value;
            }
        }
    }
    const double r = double(out.lora.rank), scale = out.lora.scale();
    for (const auto& [name, value] : patterns[0]) {
        const double R = value.get<double>();
        const double alpha = patterns[1].count(name) ? patterns[1][name].get<double>() : out.lora.alpha;
        const double s_m = out.lora.rslora ? alpha / std::sqrt(R) : alpha / R;
        for (const int n : matched[name])
            TESSERA_CHECK(
                (R == r || R == n * r) && std::fabs(s_m - scale) <= 1e-9 * scale,
                "{}: rank_pattern \"{}\" = {} with alpha {} scales its module by {}, the other adapters by {} "
                "at rank {}: tessera holds the {} projections it adapts at one rank and scale (r or {}·{})",
                path, name, R, alpha, s_m, scale, r, n, n, r);
    }
    for (const auto& [name, value] : patterns[1])
        TESSERA_CHECK(patterns[0].count(name) || value.get<double>() == out.lora.alpha,
                      "{}: alpha_pattern \"{}\" without a rank_pattern of its own changes its module's scale: "
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
