// DSA benchmarks, side by side in one run (f32, all threads):
//  1. sparse_attention forward+backward (MQA entry DK = 576, value DV = 512, topk = 2048, H heads) vs the
//     dense causal attention op on the same heads with one shared kv head of width 576 (k = v = the entry);
//     the selected sets are random subsets of each query's past (the indexer's choice does not change
//     the cost), rows with t < topk select every past token.
//  2. dsa_indexer (HI heads × DI) achieved GFLOP/s (2·HI·DI per candidate pair, causal) vs the machine's
//     GEMM rate measured in the same run.
//  3. the whole gated DSA layer (MlaBlock: MLA in MQA mode, indexer, top-k, headwise gate, KL backward)
//     forward+backward time and memory at each T: saved activations + backward scratch and the ops'
//     workspace (slab accumulators, per-thread tiles: the layer's share of the arena), all O(T·topk), not O(T²).
//   build/bench/bench_dsa [--heads 4] [--lengths 16384,65536] [--indexer-lengths 4096,16384]
//                         [--layer-lengths 16384,65536]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "model/layers/block_rig.h"
#include "model/layers/mla_block.h"
#include "ops/attention.h"
#include "ops/dsa.h"
#include "ops/gemm.h"

namespace {

using namespace tessera;
using Clock = std::chrono::steady_clock;

Tensor random(Shape s, uint64_t seed, double scale) { return bench::random_tensor(s, seed, -scale, scale, 9); }

double seconds(const std::function<void()>& f) {
    auto t0 = Clock::now();
    f();
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr const char* kUsage =
    "usage: bench_dsa [--heads H] [--lengths T,...] [--indexer-lengths T,...] [--layer-lengths T,...]\n"
    "  --heads            query heads of the sparse/dense attention comparison (default 4)\n"
    "  --lengths          sequence lengths of the attention comparison (default 16384,65536)\n"
    "  --indexer-lengths  sequence lengths of the indexer measurement (default 4096,16384)\n"
    "  --layer-lengths    sequence lengths of the whole-layer run (default 16384,65536; 0 = skip)\n";

// value of a comma-separated integer list flag; exits with a one-line error on unknown flags or bad numbers
std::vector<int64_t> list(int argc, char** argv, const char* name, std::vector<int64_t> def) {
    for (int i = 1; i < argc; ++i) {
        const bool known = !std::strcmp(argv[i], "--heads") || !std::strcmp(argv[i], "--lengths") ||
                           !std::strcmp(argv[i], "--indexer-lengths") || !std::strcmp(argv[i], "--layer-lengths");
        if (!std::strcmp(argv[i], "--help")) {
            std::fputs(kUsage, stdout);
            std::exit(0);
        }
        if (!known || i + 1 == argc) {
            std::fprintf(stderr, "bench_dsa: %s '%s' (see --help)\n", known ? "missing value for" : "unknown argument",
                         argv[i]);
            std::exit(2);
        }
        if (std::strcmp(argv[i++], name) != 0) continue;
        std::vector<int64_t> out;
        std::stringstream ss(argv[i]);
        std::string item;
        while (std::getline(ss, item, ',')) {
            char* end = nullptr;
            const long long v = std::strtoll(item.c_str(), &end, 10);
            if (item.empty() || *end != '\0' || v < 0) {
                std::fprintf(stderr, "bench_dsa: %s needs integers >= 0, got '%s'\n", name, argv[i]);
                std::exit(2);
            }
            out.push_back(v);
        }
        def = out;
    }
    return def;
}

// topk distinct positions of [0, t] per query (all of them when t < topk), ascending
Tensor random_selection(int64_t T, int64_t K) {
    Tensor idx(DType::i32, Shape{1, T, K});
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t t = 0; t < T; ++t) {
        int32_t* row = idx.ptr<int32_t>() + t * K;
        if (t + 1 <= K) {
            for (int64_t i = 0; i < K; ++i) row[i] = i <= t ? int32_t(i) : -1;
            continue;
        }
        RandomStream rs{uint64_t(t), 5};
        std::vector<int32_t> pick;  // Floyd's sampling of K distinct values in [0, t]
        for (int64_t j = t + 1 - K; j <= t; ++j) {
            const int32_t r = int32_t(rs.uniform(uint64_t(j)) * double(j + 1));
            pick.push_back(std::find(pick.begin(), pick.end(), r) == pick.end() ? r : int32_t(j));
        }
        std::sort(pick.begin(), pick.end());
        std::copy(pick.begin(), pick.end(), row);
    }
    return idx;
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t H = list(argc, argv, "--heads", {4})[0], DK = 576, DV = 512, K = 2048;
    const auto lengths = list(argc, argv, "--lengths", {16384, 65536});
    const auto ilengths = list(argc, argv, "--indexer-lengths", {4096, 16384});
    const auto llengths = list(argc, argv, "--layer-lengths", {16384, 65536});
    const double gemm = ops::measure_gemm_gflops();
    std::printf("DSA on %d threads; machine GEMM rate %.0f GFLOP/s\n\n", omp_get_max_threads(), gemm);

    std::printf(
        "sparse MQA attention (H = %lld, DK = %lld, DV = %lld, topk = %lld) vs dense causal attention "
        "(H = %lld, one kv head, D = %lld), forward+backward, one run each\n\n",
        (long long)H, (long long)DK, (long long)DV, (long long)K, (long long)H, (long long)DK);
    std::printf(
        "| T | sparse s | dense s | speed-up | sparse GFLOP/s | sparse buffers MiB |\n|---|---|---|---|---|---|\n");
    for (int64_t T : lengths) {
        if (T == 0) continue;
        Tensor q = random(Shape{1, T, H, DK}, 1, 0.5), kv = random(Shape{1, T, DK}, 2, 0.5),
               dout = random(Shape{1, T, H, DV}, 3, 1.0);
        Tensor idx = random_selection(T, K);
        Tensor o(DType::f32, Shape{1, T, H, DV}), lse(DType::f32, Shape{1, T, H}), dq(DType::f32, q.shape()),
            dkv(DType::f32, kv.shape());
        const ops::SparseAttentionParams sp{.dv = DV};
        std::vector<std::byte> sws(
            ops::sparse_attention_workspace_bytes(DType::f32, sp, 1, T, H, DK, K, omp_get_max_threads()));
        const double sparse_s = seconds([&] {
            ops::sparse_attention_forward(sp, q.view(), kv.view(), idx.view(), o.view(), lse.view(), sws);
            ops::sparse_attention_backward(sp, dout.view(), q.view(), kv.view(), idx.view(), o.view(), lse.view(),
                                           dq.view(), dkv.view(), sws);
        });
        int64_t pairs = 0;
        for (int64_t t = 0; t < T; ++t) pairs += std::min(t + 1, K);
        // forward 2·H·pairs·(DK+DV); backward recomputes scores and adds dP, dq, dk, dv products: ~2.5x
        const double flops = 3.5 * ops::sparse_attention_flops(pairs, H, DK, DV);
        // inputs, outputs, indices, their gradients, and the op's workspace (backward's slab accumulators, one
        // [T, H] delta, per-thread tiles)
        const double buf_mib = (double(q.view().nbytes() + kv.view().nbytes() + o.view().nbytes() +
                                       lse.view().nbytes() + idx.view().nbytes() + dout.view().nbytes()) +
                                double(q.view().nbytes() + kv.view().nbytes()) + double(sws.size())) /
                               (1024.0 * 1024.0);
        Tensor k4(DType::f32, Shape{1, T, 1, DK});
        std::memcpy(k4.view().data, kv.view().data, kv.view().nbytes());
        Tensor dout4 = random(Shape{1, T, H, DK}, 4, 1.0), o4(DType::f32, Shape{1, T, H, DK}),
               lse4(DType::f32, Shape{1, H, T}), dk4(DType::f32, k4.shape()), dv4(DType::f32, k4.shape());
        std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f32, T, DK, omp_get_max_threads()));
        const double dense_s = seconds([&] {
            ops::attention_forward({}, q.view(), k4.view(), k4.view(), o4.view(), lse4.view(), ws);
            ops::attention_backward({}, dout4.view(), q.view(), k4.view(), k4.view(), o4.view(), lse4.view(), dq.view(),
                                    dk4.view(), dv4.view(), ws);
        });
        std::printf("| %lld | %.1f | %.1f | **%.1fx** | %.0f | %.0f |\n", (long long)T, sparse_s, dense_s,
                    dense_s / sparse_s, flops / sparse_s * 1e-9, buf_mib);
        std::fflush(stdout);
    }

    const int64_t HI = 16, DI = 128;
    std::printf("\nlightning indexer (HI = %lld, DI = %lld, topk = %lld): scores and streaming top-k\n\n",
                (long long)HI, (long long)DI, (long long)K);
    std::printf("| T | s | GFLOP/s | share of GEMM rate |\n|---|---|---|---|\n");
    for (int64_t T : ilengths) {
        if (T == 0) continue;
        Tensor q = random(Shape{1, T, HI, DI}, 5, 1.0), k = random(Shape{1, T, DI}, 6, 1.0),
               w = random(Shape{1, T, HI}, 7, 1.0);
        Tensor idx(DType::i32, Shape{1, T, K}), sc(DType::f32, Shape{1, T, K});
        std::vector<std::byte> iws(
            ops::dsa_indexer_workspace_bytes(DType::f32, 1, T, HI, DI, K, omp_get_max_threads()));
        const double s = seconds(
            [&] { ops::dsa_indexer_forward({.topk = K}, q.view(), k.view(), w.view(), idx.view(), sc.view(), iws); });
        const double flops = 2.0 * double(HI * DI) * double(T) * double(T + 1) / 2.0;
        std::printf("| %lld | %.2f | %.0f | %.0f%% |\n", (long long)T, s, flops / s * 1e-9,
                    100.0 * flops / s * 1e-9 / gemm);
        std::fflush(stdout);
    }

    // the whole layer at a DeepSeek-V3.2-like shape with H heads and a narrower model width
    model::MlaConfig c;
    c.d_model = 1024;
    c.num_heads = H;
    c.q_lora_rank = 512;
    c.kv_lora_rank = 512;
    c.qk_nope_dim = 128;
    c.qk_rope_dim = 64;
    c.v_head_dim = 128;
    c.output_gate = "headwise";
    c.dsa = {.topk = K, .heads = HI, .head_dim = DI, .rope_dim = 64};
    std::printf(
        "\ngated DSA layer forward+backward (d = %lld, H = %lld, q_lora 512, kv_lora 512, d_n/d_r/d_v 128/64/128, "
        "indexer %lld x %lld, topk %lld, headwise gate, sparse stage with the KL backward)\n\n",
        (long long)c.d_model, (long long)H, (long long)HI, (long long)DI, (long long)K);
    std::printf("| T | s | saved + scratch MiB | workspace MiB | MiB per token | of which indices |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (int64_t T : llengths) {
        if (T == 0) continue;
        const model::StepShape shape{1, T};
        model::MlaBlock block(c, "l.");
        model::BlockRig rig(block, shape);
        for (const auto& sp : rig.specs) {
            TensorView v = rig.params.view(sp.name);
            const bool norm = sp.name.find("norm") != std::string::npos;
            Tensor r = random(sp.shape, std::hash<std::string>{}(sp.name),
                              norm ? 0.0 : 1.0 / std::sqrt(double(sp.shape[sp.shape.ndim - 1])));
            for (int64_t i = 0; i < v.numel(); ++i) v.ptr<float>()[i] = (norm ? 1.f : 0.f) + r.ptr<float>()[i];
        }
        Tensor x = random(Shape{T, c.d_model}, 11, 1.0), out(DType::f32, x.shape()), d = random(x.shape(), 12, 1.0);
        const double s = seconds([&] {
            block.forward(shape, x.view(), out.view(), rig.ws);
            block.backward(shape, x.view(), d.view(), rig.ws);
        });
        // the ops' scratch (slab accumulators, per-thread tiles and candidate lists): the block's workspace
        const double wsb = double(rig.workspace.nbytes());
        const double idx = double(T * K * 4);
        std::printf("| %lld | %.1f | %.0f | %.0f | %.3f | %.0f%% |\n", (long long)T, s,
                    double(rig.acts.nbytes()) / 1048576.0, wsb / 1048576.0,
                    (double(rig.acts.nbytes()) + wsb) / 1048576.0 / double(T), 100.0 * idx / double(rig.acts.nbytes()));
        std::fflush(stdout);
    }
    return 0;
}
