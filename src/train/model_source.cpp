// Opening tessera and Hugging Face checkpoints, and fine-tuning bases (see model_source.h).
#include "train/model_source.h"

#include <bit>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/arena.h"
#include "core/mxfp4.h"
#include "core/rng.h"
#include "core/safetensors.h"

#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/hf_peft.h"
#include "model/lora.h"
#include "train/config.h"

namespace tessera::train {

namespace fs = std::filesystem;

ModelSource open_model_source(const std::string& path) {
    ModelSource s;
    if (model::is_peft_dir(path)) {  // the adapters on the base they name
        const ModelSource b = open_model_source(model::peft_base(path));
        TESSERA_CHECK(b.base.empty() && !b.peft && !b.config.lora.enabled(), "{}: its base {} is a fine-tune itself",
                      path, b.path);
        s = b;
        s.path = fs::absolute(path).lexically_normal().string();
        s.base = b.path;
        s.hf = false;
        s.peft = true;
        s.config.lora = model::read_peft_config(path, b.config, peft_family(b)).lora;
        return s;
    }
    const fs::path config = fs::path(path) / "config.json";
    if (fs::exists(config)) {
        const Json doc = load_config_json(config.string(), {});
        if (model::is_hf_config(doc)) {
            model::HfImport imported = model::import_hf_config(doc, config.string());
            model::require_supported(imported, config.string());  // never a silently different model
            s.path = fs::absolute(path).lexically_normal().string();
            s.hf = true;
            s.model_type = imported.model_type;
            s.config = imported.model;
            model::untie_stored_head(path, s.config, s.model_type);  // Kimi: the stored head transformers uses
            return s;
        }
    }
    s.path = fs::absolute(resolve_checkpoint(path)).lexically_normal().string();
    const RunConfig cfg = parse_run_config(load_checkpoint_config(s.path), (fs::path(s.path) / "config.json").string());
    s.config = cfg.model;
    s.context = cfg.train.seq_len;
    if (cfg.model.has_frozen_params()) s.base = cfg.train.base;
    return s;
}

void ModelSource::load(const model::Model& m, const BufferGroup& params) const {
    if (peft) {
        load_base(open_model_source(base), m, params, held_targets(params, 0, m.frozen_params(), {}), {});
        model::load_peft_adapter(path, model::peft_tensor_map(m.param_specs(), config, peft_family(*this)), params);
        check_finite(params, path);
        return;
    }
    if (hf) {
        model::load_hf_checkpoint(path, model::hf_tensor_map(m.param_specs(), config, model_type), params);
        check_finite(params, path);  // (tessera checkpoints: load_params checks)
        return;
    }
    if (base.empty()) {
        load_params(path, params);
        return;
    }
    // a fine-tune: the base it names (the same one: its hash), then what the fine-tune trained
    const ModelSource b = open_model_source(base);
    const std::vector<ParamTarget> frozen = held_targets(params, 0, m.frozen_params(), {});
    load_base(b, m, params, frozen, {});
    const TrainerState st = load_trainer_state(path);
    const int64_t h = frozen_hash(
        m, frozen, [](size_t) { return false; }, nullptr);
    TESSERA_CHECK(!st.base_hash || *st.base_hash == h,
                  "{}: its base {} has changed since the fine-tune began (frozen weights hash {}, the checkpoint says "
                  "{})",
                  path, base, h, *st.base_hash);
    load_params(path, params, {}, m.frozen_params());
}

namespace {
// Every key the run's model section sets (but lora, over a plain base) must equal the base's: its architecture.
void check_same(
    const Json& run, const Json& base, const std::string& path, const ModelSource& src, const std::string& where) {
    for (const auto& [key, value] : run.items()) {
        const std::string at = path + "." + key;
        if (at == "model.lora" && !src.peft) continue;  // the run's own adapters (a PEFT base's are its own)
        const auto it = base.find(key);
        TESSERA_CHECK(it != base.end() && (value.is_object() ? it->is_object() : *it == value),
                      "{}: {} = {} but the base {} has {}: a fine-tune takes its architecture from train.base (set "
                      "only model.lora, or leave the model section out)",
                      where, at, value.dump(), src.path, it == base.end() ? std::string("no such key") : it->dump());
        if (value.is_object()) check_same(value, *it, at, src, where);
    }
}
}  // namespace

std::string peft_family(const ModelSource& s) {
    if (s.peft) return peft_family(open_model_source(s.base));
    return s.hf ? s.model_type : hf_family(s.config);
}

std::string hf_family(const model::ModelConfig& c) {
    model::ModelConfig plain = c;
    plain.lora = {};
    return model::export_hf_config(plain, {}).at("model_type").get<std::string>();
}

std::string ModelSource::tokenizer_dir() const {
    if (hf) {
        const bool has = fs::exists(fs::path(path) / "tokenizer.json") || fs::exists(fs::path(path) / "tiktoken.model");
        return has ? path : std::string();
    }
    if (base.empty()) return {};
    return open_model_source(base).tokenizer_dir();
}

Json base_model_json(const ModelSource& base, const Json& run_model, const std::string& where) {
    TESSERA_CHECK(run_model.is_object(), "{}: model must be an object", where);
    TESSERA_CHECK(base.peft || (base.base.empty() && !base.config.lora.enabled()),
                  "train.base {}: a LoRA fine-tune itself; merge it into a plain model first (tessera export-hf "
                  "--merge-lora) and fine-tune that",
                  base.path);
    Json j = model::to_json(base.config);
    check_same(run_model, j, "model", base, where);  // a PEFT base: its adapters train on, model.lora theirs
    if (run_model.contains("lora") && !base.peft) j["lora"] = run_model["lora"];
    return j;
}

void load_base(const ModelSource& base,
               const model::Model& m,
               const BufferGroup& params,
               const std::vector<ParamTarget>& targets,
               ExpertSlice experts) {
    TESSERA_CHECK(base.peft || (base.base.empty() && !base.config.lora.enabled()),
                  "train.base {}: a LoRA fine-tune itself; merge it first (tessera export-hf --merge-lora)", base.path);
    const std::vector<BufferSpec>& specs = m.param_specs();
    if (base.peft) {  // the base it names, then its adapters where they train (whole or this rank's ranges)
        load_base(open_model_source(base.base), m, params, targets, experts);
        const std::string file = (fs::path(base.path) / "adapter_model.safetensors").string();
        const SafetensorsFile f(file);
        std::vector<BufferSpec> whole_specs = specs;  // every expert's adapters (this rank holds its slice)
        for (BufferSpec& s : whole_specs) s.shape = whole_shape(s, experts);
        std::map<std::string, model::PeftTensor> key;  // tessera parameter -> its PEFT tensor
        for (const model::PeftTensor& t : model::peft_tensor_map(whole_specs, base.config, peft_family(base)))
            key[t.param] = t;
        for (const ParamTarget& t : targets) {
            const std::string& name = specs[t.param].name;
            const auto it = key.find(name);  // its adapters and modules_to_save
            if (it == key.end()) continue;
            const model::PeftTensor& p = it->second;
            const Tensor whole = model::peft_param(f.load(p.name), p, whole_specs[t.param].shape, file);
            t.store(0, whole.ptr<float>() + t.whole_offset, t.length, base.path, name);
        }
        return;
    }
    std::vector<ParamTarget>
        wanted;  // every base parameter (the frozen ones, modules_to_save or all of a full fine-tune)
    for (const ParamTarget& t : targets) {
        if (!model::is_adapter(specs[t.param].name)) wanted.push_back(t);
    }
    if (!base.hf) {
        load_params(base.path, specs, wanted, experts);
        return;
    }
    // a Hugging Face checkpoint: the parameters held whole (or as this rank's experts) read in place; each one
    // FSDP holds as ranges read whole into a temporary, one at a time, and this rank's ranges copied out
    std::vector<BufferSpec> base_specs;  // whole: every expert's tensors (the map names them all)
    int64_t local = 0;                   // experts here
    for (const BufferSpec& s : specs) {
        if (model::is_adapter(s.name)) continue;
        base_specs.push_back(s);
        base_specs.back().shape = whole_shape(s, experts);
        if (s.sharding == Sharding::expert) local = s.shape[0];
    }
    const std::vector<model::HfTensor> whole = model::hf_tensor_map(base_specs, base.config, base.model_type);
    std::map<std::string, std::vector<const ParamTarget*>> ranged;  // parameter -> its FSDP ranges here
    std::set<std::string> loaded;  // what a target asks for (a base read in place, memory.weights_budget, is not)
    for (const ParamTarget& t : wanted) {
        loaded.insert(specs[t.param].name);
        const TensorView held = params.view(t.param);
        if (t.dst != held.data || t.length != held.numel()) ranged[specs[t.param].name].push_back(&t);
    }
    const std::vector<model::HfTensor> sliced =
        experts.total > 0 ? model::slice_experts(whole, experts.first, local) : whole;
    std::vector<model::HfTensor> map = sliced;
    for (model::HfTensor& t : map) {
        if (ranged.count(t.param) || (!loaded.count(t.param) && t.copy == model::HfTensor::Copy::none)) t.here = false;
    }
    model::load_hf_checkpoint(base.path, map, params);
    check_finite(params, base.path);
    for (const auto& [name, targets] : ranged) {  // (experts: this rank's, as f32)
        const size_t i = size_t(params.index_of(name));
        const BufferSpec& spec = specs[i];
        BufferGroup tmp("base", {{.name = name, .dtype = DType::f32, .shape = spec.shape}});
        const std::vector<const BufferGroup*> groups{&tmp};
        tmp.allocate(std::make_shared<Arena>(predict_arena_bytes(groups, kBufferAlign), kBufferAlign));
        std::vector<model::HfTensor> part;
        for (const model::HfTensor& t : sliced) {
            if (t.param == name) part.push_back(t);
        }
        model::load_hf_checkpoint(base.path, part, tmp, /*every_tensor=*/false);
        check_finite(tmp, base.path);
        const float* src = tmp.view(size_t(0)).ptr<float>();
        const int64_t first = held_target(i, spec, experts, nullptr).whole_offset;  // of the tensor held here
        for (const ParamTarget* t : targets) t->store(0, src + (t->whole_offset - first), t->length, base.path, name);
    }
}

int64_t frozen_hash(const model::Model& m,
                    const std::vector<ParamTarget>& pieces,
                    const std::function<bool(size_t)>& sharded,
                    const parallel::Mesh* mesh,
                    const std::function<void(const ParamTarget&)>& done) {
    // each element once over the ranks: a sharded parameter's on the rank holding it, a whole dense one on its
    // stage's rank 0, an expert on the first rank of its expert-data group
    const bool dense_here = !mesh || mesh->data().rank() == 0;
    const bool experts_here = !mesh || mesh->expert_data().rank() == 0;
    int64_t sum = 0;
    std::vector<std::byte> staging;  // a device's values, copied to the host
    for (const ParamTarget& t : pieces) {
        if (t.param >= m.frozen_params()) continue;
        const BufferSpec& spec = m.param_specs()[t.param];
        const bool counted = sharded(t.param) || (spec.sharding == Sharding::expert ? experts_here : dense_here);
        if (!counted) continue;
        const uint64_t name = hash_name(spec.name);
        const void* values = t.host_values(staging);
        int64_t part = 0;
#pragma omp parallel for reduction(+ : part) schedule(static)
        for (int64_t j = 0; j < t.length; ++j) {
            // an element's f32 bits (a bf16 or MXFP4 one's widened: the hash does not depend on how it is held)
            uint32_t bits;
            if (t.dtype == DType::bf16) {
                bits = uint32_t(static_cast<const bf16*>(values)[j].bits) << 16;
            } else if (t.dtype == DType::mxfp4) {
                float x;
                mxfp4_to_f32(Mxfp4{static_cast<const uint8_t*>(values), j, static_cast<const uint8_t*>(t.scales)}, 1,
                             &x);
                bits = std::bit_cast<uint32_t>(x);
            } else {
                std::memcpy(&bits, static_cast<const float*>(values) + j, sizeof bits);
            }
            part += int64_t(mix64((name + uint64_t(t.whole_offset + j) * 0x9e3779b97f4a7c15ull) ^ bits) >> 44);
        }
        sum += part;
        if (done) done(t);
    }
    if (mesh && mesh->world_size() > 1) sum = mesh->world().all_reduce_sum<int64_t>(sum);
    return sum;
}

}  // namespace tessera::train
