// Hugging Face checkpoint layout of the Kimi family and sharded safetensors I/O (see hf_checkpoint.h).
#include "model/hf_checkpoint.h"
#include "model/vision.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "core/check.h"
#include "core/config_reader.h"
#include "core/file.h"
#include "core/fp8.h"
#include "core/mxfp4.h"
#include "core/safetensors.h"
#include "model/hf_index.h"

namespace tessera::model {

namespace fs = std::filesystem;

namespace {
constexpr int64_t kFp8Block = 128;  // DeepSeek's weight_block_size

Shape with_unit_middle(const Shape& s) { return Shape{s[0], 1, s[1]}; }  // [C, W] -> [C, 1, W]

// a view of one stored tensor inside its tessera parameter
TensorView place(const HfTensor& t, const TensorView& param) {
    if (t.expert >= 0) return param.slice0(t.expert, t.expert + 1).reshape(t.shape);
    if (t.pad_to > 0 || t.rows.groups > 0) return param;
    return param.reshape(t.shape);
}

// (layer index, the rest after "model.layers.L.") of a per-layer parameter name, or layer −1
std::pair<int64_t, std::string> split_layer(const std::string& n) {
    const std::string layers = "model.layers.";
    if (n.rfind(layers, 0) != 0) return {-1, n};
    const size_t dot = n.find('.', layers.size());
    return {std::stoll(n.substr(layers.size(), dot - layers.size())), n.substr(dot + 1)};
}

// A grouped [E, ...] expert parameter (tail "mlp.experts.gate_proj.weight") as one stored tensor per expert,
// "model.layers.L.mlp.experts.E.gate_proj.weight" (Qwen3-Next, DeepSeek-V3.2)
void per_expert(const BufferSpec& spec, const std::string& lp, const std::string& tail, std::vector<HfTensor>& out) {
    const std::string proj = tail.substr(std::string("mlp.experts.").size());
    for (int64_t e = 0; e < spec.shape[0]; ++e) {
        out.push_back(
            {spec.name, fmt::format("{}mlp.experts.{}.{}", lp, e, proj), Shape{spec.shape[1], spec.shape[2]}, e});
    }
}

// DeepSeek-V3.2 (transformers' DeepseekV32ForCausalLM): tessera's names, experts stored one by one
std::vector<HfTensor> deepseek_v32_map(const std::vector<BufferSpec>& params) {
    std::vector<HfTensor> out;
    for (const auto& spec : params) {
        const auto [layer, tail] = split_layer(spec.name);
        if (tail.rfind("mlp.experts.", 0) == 0) {
            per_expert(spec, fmt::format("model.layers.{}.", layer), tail, out);
        } else {
            out.push_back({spec.name, spec.name, spec.shape});
        }
    }
    return out;
}

// Qwen3-Next (transformers' Qwen3NextForCausalLM): see hf_checkpoint.h
std::vector<HfTensor> qwen3_next_map(const std::vector<BufferSpec>& params, const ModelConfig& c) {
    const KdaConfig k = c.kda_layer(true);
    const int64_t Hk = k.num_heads, Dk = k.head_dim, r = k.hv() / k.num_heads, Dv = k.v_dim();
    const int64_t W = 2 * Dk + 2 * r * Dv, C = c.d_model, D = c.head_dim_or_default(), H = c.n_heads;
    const int64_t qkvz = Hk * W, conv = 2 * Hk * Dk + Hk * r * Dv;
    std::vector<HfTensor> out;
    for (const auto& spec : params) {
        const std::string& n = spec.name;
        const auto [layer, tail] = split_layer(n);
        HfTensor t{n, n, spec.shape};
        auto fused = [&](const std::string& name, Shape stored, int64_t offset, int64_t count, int64_t stride,
                         int64_t groups) {
            t.name = name;
            t.shape = stored;
            t.rows = {offset, count, stride, groups};
        };
        const bool gdn = layer >= 0 && c.layer_type(layer) == "gdn";
        const std::string lp = fmt::format("model.layers.{}.", layer), la = lp + "linear_attn.";
        if (n == "model.norm.weight" || tail == "input_layernorm.weight" || tail == "post_attention_layernorm.weight" ||
            tail == "self_attn.q_norm.weight" || tail == "self_attn.k_norm.weight") {
            t.offset = 1.f;  // Qwen3NextRMSNorm: x̂·(1 + w)
        } else if (tail == "mlp.gate.e_score_correction_bias") {
            continue;  // Qwen routes without a selection bias
        } else if (tail.rfind("mlp.experts.", 0) == 0) {
            per_expert(spec, lp, tail, out);
            continue;
        } else if (tail.rfind("mlp.shared_experts.", 0) == 0) {
            t.name = lp + "mlp.shared_expert." + tail.substr(std::string("mlp.shared_experts.").size());
        } else if (gdn && tail.rfind("self_attn.", 0) == 0) {
            const std::string a = tail.substr(std::string("self_attn.").size());
            if (a == "q_proj.weight")
                fused(la + "in_proj_qkvz.weight", Shape{qkvz, C}, 0, Dk, W, Hk);
            else if (a == "k_proj.weight")
                fused(la + "in_proj_qkvz.weight", Shape{qkvz, C}, Dk, Dk, W, Hk);
            else if (a == "v_proj.weight")
                fused(la + "in_proj_qkvz.weight", Shape{qkvz, C}, 2 * Dk, r * Dv, W, Hk);
            else if (a == "g_proj.weight")
                fused(la + "in_proj_qkvz.weight", Shape{qkvz, C}, 2 * Dk + r * Dv, r * Dv, W, Hk);
            else if (a == "b_proj.weight")
                fused(la + "in_proj_ba.weight", Shape{2 * Hk * r, C}, 0, r, 2 * r, Hk);
            else if (a == "a_proj.weight")
                fused(la + "in_proj_ba.weight", Shape{2 * Hk * r, C}, r, r, 2 * r, Hk);
            else if (a == "q_conv1d.weight")
                fused(la + "conv1d.weight", Shape{conv, 1, k.conv_size}, 0, Hk * Dk, 0, 1);
            else if (a == "k_conv1d.weight")
                fused(la + "conv1d.weight", Shape{conv, 1, k.conv_size}, Hk * Dk, Hk * Dk, 0, 1);
            else if (a == "v_conv1d.weight")
                fused(la + "conv1d.weight", Shape{conv, 1, k.conv_size}, 2 * Hk * Dk, Hk * r * Dv, 0, 1);
            else if (a == "o_norm.weight")
                t.name = la + "norm.weight";
            else if (a == "o_proj.weight")
                t.name = la + "out_proj.weight";
            else
                t.name = la + a;  // A_log, dt_bias
        } else if (tail == "self_attn.q_proj.weight") {
            fused(lp + "self_attn.q_proj.weight", Shape{2 * H * D, C}, 0, D, 2 * D, H);
        } else if (tail == "self_attn.g_proj.weight") {
            fused(lp + "self_attn.q_proj.weight", Shape{2 * H * D, C}, D, D, 2 * D, H);
        }
        out.push_back(t);
    }
    return out;
}

// Calls f(parameter row, stored row, rows) for each block of rows a fused entry owns.
template <class F>
void for_row_blocks(const HfTensor& t, F f) {
    if (t.rows.groups == 0) return f(int64_t(0), int64_t(0), t.shape[0]);
    for (int64_t g = 0; g < t.rows.groups; ++g) f(g * t.rows.count, g * t.rows.stride + t.rows.offset, t.rows.count);
}
// fill(out) writes the f32 values of dst; a dst held in bf16 (a frozen base) is staged through f32 (its other rows
// kept: a fused stored tensor fills some rows of a parameter only) and rounded back
template <class Fill>
void in_f32(const TensorView& dst, Fill fill) {
    if (dst.dtype == DType::f32) {
        fill(dst.ptr<float>());
        return;
    }
    Tensor staged(DType::f32, dst.shape);
    convert(dst, staged.view());
    fill(staged.ptr<float>());
    convert(staged.view(), dst);
}

std::string head_name(const std::string& model_type) {
    return model_type == "kimi_k3" ? "language_model.lm_head.weight" : "lm_head.weight";
}

std::vector<HfTensor> family_map(const std::vector<BufferSpec>& params,
                                 const ModelConfig& c,
                                 const std::string& model_type) {
    if (model_type == "qwen3_next") return qwen3_next_map(params, c);
    if (model_type == "deepseek_v32") return deepseek_v32_map(params);
    TESSERA_CHECK(model_type == "kimi_linear" || model_type == "kimi_k3",
                  "Hugging Face weights of {} checkpoints are not supported yet (kimi_linear, kimi_k3, qwen3_next, "
                  "deepseek_v32)",
                  model_type);
    const bool k3 = model_type == "kimi_k3";
    const std::string P = k3 ? "language_model.model." : "model.";
    std::vector<HfTensor> out;
    for (const auto& spec : params) {
        const std::string& n = spec.name;
        if (n == "lm_head.weight") {
            out.push_back({n, k3 ? "language_model.lm_head.weight" : n, spec.shape});
            continue;
        }
        if (is_vision_param(n)) {  // K3's image tower and projector: the checkpoint's own names
            TESSERA_CHECK(k3, "hf_tensor_map: {} checkpoints have no image tower ({})", model_type, n);
            out.push_back({n, n, spec.shape});
            continue;
        }
        TESSERA_CHECK(n.rfind("model.", 0) == 0, "hf_tensor_map: unexpected parameter {}", n);
        std::string rest = n.substr(6);  // after "model."
        const std::string layers = "layers.";
        if (rest.rfind(layers, 0) != 0) {
            out.push_back({n, P + rest, spec.shape});
            continue;
        }
        const size_t dot = rest.find('.', layers.size());
        const int64_t layer = std::stoll(rest.substr(layers.size(), dot - layers.size()));
        const std::string lp = P + rest.substr(0, dot + 1);  // ".../layers.L."
        const std::string tail = rest.substr(dot + 1);
        if (c.moe.is_moe_layer(layer) && tail.rfind("mlp.", 0) == 0) {
            const std::string moe = lp + "block_sparse_moe.";
            const std::string t = tail.substr(4);
            const char* w = t == "experts.gate_proj.weight"   ? "w1"
                            : t == "experts.up_proj.weight"   ? "w3"
                            : t == "experts.down_proj.weight" ? "w2"
                                                              : nullptr;
            if (w) {
                for (int64_t e = 0; e < spec.shape[0]; ++e) {
                    out.push_back({n, moe + "experts." + std::to_string(e) + "." + w + ".weight",
                                   Shape{spec.shape[1], spec.shape[2]}, e});
                }
            } else {
                out.push_back({n, moe + t, spec.shape});
            }
        } else if (tail == "self_attn.q_conv1d.weight" || tail == "self_attn.k_conv1d.weight" ||
                   tail == "self_attn.v_conv1d.weight") {
            out.push_back({n, lp + tail, with_unit_middle(spec.shape)});
        } else if (tail == "self_attn.A_log") {
            if (k3) {
                const int64_t pad = std::max<int64_t>(128, spec.shape[0]);
                out.push_back({n, lp + tail, Shape{pad}, -1, pad});
            } else {
                out.push_back({n, lp + tail, Shape{1, 1, spec.shape[0], 1}});
            }
        } else if (c.moe.experts > 0 && tail.rfind("mlp.", 0) == 0) {  // a dense MLP layer of an MoE model
            out.push_back({n, lp + tail, spec.shape, -1, 0, lp + "block_sparse_moe." + tail.substr(4)});
        } else {
            out.push_back({n, lp + tail, spec.shape});
        }
    }
    return out;
}
}  // namespace

std::vector<HfTensor> hf_tensor_map(const std::vector<BufferSpec>& params,
                                    const ModelConfig& c,
                                    const std::string& model_type) {
    std::vector<HfTensor> out = family_map(params, c, model_type);
    if (c.tie_embeddings) {  // the head a tied checkpoint may carry: written for Kimi, whose loader never ties
        const bool kimi = model_type == "kimi_linear" || model_type == "kimi_k3";
        HfTensor head{.param = "model.embed_tokens.weight",
                      .name = head_name(model_type),
                      .shape = Shape{c.vocab_size, c.d_model},
                      .copy = kimi ? HfTensor::Copy::saved : HfTensor::Copy::load_only};
        out.push_back(head);
    }
    return out;
}

void save_hf_checkpoint(const std::string& dir,
                        const std::vector<HfTensor>& map,
                        const BufferGroup& params,
                        size_t shard_bytes,
                        DType dtype,
                        DType expert_dtype) {
    TESSERA_CHECK(dtype == DType::f32 || dtype == DType::bf16, "save_hf_checkpoint: dtype must be f32 or bf16");
    fs::create_directories(dir);
    std::vector<Tensor> owned;  // assembled (padded, fused, offset) or converted copies
    owned.reserve(2 * map.size());
    std::vector<NamedTensor> all;
    std::vector<NamedTensor> quantised;       // MXFP4 experts (written as they are)
    std::map<std::string, size_t> assembled;  // stored name -> index in all
    for (const auto& t : map) {
        TensorView p = params.view(t.param);
        if (t.copy == HfTensor::Copy::load_only) continue;
        if (expert_dtype == DType::mxfp4 && t.expert >= 0) {
            TESSERA_CHECK(is_plain(t) && t.shape.ndim == 2 && t.shape[1] % kMxfp4Block == 0,
                          "MXFP4 experts: \"{}\" {} does not have rows of whole blocks of 32 values", t.name,
                          t.shape.str());
            const TensorView v = place(t, p);
            const int64_t rows = t.shape[0], cols = t.shape[1];
            Tensor wide(DType::f32, t.shape);
            convert(v, wide.view());
            std::vector<uint8_t> blocks(size_t(rows * cols / kMxfp4Block * kMxfp4BlockBytes));
            f32_to_mxfp4(wide.ptr<float>(), rows * cols, blocks.data());
            Tensor packed(DType::u8, Shape{rows, cols / 2}), scales(DType::u8, Shape{rows, cols / kMxfp4Block});
            mxfp4_split(blocks.data(), rows, cols, packed.ptr<uint8_t>(), scales.ptr<uint8_t>());
            const std::string stem = t.name.substr(0, t.name.size() - std::string("weight").size());
            owned.push_back(std::move(packed));
            quantised.push_back({stem + "weight_packed", owned.back().view()});
            owned.push_back(std::move(scales));
            quantised.push_back({stem + "weight_scale", owned.back().view()});
            continue;
        }
        if (is_plain(t)) {
            all.push_back({t.name, place(t, p)});
            continue;
        }
        auto [it, fresh] = assembled.try_emplace(t.name, all.size());
        if (fresh) {
            Tensor z(DType::f32, t.shape);
            std::fill(z.ptr<float>(), z.ptr<float>() + z.numel(), 0.f);
            owned.push_back(std::move(z));
            all.push_back({t.name, owned.back().view()});
        }
        float* dst = all[it->second].tensor.ptr<float>();
        const float* src = p.ptr<float>();
        const int64_t cols = t.pad_to > 0 ? 1 : t.shape.numel() / t.shape[0];
        if (t.pad_to > 0) {
            for (int64_t i = 0; i < p.numel(); ++i) dst[i] = src[i] - t.offset;
            continue;
        }
        for_row_blocks(t, [&](int64_t prow, int64_t srow, int64_t rows) {
            for (int64_t i = 0; i < rows * cols; ++i) dst[srow * cols + i] = src[prow * cols + i] - t.offset;
        });
    }
    if (dtype == DType::bf16) {
        for (auto& nt : all) {
            Tensor b(DType::bf16, nt.tensor.shape);
            convert(nt.tensor, b.view());
            owned.push_back(std::move(b));
            nt.tensor = owned.back().view();
        }
    }
    all.insert(all.end(), quantised.begin(), quantised.end());
    // consecutive tensors into shards of at most shard_bytes (a larger tensor gets a shard of its own)
    std::vector<std::vector<NamedTensor>> shards(1);
    size_t bytes = 0, total = 0;
    for (const auto& nt : all) {
        const size_t nb = nt.tensor.nbytes();
        if (bytes > 0 && bytes + nb > shard_bytes) {
            shards.emplace_back();
            bytes = 0;
        }
        shards.back().push_back(nt);
        bytes += nb;
        total += nb;
    }
    Json weight_map = Json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
        const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
        write_safetensors((fs::path(dir) / file).string(), shards[i], {{"format", "pt"}});
        for (const auto& nt : shards[i]) weight_map[nt.name] = file;
    }
    const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text_atomic((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
}

std::map<std::string, std::string> stored_tensors(const std::string& dir) {
    const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
    std::map<std::string, std::string> where;
    if (fs::exists(index_path)) {
        const std::string text = read_text(index_path.string(), size_t(256) << 20);
        for (const auto& [tensor, file] : parse_hf_index(text, index_path.string())) {
            where[tensor] = (fs::path(dir) / file).string();
        }
    } else {
        const std::string single = (fs::path(dir) / "model.safetensors").string();
        TESSERA_CHECK(fs::exists(single), "{}: neither model.safetensors.index.json nor model.safetensors", dir);
        const SafetensorsFile file(single);  // named: a temporary would end before the loop
        for (const auto& e : file.entries()) where[e.name] = single;
    }
    return where;
}

namespace {

// a stored tensor as f32, whatever its float dtype on disk
Tensor load_f32(const SafetensorsFile& f, const std::string& name) {
    Tensor raw = f.load(name);
    if (raw.view().dtype == DType::f32) return raw;
    Tensor out(DType::f32, raw.view().shape);
    convert(raw.view(), out.view());
    return out;
}

bool same_bits(const TensorView& a, const TensorView& b) {
    return a.shape == b.shape && a.dtype == b.dtype && std::memcmp(a.data, b.data, size_t(a.nbytes())) == 0;
}
}  // namespace

bool untie_stored_head(const std::string& dir, ModelConfig& config, const std::string& model_type) {
    if (!config.tie_embeddings || (model_type != "kimi_linear" && model_type != "kimi_k3")) return false;
    const std::map<std::string, std::string> where = stored_tensors(dir);
    const std::string head = head_name(model_type), embed = model_type == "kimi_k3"
                                                                ? "language_model.model.embed_tokens.weight"
                                                                : "model.embed_tokens.weight";
    if (!where.count(head) || !where.count(embed)) return false;
    const Tensor h = load_f32(SafetensorsFile(where.at(head)), head),
                 e = load_f32(SafetensorsFile(where.at(embed)), embed);
    if (same_bits(h.view(), e.view())) return false;
    config.tie_embeddings = false;  // transformers' KimiLinearForCausalLM computes with the stored head
    return true;
}

std::vector<HfTensor> slice_experts(std::vector<HfTensor> map, int64_t first, int64_t count) {
    for (HfTensor& t : map) {
        if (t.expert < 0) continue;
        t.here = t.expert >= first && t.expert < first + count;
        t.expert -= first;
    }
    return map;
}

void load_hf_checkpoint(const std::string& dir,
                        const std::vector<HfTensor>& map,
                        const BufferGroup& params,
                        bool every_tensor) {
    const std::map<std::string, std::string> where = stored_tensors(dir);  // tensor -> file
    std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
    auto file_of = [&](const std::string& name) -> const SafetensorsFile* {
        auto it = where.find(name);
        if (it == where.end()) return nullptr;
        auto& f = files[it->second];
        if (!f) f = std::make_unique<SafetensorsFile>(it->second);
        TESSERA_CHECK(f->contains(name), "{}: the index lists \"{}\" but the file does not hold it", it->second, name);
        return f.get();
    };
    std::set<std::string> used;
    for (const auto& t : map) {
        if (!t.here) {  // another rank's expert: its stored forms count as read
            const std::string base = t.name.substr(0, t.name.size() - std::string("weight").size());
            for (const std::string& n :
                 {t.name, t.alias, t.name + "_scale_inv", base + "weight_packed", base + "weight_scale"}) {
                if (!n.empty() && where.count(n)) used.insert(n);
            }
            continue;
        }
        if (t.copy != HfTensor::Copy::none) {  // a tied head: optional, and then equal to the parameter
            const SafetensorsFile* f = file_of(t.name);
            if (!f) continue;
            const TensorView held = params.view(t.param).reshape(t.shape);
            Tensor stored(held.dtype, held.shape);  // as the parameter is held (a bf16 base: rounded as it was)
            convert(load_f32(*f, t.name).view(), stored.view());
            TESSERA_CHECK(same_bits(stored.view(), held),
                          "{}: \"{}\" differs from {} although the config ties them (tie_word_embeddings)", dir, t.name,
                          t.param);
            used.insert(t.name);
            continue;
        }
        TensorView dst = place(t, params.view(t.param));
        const std::string name = !t.alias.empty() && !where.count(t.name) && where.count(t.alias) ? t.alias : t.name;
        if (const SafetensorsFile* f = file_of(name)) {
            used.insert(name);
            const bool fp8 = f->entry(name).dtype == DType::f8e4m3;
            if (is_plain(t) && !fp8) {
                f->load_into(name, dst);
                continue;
            }
            Tensor full(DType::f32, t.shape);
            if (fp8) {  // DeepSeek's block-scaled FP8: <name>_scale_inv per 128 × 128 block
                const SafetensorsFile* fs_ = file_of(name + "_scale_inv");
                TESSERA_CHECK(fs_ && t.shape.ndim == 2, "{}: FP8 tensor \"{}\" needs a 2-D shape and \"{}_scale_inv\"",
                              dir, name, name);
                const Tensor raw = f->load(name), scale = fs_->load(name + "_scale_inv");
                const int64_t rows = t.shape[0], cols = t.shape[1], b = kFp8Block;
                TESSERA_CHECK(raw.view().shape == t.shape, "{}: \"{}\" is {}, the model needs {}", dir, name,
                              raw.view().shape.str(), t.shape.str());
                TESSERA_CHECK(scale.view().dtype == DType::f32 &&
                                  scale.view().shape == (Shape{(rows + b - 1) / b, (cols + b - 1) / b}),
                              "{}: \"{}_scale_inv\" must be f32 [{}, {}] (blocks of {})", dir, name, (rows + b - 1) / b,
                              (cols + b - 1) / b, b);
                dequantize_fp8_blocks(static_cast<const uint8_t*>(raw.view().data), scale.view().ptr<float>(), rows,
                                      cols, b, full.ptr<float>(), name);
                used.insert(name + "_scale_inv");
            } else {
                f->load_into(name, full.view());
            }
            const float* src = full.ptr<float>();
            in_f32(dst, [&](float* out) {
                if (is_plain(t)) {
                    std::copy(src, src + dst.numel(), out);
                } else if (t.pad_to > 0) {
                    for (int64_t i = dst.numel(); i < t.shape[0]; ++i) {
                        TESSERA_CHECK(src[i] == 0.f, "{}: \"{}\" pads with {} at {} (must be zero)", dir, t.name,
                                      src[i], i);
                    }
                    for (int64_t i = 0; i < dst.numel(); ++i) out[i] = src[i] + t.offset;
                } else {
                    const int64_t cols = t.shape.numel() / t.shape[0];
                    for_row_blocks(t, [&](int64_t prow, int64_t srow, int64_t rows) {
                        for (int64_t i = 0; i < rows * cols; ++i)
                            out[prow * cols + i] = src[srow * cols + i] + t.offset;
                    });
                }
            });
            continue;
        }
        // MXFP4 routed experts: <name minus ".weight">.weight_packed [out, in/2] + .weight_scale [out, in/32]
        const std::string base = t.name.substr(0, t.name.size() - std::string("weight").size());
        const SafetensorsFile* fp = file_of(base + "weight_packed");
        const SafetensorsFile* fs_ = file_of(base + "weight_scale");
        TESSERA_CHECK(fp && fs_ && t.shape.ndim == 2, "{}: the checkpoint has no tensor \"{}\" (parameter {})", dir,
                      t.name, t.param);
        const Tensor packed = fp->load(base + "weight_packed"), scale = fs_->load(base + "weight_scale");
        const int64_t rows = t.shape[0], cols = t.shape[1];
        TESSERA_CHECK(packed.view().dtype == DType::u8 && packed.view().shape == (Shape{rows, cols / 2}) &&
                          scale.view().dtype == DType::u8 && scale.view().shape == (Shape{rows, cols / 32}),
                      "{}: MXFP4 tensors of \"{}\" must be u8 [{}, {}] and [{}, {}]", dir, t.name, rows, cols / 2, rows,
                      cols / 32);
        if (dst.dtype == DType::mxfp4) {  // held in MXFP4 (model.lora.expert_dtype): the bytes as they are
            mxfp4_blocks(packed.view().ptr<uint8_t>(), scale.view().ptr<uint8_t>(), rows, cols,
                         static_cast<uint8_t*>(dst.data), t.name);
        } else {
            in_f32(dst, [&](float* out) {
                dequantize_mxfp4(packed.view().ptr<uint8_t>(), scale.view().ptr<uint8_t>(), rows, cols, out, t.name);
            });
        }
        used.insert(base + "weight_packed");
        used.insert(base + "weight_scale");
    }
    std::vector<std::string> unused;
    for (const auto& [name, file] : where) {
        if (!used.count(name)) unused.push_back(name);
    }
    if (!unused.empty() && every_tensor) {
        TESSERA_FAIL("{}: {} tensor(s) the model does not use, e.g. \"{}\" (a feature the engine does not build yet?)",
                     dir, unused.size(), unused.front());
    }
}

}  // namespace tessera::model
