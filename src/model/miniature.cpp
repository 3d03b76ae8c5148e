#include "model/miniature.h"

#include <algorithm>
#include <set>
#include <utility>

namespace tessera::model {

namespace {
// a smaller size that keeps 0 meaning "unset / off"
int64_t shrunk(int64_t v, int64_t to) { return v > 0 ? std::min(v, to) : 0; }
int64_t even_at_least_2(int64_t v) { return std::max<int64_t>(2, v & ~int64_t(1)); }
}  // namespace

ModelConfig miniature(const ModelConfig& c) {
    // the layers kept
    std::vector<std::pair<std::string, bool>> kind;  // per layer: attention type, routed feed-forward
    for (int64_t i = 0; i < c.n_layers; ++i) kind.emplace_back(c.layer_type(i), c.moe.is_moe_layer(i));
    const std::set<std::pair<std::string, bool>> pairs(kind.begin(), kind.end());
    std::vector<int64_t> keep;
    std::set<std::pair<std::string, bool>> seen;
    for (int64_t i = 0; i < c.n_layers && seen.size() < pairs.size(); ++i) {
        keep.push_back(i);
        seen.insert(kind[size_t(i)]);
    }
    if (keep.size() > 8) {
        keep.clear();
        seen.clear();
        for (int64_t i = 0; i < c.n_layers; ++i)
            if (seen.insert(kind[size_t(i)]).second) keep.push_back(i);
    }

    ModelConfig m = c;
    m.vocab_size = 258;  // the byte tokenizer of the demo corpus
    m.n_layers = int64_t(keep.size());
    m.attention.clear();
    for (int64_t i : keep) m.attention.push_back(kind[size_t(i)].first);
    if (std::all_of(m.attention.begin(), m.attention.end(), [&](auto& a) { return a == m.attention[0]; }))
        m.attention.resize(1);
    m.d_model = 64;
    m.ffn_dim = 128;
    // grouped-query attention: at most 4 heads of 16, the same query heads per key head where it divides
    const int64_t group = std::max<int64_t>(1, c.n_heads / c.n_kv_heads);
    m.n_heads = std::min<int64_t>(c.n_heads, 4);
    m.n_kv_heads = std::max<int64_t>(1, m.n_heads / std::min(group, m.n_heads));
    while (m.n_heads % m.n_kv_heads) --m.n_kv_heads;
    m.head_dim = 16;
    if (c.rope_dim > 0) m.rope_dim = even_at_least_2(16 * c.rope_dim / c.head_dim_or_default());
    if (c.attn_res_block_size > 0)
        m.attn_res_block_size = std::min<int64_t>(c.attn_res_block_size, std::max<int64_t>(1, m.n_layers / 2));

    MlaConfig& a = m.mla;
    a.q_lora_rank = shrunk(c.mla.q_lora_rank, 32);
    a.kv_lora_rank = 32;
    a.qk_nope_dim = 16;
    a.qk_rope_dim = shrunk(c.mla.qk_rope_dim, 8);
    a.v_head_dim = 16;
    a.softmax_scale = 0;  // the miniature's own head sizes
    a.dsa.topk = shrunk(c.mla.dsa.topk, 16);
    a.dsa.heads = std::min<int64_t>(c.mla.dsa.heads, 2);
    a.dsa.head_dim = 16;
    a.dsa.rope_dim = shrunk(c.mla.dsa.rope_dim, 8);

    KdaConfig& k = m.kda;
    const int64_t gva = std::max<int64_t>(1, c.kda.hv() / c.kda.num_heads);
    k.num_heads = std::min<int64_t>(c.kda.num_heads, 2);
    k.num_v_heads = c.kda.num_v_heads > 0 ? k.num_heads * std::min<int64_t>(gva, 2) : 0;
    k.head_dim = 16;
    k.head_v_dim = shrunk(c.kda.head_v_dim, 16);
    k.gate_rank = shrunk(c.kda.gate_rank, 8);

    MoeConfig& e = m.moe;
    if (c.moe.experts > 0) {
        e.experts = std::min<int64_t>(c.moe.experts, 8);
        e.groups = c.moe.groups > 1 ? 2 : 1;
        e.topk_groups = c.moe.topk_groups >= c.moe.groups ? e.groups : 1;
        const int64_t reachable = e.topk_groups * e.experts / e.groups;  // experts the group rule leaves a token
        e.topk = std::clamp<int64_t>(c.moe.topk, 1, std::max<int64_t>(1, reachable / 2));
        e.ffn_dim = 32;
        e.latent_dim = shrunk(c.moe.latent_dim, 32);
        e.shared_ffn_dim = shrunk(c.moe.shared_ffn_dim, 64);
        e.layers.clear();
        e.first_dense = 0;
        bool any_dense = false;
        for (int64_t i : keep) any_dense |= !kind[size_t(i)].second;
        if (any_dense)
            for (int64_t i : keep) e.layers.push_back(kind[size_t(i)].second ? "moe" : "dense");
    }
    // the image tower is frozen and comes from a checkpoint: a miniature trained from scratch has none (its forward is
    // checked against its reference in tests/model/test_vision.cpp)
    m.vision = VisionConfig{};
    clear_unread_keys(m);
    return m;
}

}  // namespace tessera::model
