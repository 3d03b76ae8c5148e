// The CUDA backend's ops on the GPU (built with -DTESSERA_CUDA=ON; run by scripts/device-check.sh run or bench): time
// per call (median of 20 after 3 warm-ups, of 5 or fewer for the slow rows, each timed to its stream's completion),
// and the rate as a fraction of the device's peak: GEMM-bound ops in FLOP/s against the f32 (FFMA, no tensor cores)
// peak (the `... bf16` rows, train.precision = bf16, and the indexer's against the dense bf16 tensor-core peak),
// memory-bound ones in bytes moved against HBM bandwidth. Attention's and sparse attention's backward count 2.5× their
// forward FLOPs (FlashAttention-2's count), KDA's forward the Kimi Linear paper's chunk count and its
// backward twice that; the MoE experts' forward + backward 3 × 6·rows·L·F, next to one dense GEMM of the forward's
// FLOPs (the bar: grouped ≥ 70% of dense), at bf16 both with f32 weights rounded per call and with the bf16
// weights training reads (memory.weight_copies). Peaks default to the H200's (67 TFLOP/s f32, 989 bf16, 4.8 TB/s);
// --f32-tflops, --bf16-tflops and --hbm-tbs override them. Prints a markdown table (bench/RESULTS.md), row by row.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/device.h"
#include "core/rng.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/decode.h"
#include "ops/dsa.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/kda.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/rows.h"
#include "ops/swiglu.h"

