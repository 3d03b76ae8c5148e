// Op-runner bindings of the DSA family: dsa_indexer, sparse_attention, indexer_kl (docs/dsa.md). The
// runner is not a hot path: each op's workspace is a vector of its own.
#include <omp.h>

#include <vector>

#include "ops/bindings/bindings.h"
#include "ops/dsa.h"

namespace tessera::ops {

namespace {
void run_dsa_indexer(OpContext& c) {
    const DsaIndexerParams p{.topk = c.param_i64("topk")};
    TensorView q = c.in("q"), k = c.in("k"), w = c.in("w");
    TESSERA_CHECK(q.ndim() == 4, "q must be [B, T, HI, DI]");
    const Shape out{q.size(0), q.size(1), p.topk};
    std::vector<std::byte> ws(dsa_indexer_workspace_bytes(q.dtype, q.size(0), q.size(1), q.size(2), q.size(3), p.topk,
                                                          omp_get_max_threads()));
    dsa_indexer_forward(p, q, k, w, c.out("indices", DType::i32, out), c.out("scores", q.dtype, out), ws,
                        c.index_span("cu_seqlens"));
}

void run_sparse_attention(OpContext& c) {
    const SparseAttentionParams p{
        .scale = c.param_f64("scale"), .dv = c.param_i64("dv"), .dkv_slabs = c.param_i64("dkv_slabs")};
    TensorView q = c.in("q"), kv = c.in("kv"), idx = c.in("indices");
    TESSERA_CHECK(q.ndim() == 4, "q must be [B, T, H, DK]");
    const int64_t DV = p.dv > 0 ? p.dv : q.size(3);
    TensorView o = c.out("o", q.dtype, Shape{q.size(0), q.size(1), q.size(2), DV});
    TensorView lse = c.out("lse", q.dtype, Shape{q.size(0), q.size(1), q.size(2)});
    TESSERA_CHECK(idx.ndim() == 3, "indices must be [B, T, TOPK]");
    std::vector<std::byte> ws(sparse_attention_workspace_bytes(q.dtype, p, q.size(0), q.size(1), q.size(2), q.size(3),
                                                               idx.size(2), omp_get_max_threads()));
    sparse_attention_forward(p, q, kv, idx, o, lse, ws);
    if (c.has("do"))
        sparse_attention_backward(p, c.in("do"), q, kv, idx, o, lse, c.out_like("dq", q), c.out_like("dkv", kv), ws);
}

void run_indexer_kl(OpContext& c) {
    TensorView q = c.in("q"), k = c.in("k"), w = c.in("w"), p = c.in("p");
    const bool backward = c.has("dloss");
    const double dloss = backward ? c.host_value("dloss") : 0.0;
    const TensorView idx = c.in_or_absent("indices");
    TESSERA_CHECK(q.ndim() == 4, "q must be [B, T, HI, DI]");
    const int64_t support = idx.defined() && idx.ndim() == 3 ? idx.size(2) : q.size(1);
    std::vector<std::byte> ws(indexer_kl_workspace_bytes(q.dtype, q.size(0), q.size(1), q.size(2), q.size(3), support,
                                                         4, omp_get_max_threads()));
    const IndexerKlResult r =
        indexer_kl(q, k, w, p, idx, c.index_span("cu_seqlens"), dloss, backward ? c.out_like("dq", q) : TensorView(),
                   backward ? c.out_like("dk", k) : TensorView(), backward ? c.out_like("dw", w) : TensorView(), ws);
    c.set_value("loss", q.dtype, Shape{}, r.loss);
}
}  // namespace

void register_dsa_ops(OpRegistry& r) {
    r.add(
        {"dsa_indexer",
         "lightning indexer: I = Σ_j w·relu(q_j·k), streaming top-k (ties to the later token), ascending, −1 padded",
         {{"q", "[B, T, HI, DI]"}, {"k", "[B, T, DI]"}, {"w", "[B, T, HI]"}, {"cu_seqlens", "[N+1] i64, B = 1", true}},
         {{"topk", ParamKind::integer, "2048", {}, "selected tokens per query", 1, 1 << 24}},
         {"indices", "scores"},
         {},
         run_dsa_indexer,
         /*cuda=*/true});
    r.add({"sparse_attention",
           "MQA attention over selected entries; the value is the first dv dims of each entry",
           {{"q", "[B, T, H, DK]"},
            {"kv", "[B, T, DK]"},
            {"indices", "[B, T, TOPK] i32, -1 = none"},
            {"do", "[B, T, H, DV]", true}},
           {{"scale", ParamKind::number, "0", {}, "0 = DK^-0.5", 0, HUGE_VAL},
            {"dv", ParamKind::integer, "0", {}, "0 = DK", 0, 1 << 20},
            {"dkv_slabs", ParamKind::integer, "4", {}, "backward: fixed query slabs of the dkv scatter", 1, 1024}},
           {"o", "lse"},
           {"given do: dq, dkv"},
           run_sparse_attention,
           /*cuda=*/true});
    r.add({"indexer_kl",
           "mean KL(p ‖ softmax(I)) over the selected entries (with indices) or every s <= t",
           {{"q", "[B, T, HI, DI]"},
            {"k", "[B, T, DI]"},
            {"w", "[B, T, HI]"},
            {"p", "[B, T, TOPK] (with indices) or [B, T, T]"},
            {"indices", "[B, T, TOPK] i32", true},
            {"cu_seqlens", "[N+1] i64, B = 1", true},
            {"dloss", "[]", true}},
           {},
           {"loss"},
           {"given dloss: dq, dk, dw"},
           run_indexer_kl,
           /*cuda=*/true});
}

}  // namespace tessera::ops