namespace tessera {
namespace {

double median_ms(const std::function<void()>& f, int reps = 20) {
    for (int i = 0; i < (reps >= 20 ? 3 : 1); ++i) f();
    synchronize(Device::cuda);
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
        const auto a = std::chrono::steady_clock::now();
        f();
        synchronize(Device::cuda);
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

Tensor gpu_random(Shape s, uint64_t seed) { return bench::random_tensor(s, seed, -1, 1, 0).to(Device::cuda); }
Tensor gpu_zeros(Shape s) { return Tensor(DType::f32, s, Device::cuda); }

struct Row {
    std::string op, shape, pass;
    double ms, amount;  // FLOPs or bytes
    bool flops;
    bool bf16 = false;  // GEMMs at GemmPrecision::bf16: against the bf16 peak
};

// DSA's sparse MQA attention, DeepSeek-V3.2's entry (576 dims, values 512), top-2048 of T positions, H = 16, rows
// as the indexer writes them (the selected positions ascending, −1 after: the dkv blocks binary-search them); the
// exact f32 kernels up to T = 8192 only.
void sparse_attention_rows(int64_t T, const std::function<void(const Row&)>& report) {
    const int64_t B = 1, H = 16, DK = 576, DV = 512, K = 2048;
    Tensor ih(DType::i32, Shape{B, T, K});
    int32_t* idx = ih.ptr<int32_t>();
    int64_t entries = 0;
    for (int64_t t = 0; t < T; ++t) {  // the last K positions (causal)
        const int64_t first = std::max<int64_t>(0, t - K + 1), n = t - first + 1;
        for (int64_t i = 0; i < K; ++i) idx[t * K + i] = i < n ? int32_t(first + i) : -1;
        entries += n;
    }
    Tensor indices = ih.to(Device::cuda);
    Tensor q = gpu_random(Shape{B, T, H, DK}, 31),
           kv = bench::random_tensor(Shape{B, T, DK}, 32, -0.1, 0.1, 0).to(Device::cuda);
    Tensor o = gpu_zeros(Shape{B, T, H, DV}), lse = gpu_zeros(Shape{B, T, H}),
           dout = gpu_random(Shape{B, T, H, DV}, 33), dq = gpu_zeros(Shape{B, T, H, DK}),
           dkv = gpu_zeros(Shape{B, T, DK});
    const ops::SparseAttentionParams sp{.dv = DV};
    const std::string shape = fmt::format("B {} T {} H {} entry {}/{} top-{}", B, T, H, DK, DV, K);
    const double fl = 2.0 * double(entries) * double(H) * double(DK + DV);  // QKᵀ and PV over the valid entries
    for (const bool bf16 : {false, true}) {  // bf16: every kernel on tensor cores, against the bf16 peak
        if (!bf16 && T > 8192) continue;
        const ops::GemmPrecisionScope precision(bf16 ? ops::GemmPrecision::bf16 : ops::GemmPrecision::f32);
        const std::string name = bf16 ? "sparse_attention bf16" : "sparse_attention";
        report({name, shape, "forward",
                median_ms([&] { ops::sparse_attention_forward(sp, q, kv, indices, o, lse, {}); }, 3), fl, true, bf16});
        report({name, shape, "backward",
                median_ms([&] { ops::sparse_attention_backward(sp, dout, q, kv, indices, o, lse, dq, dkv, {}); },
                          bf16 ? 3 : 1),
                2.5 * fl, true, bf16});
    }
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
    using namespace tessera;
    double f32_tflops = 67.0, bf16_tflops = 989.0, hbm_tbs = 4.8;  // an H200's (and H100 SXM's) dense peaks
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!std::strcmp(argv[i], "--f32-tflops")) f32_tflops = std::atof(argv[i + 1]);
        if (!std::strcmp(argv[i], "--bf16-tflops")) bf16_tflops = std::atof(argv[i + 1]);
        if (!std::strcmp(argv[i], "--hbm-tbs")) hbm_tbs = std::atof(argv[i + 1]);
    }
    if (!cuda_available()) {
        std::fprintf(stderr, "bench_cuda: no CUDA device on this machine\n");
        return 1;
    }
    std::printf("| op | shape | pass | ms | rate | fraction of peak |\n|---|---|---|---|---|---|\n");
    // each row printed as soon as it is measured: a run cut short keeps what it measured
    const auto report = [&](const Row& r) {
        const double rate = r.amount / (r.ms * 1e-3);
        if (r.flops)
            std::printf("| %s | %s | %s | %.3f | %.1f TFLOP/s | %.0f%% of %s |\n", r.op.c_str(), r.shape.c_str(),
                        r.pass.c_str(), r.ms, rate / 1e12, 100 * rate / ((r.bf16 ? bf16_tflops : f32_tflops) * 1e12),
                        r.bf16 ? "bf16" : "f32");
        else
            std::printf("| %s | %s | %s | %.3f | %.0f GB/s | %.0f%% of HBM |\n", r.op.c_str(), r.shape.c_str(),
                        r.pass.c_str(), r.ms, rate / 1e9, 100 * rate / (hbm_tbs * 1e12));
        std::fflush(stdout);
    };
    for (auto [N, IN, OUT] :
         {std::array<int64_t, 3>{8192, 4096, 4096}, {16384, 7168, 2048}, {4096, 512, 1536}, {512, 7168, 2048}}) {
        Tensor x = gpu_random(Shape{N, IN}, 1), w = gpu_random(Shape{OUT, IN}, 2), y = gpu_zeros(Shape{N, OUT});
        Tensor dy = gpu_random(Shape{N, OUT}, 3), dx = gpu_zeros(Shape{N, IN}), dw = gpu_zeros(Shape{OUT, IN});
        const std::string shape = fmt::format("{} x {} -> {}", N, IN, OUT);
        const double fl = 2.0 * N * IN * OUT;
        report({"linear", shape, "forward", median_ms([&] { ops::linear_forward({}, x, w, {}, y); }), fl, true});
        report({"linear", shape, "backward", median_ms([&] { ops::linear_backward(dy, x, w, dx, dw, {}); }), 2 * fl,
                true});
        // train.precision = bf16: the operands rounded to bf16 (a launch per call) and cuBLAS's GemmEx
        const ops::GemmPrecisionScope bf16(ops::GemmPrecision::bf16);
        report({"linear bf16", shape, "forward", median_ms([&] { ops::linear_forward({}, x, w, {}, y); }), fl, true,
                true});
        report({"linear bf16", shape, "backward", median_ms([&] { ops::linear_backward(dy, x, w, dx, dw, {}); }),
                2 * fl, true, true});
        // a frozen weight held in bf16 (a LoRA base, model.lora.base_dtype), read in place: forward and dx against
        // "linear bf16" forward and its dx alone (the f32 weight rounded per call)
        Tensor wb(DType::bf16, Shape{OUT, IN}, Device::cuda);
        ops::cast(w, wb);
        report({"linear bf16", shape, "dx", median_ms([&] { ops::linear_backward(dy, x, w, dx, {}, {}); }), fl, true,
                true});
        report({"linear bf16, frozen bf16 weight", shape, "forward",
                median_ms([&] { ops::linear_forward({}, x, wb, {}, y); }), fl, true, true});
        report({"linear bf16, frozen bf16 weight", shape, "dx",
                median_ms([&] { ops::linear_backward(dy, x, wb, dx, {}, {}); }), fl, true, true});
    }
    for (auto [N, D] : {std::array<int64_t, 2>{16384, 4096}, {8192, 7168}}) {
        Tensor x = gpu_random(Shape{N, D}, 4), w = gpu_random(Shape{D}, 5), y = gpu_zeros(Shape{N, D});
        Tensor r = gpu_zeros(Shape{N}), dy = gpu_random(Shape{N, D}, 6), dx = gpu_zeros(Shape{N, D});
        Tensor dw = gpu_zeros(Shape{D});
        const std::string shape = fmt::format("{} x {}", N, D);
        const double b = 4.0 * N * D;
        report({"rmsnorm", shape, "forward", median_ms([&] { ops::rmsnorm_forward({}, x, w, y, r); }), 2 * b, false});
        report({"rmsnorm", shape, "backward", median_ms([&] { ops::rmsnorm_backward({}, dy, x, w, r, dx, dw); }), 5 * b,
                false});
        Tensor g = gpu_random(Shape{N, D}, 7), u = gpu_random(Shape{N, D}, 8), dg = gpu_zeros(Shape{N, D});
        report({"swiglu", shape, "forward", median_ms([&] { ops::swiglu_forward(g, u, y); }), 3 * b, false});
        report({"swiglu", shape, "backward", median_ms([&] { ops::swiglu_backward(dy, g, u, dg, dx); }), 7 * b, false});
    }
    {
        const int64_t N = 8192, V = 16384;
        Tensor logits = gpu_random(Shape{N, V}, 9), lse = gpu_zeros(Shape{N}), dl = gpu_zeros(Shape{N, V});
        Tensor t(DType::i64, Shape{N});
        for (int64_t i = 0; i < N; ++i) t.ptr<int64_t>()[i] = (i * 7919) % V;
        Tensor targets = t.to(Device::cuda);
        const std::string shape = fmt::format("{} x {}", N, V);
        const double b = 4.0 * N * V;
        report({"cross_entropy", shape, "forward",
                median_ms([&] { ops::cross_entropy_forward({}, logits, targets, lse); }), b, false});
        report({"cross_entropy", shape, "backward",
                median_ms([&] { ops::cross_entropy_backward({}, 1.0, logits, targets, lse, dl); }), 3 * b, false});
        Tensor table = gpu_random(Shape{V, 4096}, 10), e = gpu_zeros(Shape{N, 4096});
        report({"embedding", fmt::format("{} of {} x 4096", N, V), "forward",
                median_ms([&] { ops::embedding_forward(targets, table, e); }), 2.0 * 4 * N * 4096, false});
        // (the ids read back and sorted on the host, then a block per distinct id; dy read, rows read and written)
        report({"embedding", fmt::format("{} of {} x 4096", N, V), "backward",
                median_ms([&] { ops::embedding_backward(e, targets, table); }), 3.0 * 4 * N * 4096, false});
    }
    {
        const int64_t B = 2, T = 4096, H = 16, HKV = 4, D = 128;
        Tensor q = gpu_random(Shape{B, T, H, D}, 11), k = gpu_random(Shape{B, T, HKV, D}, 12),
               v = gpu_random(Shape{B, T, HKV, D}, 13), o = gpu_zeros(Shape{B, T, H, D}),
               lse = gpu_zeros(Shape{B, H, T}), dout = gpu_random(Shape{B, T, H, D}, 14),
               dq = gpu_zeros(Shape{B, T, H, D}), dk = gpu_zeros(Shape{B, T, HKV, D}),
               dv = gpu_zeros(Shape{B, T, HKV, D});
        const std::string shape = fmt::format("B {} T {} H {}/{} D {}, causal", B, T, H, HKV, D);
        const double fl = ops::attention_forward_flops(B, T, H, D, true);
        report({"attention", shape, "forward", median_ms([&] { ops::attention_forward({}, q, k, v, o, lse, {}); }), fl,
                true});
        report({"attention", shape, "backward",
                median_ms([&] { ops::attention_backward({}, dout, q, k, v, o, lse, dq, dk, dv, {}); }), 2.5 * fl,
                true});
        const ops::GemmPrecisionScope bf16(ops::GemmPrecision::bf16);  // tensor cores, against the bf16 peak
        report({"attention bf16", shape, "forward", median_ms([&] { ops::attention_forward({}, q, k, v, o, lse, {}); }),
                fl, true, true});
        report({"attention bf16", shape, "backward",
                median_ms([&] { ops::attention_backward({}, dout, q, k, v, o, lse, dq, dk, dv, {}); }), 2.5 * fl, true,
                true});
    }
    {  // MLA's dense attention as the DSA warm-up runs it: 16 heads over one entry of 576 dims (keys and values), bf16
       // only (the scalar kernels cannot hold 576 dims)
        const int64_t B = 1, T = 8192, H = 16, D = 576;
        Tensor q = gpu_random(Shape{B, T, H, D}, 15), kv = gpu_random(Shape{B, T, 1, D}, 16),
               o = gpu_zeros(Shape{B, T, H, D}), lse = gpu_zeros(Shape{B, H, T}),
               dout = gpu_random(Shape{B, T, H, D}, 17), dq = gpu_zeros(Shape{B, T, H, D}),
               dk = gpu_zeros(Shape{B, T, 1, D}), dv = gpu_zeros(Shape{B, T, 1, D});
        const std::string shape = fmt::format("B {} T {} H {}/1 D {} (MLA entries), causal", B, T, H, D);
        const double fl = ops::attention_forward_flops(B, T, H, D, true);
        const ops::GemmPrecisionScope bf16(ops::GemmPrecision::bf16);
        report({"attention bf16", shape, "forward",
                median_ms([&] { ops::attention_forward({}, q, kv, kv, o, lse, {}); }, 3), fl, true, true});
        report({"attention bf16", shape, "backward",
                median_ms([&] { ops::attention_backward({}, dout, q, kv, kv, o, lse, dq, dk, dv, {}); }, 3), 2.5 * fl,
                true, true});
    }
    // KDA, forward and backward (medians of reps_f and reps_b calls), |k|² < 1: the chunked kernels (the default
    // mode) and the fused token recurrence
    const auto kda_rows = [&](ops::KdaMode mode, int64_t B, int64_t T, int64_t H, int64_t D, int reps_f, int reps_b,
                              uint64_t seed) {
        Tensor q = gpu_random(Shape{B, T, H, D}, seed),
               k = bench::random_tensor(Shape{B, T, H, D}, seed + 1, -0.15, 0.15, 0).to(Device::cuda),
               v = gpu_random(Shape{B, T, H, D}, seed + 2), o = gpu_zeros(Shape{B, T, H, D});
        Tensor g = bench::random_tensor(Shape{B, T, H, D}, seed + 3, -0.5, -0.01, 0).to(Device::cuda);
        Tensor beta = bench::random_tensor(Shape{B, T, H}, seed + 4, 0.1, 0.9, 0).to(Device::cuda);
        Tensor dout = gpu_random(Shape{B, T, H, D}, seed + 5), dq = gpu_zeros(Shape{B, T, H, D}),
               dk = gpu_zeros(Shape{B, T, H, D}), dv = gpu_zeros(Shape{B, T, H, D}), dg = gpu_zeros(Shape{B, T, H, D}),
               db = gpu_zeros(Shape{B, T, H});
        const ops::KdaInputs in{q, k, v, g, beta, {}, {}};
        const ops::KdaParams p{.mode = mode};
        const std::string shape = fmt::format("B {} T {} H {} K = V = {}", B, T, H, D);
        const double fl = ops::kda_forward_flops(B * T, H, D, 64);
        // the chunked kernels also at train.precision = bf16 (block products on tensor cores), against the bf16 peak
        for (const bool bf16 : {false, true}) {
            if (bf16 && mode != ops::KdaMode::chunk) continue;
            const ops::GemmPrecisionScope precision(bf16 ? ops::GemmPrecision::bf16 : ops::GemmPrecision::f32);
            const std::string op =
                mode == ops::KdaMode::chunk ? (bf16 ? "kda (chunk) bf16" : "kda (chunk)") : "kda (recurrent)";
            report(
                {op, shape, "forward", median_ms([&] { ops::kda_forward(p, in, o, {}, {}); }, reps_f), fl, true, bf16});
            const auto backward = [&] { ops::kda_backward(p, in, dout, {}, {dq, dk, dv, dg, db, {}}, {}); };
            report({op, shape, "backward", median_ms(backward, reps_b), 2 * fl, true, bf16});
        }
    };
    for (const ops::KdaMode mode : {ops::KdaMode::chunk, ops::KdaMode::recurrent}) {
        kda_rows(mode, 4, 2048, 16, 128, 20, 20, 15);
        kda_rows(mode, 1, 4096, 32, 128, 5, 3, 21);  // the shape: one sequence, 32 units for 132 SMs
    }
    kda_rows(ops::KdaMode::chunk, 1, 16384, 32, 128, 3, 3, 27);
    {  // decoding, one step of one sequence: GQA over 32K cached rows (bytes: the keys and values read), and the DSA
       // indexer's top-2048 over 64K cached keys of Kimi K3's shape (bytes: the keys read)
        const int64_t L = 32768, H = 32, HKV = 8, D = 128, LI = 65536, HI = 64, DI = 128, K = 2048;
        Tensor q = gpu_random(Shape{1, H, D}, 41), keys = gpu_random(Shape{1, L, HKV, D}, 42),
               values = gpu_random(Shape{1, L, HKV, D}, 43), o = gpu_zeros(Shape{1, H, D});
        report({"cached_attention", fmt::format("L {} H {}/{} D {}", L, H, HKV, D), "decode step",
                median_ms([&] { ops::cached_attention(0.088, q, keys, values, {}, L, o); }), 2.0 * 4 * L * HKV * D,
                false});
        Tensor qi = gpu_random(Shape{1, HI, DI}, 44), wi = gpu_random(Shape{1, HI}, 45),
               ki = gpu_random(Shape{1, LI, DI}, 46), rows(DType::i32, Shape{1, K}, Device::cuda);
        report({"cached_index_topk", fmt::format("L {} HI {} DI {} top {}", LI, HI, DI, K), "decode step",
                median_ms([&] { ops::cached_index_topk(qi, wi, ki, LI, rows); }), 4.0 * LI * DI, false});
    }
    // DSA's lightning indexer with its top-2048, DeepSeek-V3.2's shape (64 heads of 128 dims): exact f32 scoring, and
    // the bf16 tensor-core scoring of train.precision = bf16 (FLOPs: the causal pairs' q·k products; against the bf16
    // peak for both, as that is what the work could run at)
    for (const int64_t T : {int64_t(8192), int64_t(32768)}) {
        const int64_t HI = 64, DI = 128, K = 2048;
        Tensor q = gpu_random(Shape{1, T, HI, DI}, 51), k = gpu_random(Shape{1, T, DI}, 52),
               w = gpu_random(Shape{1, T, HI}, 53), idx(DType::i32, Shape{1, T, K}, Device::cuda),
               sc = gpu_zeros(Shape{1, T, K});
        const double fl = 2.0 * double(HI * DI) * double(T) * double(T + 1) / 2;
        const std::string shape = fmt::format("T {} HI {} DI {} top-{}", T, HI, DI, K);
        for (const bool bf16 : {false, true}) {
            if (!bf16 && T > 8192) continue;  // the exact kernel's time grows as T²: one size shows its rate
            const ops::GemmPrecisionScope precision(bf16 ? ops::GemmPrecision::bf16 : ops::GemmPrecision::f32);
            report({bf16 ? "dsa_indexer bf16" : "dsa_indexer", shape, "forward",
                    median_ms([&] { ops::dsa_indexer_forward({.topk = K}, q, k, w, idx, sc, {}); }, 3), fl, true,
                    true});
        }
    }
    sparse_attention_rows(8192, report);
    // MoE expert compute (the layer between dispatch and combine, forward + backward) against one dense GEMM of the
    // forward's FLOPs: N = 4096 tokens, L = 512, F = 256, SwiGLU; bench/bench_moe.cpp's table on the CPU
    const int64_t N = 4096, L = 512, F = 256;
    for (auto [E, K] : {std::array<int64_t, 2>{64, 4}, {256, 8}, {896, 16}}) {
        ops::MoeParams p;
        p.router.topk = K;
        Tensor router_w = gpu_zeros(Shape{E, L}),
               wg = bench::random_tensor(Shape{E, F, L}, 41, -0.04, 0.04, 0).to(Device::cuda),
               wu = bench::random_tensor(Shape{E, F, L}, 42, -0.04, 0.04, 0).to(Device::cuda),
               wd = bench::random_tensor(Shape{E, L, F}, 43, -0.06, 0.06, 0).to(Device::cuda);
        Tensor gwg = gpu_zeros(wg.shape()), gwu = gpu_zeros(wu.shape()), gwd = gpu_zeros(wd.shape()),
               grw = gpu_zeros(router_w.shape());
        const ops::MoeWeights w{.router_w = router_w, .w_gate = wg, .w_up = wu, .w_down = wd};
        const ops::MoeWeights gr{.router_w = grw, .w_gate = gwg, .w_up = gwu, .w_down = gwd};
        const ops::MoeBuffers buffers = ops::moe_buffers(ops::moe_dims(p, w, N), DType::f32, Device::cuda);
        const ops::MoeSaved& sv = buffers.saved;
        const ops::MoeScratch& sc = buffers.scratch;
        const int64_t R = N * K;
        const double fwd = 6.0 * double(R) * double(L) * double(F);
        Tensor da = gpu_random(Shape{R, L}, 44),
               db = bench::random_tensor(Shape{3 * F, L}, 45, -0.04, 0.04, 0).to(Device::cuda),
               dc = gpu_zeros(Shape{R, 3 * F});
        Tensor x = gpu_random(Shape{N, L}, 46), dye = gpu_random(Shape{R, L}, 47);
        const std::vector<float> gates(size_t(R), 1.0f / float(K));
        // the weights as training at bf16 reads them: the experts' bf16 copies (memory.weight_copies), not rounded per
        // call; the dense GEMM's weight likewise
        auto narrow = [](const Tensor& t) {
            Tensor n(DType::bf16, t.shape(), Device::cuda);
            ops::cast(t.view(), n.view());
            return n;
        };
        const Tensor wg16 = narrow(wg), wu16 = narrow(wu), wd16 = narrow(wd), db16 = narrow(db);
        const ops::MoeWeights w16{.router_w = router_w, .w_gate = wg16, .w_up = wu16, .w_down = wd16};
        // f32; train.precision = bf16 rounding the f32 weights per call; bf16 with the weights' copies (against the
        // bf16 peak)
        for (const int mode : {0, 1, 2}) {
            const bool bf16 = mode > 0, copies = mode == 2;
            const ops::GemmPrecisionScope precision(bf16 ? ops::GemmPrecision::bf16 : ops::GemmPrecision::f32);
            const std::string tag = !bf16 ? "" : copies ? " bf16, bf16 weights" : " bf16";
            const double dense_ms =
                median_ms([&] { ops::linear_forward({}, da, copies ? db16.view() : db.view(), {}, dc); });
            report({"dense GEMM (the MoE forward's FLOPs)" + tag, fmt::format("{} x {} -> {}", R, L, 3 * F), "forward",
                    dense_ms, fwd, true, bf16});
            for (const bool zipf : {false, true}) {
                std::vector<int32_t> expert(static_cast<size_t>(R));
                bench::route_experts(zipf, N, E, K, expert.data());
                copy_bytes(sv.expert.data, Device::cuda, expert.data(), Device::cpu, expert.size() * sizeof(int32_t));
                copy_bytes(sv.gates.data, Device::cuda, gates.data(), Device::cpu, gates.size() * sizeof(float));
                ops::moe_build_layout(sv, N);
                ops::moe_dispatch(sv, x, sv.xe);
                auto set_dye = [&] {
                    copy_bytes(sc.ye.data, Device::cuda, dye.view().data, Device::cuda, dye.view().nbytes());
                };
                const double both = median_ms([&] {
                    ops::moe_experts_forward(p, copies ? w16 : w, sv, sc);
                    set_dye();
                    ops::moe_experts_backward(p, copies ? w16 : w, gr, sv, sc);
                });
                const double copy = median_ms(set_dye);
                report({"moe experts (grouped GEMMs)" + tag,
                        fmt::format("E {} k {} {}, {} rows", E, K, zipf ? "Zipf" : "uniform", R), "fwd+bwd",
                        both - copy, 3 * fwd, true, bf16});
            }
        }
    }
    sparse_attention_rows(65536, report);  // last: a run cut short by device-check.sh's limit loses only it
    return 0;
}
