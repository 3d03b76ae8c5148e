// Training on the GPU (train.device = cuda) against training on the CPU, the oracle: the hybrid models train with
// the CPU's losses (f32 on both: within 1e-3 relative over every step), bitwise run to run on the GPU, checkpoints
// move between the devices (a run begun on one continues on the other with the other's losses), Kimi K3's image
// tower feeding a model gives the CPU's logits and gradients, and decoding on the GPU gives the CPU's logits and
// tokens. Every test but the last skips without a GPU (scripts/device-check.sh runs them on one); the last checks, on a
// machine without one, that asking for the GPU is a one-line error that leaves nothing behind.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/device.h"
#include "core/file.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "model/runtime.h"
#include "model/sampling.h"
#include "ops/gemm.h"
#include "train/trainer.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

#define SKIP_WITHOUT_GPU() \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device on this machine"

// The demo's hybrid in miniature: KDA, GDN and gated DSA over MLA (the lightning indexer and its KL), LatentMoE with
// SiTU experts, a shared expert and aux-loss-free balancing, the elementwise output gate, documents masked.
const char* kHybrid = R"({
  "model": {"vocab_size": 258, "d_model": 64, "n_layers": 4, "n_heads": 4, "ffn_dim": 128,
            "attention": ["kda", "gdn", "kda", "dsa"], "output_gate": "elementwise",
            "kda": {"num_heads": 2, "head_dim": 16, "gate_lower_bound": -5.0},
            "mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 16,
                    "rope": false, "dsa": {"topk": 16, "heads": 2, "head_dim": 16, "rope_dim": 8, "stage": "sparse"}},
            "moe": {"experts": 8, "topk": 2, "ffn_dim": 32, "latent_dim": 32, "latent_norm": true,
                    "shared_ffn_dim": 32, "score": "sigmoid", "activation": "situ", "first_dense": 1,
                    "balance": "sign", "bias_update_rate": 0.01}},
  "train": {"seq_len": 64, "batch_size": 4, "steps": 20, "lr": 0.003, "warmup_steps": 4, "eval_interval": 10,
            "eval_batches": 2, "checkpoint_interval": 0, "log_interval": 5, "seed": 11}
})";

// Kimi K3's other pieces: Attention Residuals, gated GQA, softmax routing with a capacity (re-routing) and Quantile
// Balancing, recomputed activations, two micro-batches per step.
const char* kResidualsAndCapacity = R"({
  "model": {"vocab_size": 258, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
            "attention": ["gqa", "kda", "kda", "gqa"], "output_gate": "headwise", "attn_res_block_size": 2,
            "kda": {"num_heads": 2, "head_dim": 16},
            "moe": {"experts": 8, "topk": 2, "ffn_dim": 32, "shared_ffn_dim": 32, "score": "softmax",
                    "capacity_factor": 1.0, "first_dense": 1, "balance": "quantile"}},
  "train": {"seq_len": 64, "batch_size": 4, "micro_batch_size": 2, "steps": 20, "lr": 0.003, "warmup_steps": 4,
            "eval_interval": 10, "eval_batches": 2, "checkpoint_interval": 0, "log_interval": 5, "seed": 7,
            "recompute": true}
})";

train::TrainSummary run(const test::TempDir& d,
                        const std::string& config,
                        const std::string& device,
                        const std::string& name,
                        std::optional<int64_t> steps = {},
                        const std::string& resume = "",
                        const std::vector<std::string>& more = {}) {
    train::TrainOptions o;
    if (resume.empty()) {
        o.config_path = d.file(name + ".json");
        write_text_atomic(o.config_path, config);
    }
    o.overrides = {"train.device=" + device, "train.async_checkpoints=false"};
    o.overrides.insert(o.overrides.end(), more.begin(), more.end());
    o.steps = steps;
    o.out_dir = d.file(name);
    o.resume_dir = resume;
    return train::train(o);
}

// A copy of run `from`'s checkpoint at `step`, alone in a new run directory `name`, resumed on `device`.
train::TrainSummary resume_copy(
    const test::TempDir& d, const std::string& from, int64_t step, const std::string& device, const std::string& name) {
    const std::string ckpt = fmt::format("/checkpoints/step_{:07d}", step);
    fs::create_directories(d.file(name) + "/checkpoints");
    fs::copy(d.file(from) + ckpt, d.file(name) + ckpt);
    return run(d, "", device, name, {}, d.file(name));
}

void expect_close_losses(const std::vector<double>& gpu, const std::vector<double>& cpu, double rtol) {
    ASSERT_EQ(gpu.size(), cpu.size());
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], rtol * std::abs(cpu[i])) << "step " << i + 1;
}

// Two GPU runs whose GEMMs take the same bf16 operands, some read in place (weight copies, memory.weight_copies) or
// from per-call copies: the same bits on the emulator; a GPU's cuBLAS may pick another kernel for another leading
// dimension or alignment, so there within 1e-3 (its bound against the CPU).
void expect_same_operands_losses(const train::TrainSummary& a, const train::TrainSummary& b) {
    if (!cuda_emulated()) return expect_close_losses(a.losses, b.losses, 1e-3);
    EXPECT_EQ(a.losses, b.losses);
    EXPECT_EQ(a.eval_loss, b.eval_loss);
}

// The bytes of a run's bf16 weight copies (its memory report's group; 0: none).
size_t copied_bytes(const train::TrainSummary& s) {
    for (const model::MemoryReport::Group& g : s.memory.groups)
        if (g.name == "params.bf16") return g.bytes;
    return 0;
}

class CudaTrain : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaTrain, TheModelTrainsOnTheGpuWithTheCpusLosses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const train::TrainSummary cpu = run(d, GetParam(), "cpu", "cpu"), gpu = run(d, GetParam(), "cuda", "gpu");
    ASSERT_EQ(cpu.losses.size(), 20u);
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
    EXPECT_LT(cpu.losses.back(), cpu.losses.front() - 0.3) << "the model must learn";
    ASSERT_TRUE(cpu.eval_loss && gpu.eval_loss);
    EXPECT_NEAR(*gpu.eval_loss, *cpu.eval_loss, 1e-3 * *cpu.eval_loss);
    // one arena on the device with the CPU's buffer groups (the host workspace sized for one thread, not all)
    ASSERT_EQ(gpu.memory.groups.size(), cpu.memory.groups.size());
    for (size_t i = 0; i < cpu.memory.groups.size(); ++i) {
        EXPECT_EQ(gpu.memory.groups[i].name, cpu.memory.groups[i].name);
        if (cpu.memory.groups[i].name != "workspace") {
            EXPECT_EQ(gpu.memory.groups[i].bytes, cpu.memory.groups[i].bytes) << cpu.memory.groups[i].name;
        }
    }
    EXPECT_EQ(gpu.memory.arena_peak_bytes, gpu.memory.predicted_bytes) << "every group allocated, nothing else";
    // outside the arena: the backend's scratch, reported (the hybrid's at least its dkv slabs: 16 of 4 × 64 rows ×
    // 24 dims); none for the CPU run
    EXPECT_GE(gpu.memory.device_scratch_bytes, GetParam() == kHybrid ? size_t(16 * 4 * 64 * 24 * 4) : size_t(1));
    EXPECT_EQ(cpu.memory.device_scratch_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models,
                         CudaTrain,
                         ::testing::Values(kHybrid, kResidualsAndCapacity),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                             return i.index == 0 ? "Hybrid" : "ResidualsAndCapacity";
                         });

TEST(CudaTrain, GpuTrainingIsBitwiseRunToRun) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const train::TrainSummary a = run(d, kHybrid, "cuda", "a", 8), b = run(d, kHybrid, "cuda", "b", 8);
    ASSERT_EQ(a.losses.size(), 8u);
    for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
    EXPECT_EQ(read_text(d.file("a") + "/checkpoints/step_0000008/model.safetensors"),
              read_text(d.file("b") + "/checkpoints/step_0000008/model.safetensors"));
}

// A run begun on one device continues on the other: its checkpoint (parameters, AdamW moments, the selection bias, the
// data position) is the same files either way, so the continued losses are the other device's own. The uninterrupted
// runs write a checkpoint at step 6; a copy of it alone in a new run directory is resumed on the other device.
TEST(CudaTrain, CheckpointsMoveBetweenTheDevices) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const std::vector<std::string> at6 = {"train.checkpoint_interval=6"};
    const train::TrainSummary cpu = run(d, kHybrid, "cpu", "cpu", 12, "", at6),
                              gpu = run(d, kHybrid, "cuda", "gpu", 12, "", at6);
    const train::TrainSummary to_cpu = resume_copy(d, "gpu", 6, "cpu", "gpu_then_cpu"),
                              to_gpu = resume_copy(d, "cpu", 6, "cuda", "cpu_then_gpu");
    ASSERT_EQ(to_cpu.first_step, 6);
    ASSERT_EQ(to_cpu.losses.size(), 6u);
    ASSERT_EQ(to_gpu.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {  // both continue the same trajectory, within the devices' difference
        EXPECT_NEAR(to_cpu.losses[i], cpu.losses[6 + i], 1e-3 * cpu.losses[6 + i]) << "step " << 7 + i;
        EXPECT_NEAR(to_gpu.losses[i], gpu.losses[6 + i], 1e-3 * gpu.losses[6 + i]) << "step " << 7 + i;
    }
}

// The DSA dense warm-up (spec/dsa.md §3.1): only the indexers train, against every candidate (dsa_all_candidates).
TEST(CudaTrain, TheDsaDenseWarmupTrainsOnTheGpuWithTheCpusLosses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const std::vector<std::string> warmup = {"model.mla.dsa.stage=dense_warmup"};
    const train::TrainSummary cpu = run(d, kHybrid, "cpu", "cpu", 10, "", warmup),
                              gpu = run(d, kHybrid, "cuda", "gpu", 10, "", warmup);
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
}

// LoRA on a base trained on the CPU: adapters on the attention, KDA and expert projections (the routed experts' through
// the grouped GEMMs), the base frozen and hashed on the GPU; the fine-tune resumes there with its losses.
TEST(CudaTrain, LoraFineTunesABaseOnTheGpuWithTheCpusLosses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    run(d, kHybrid, "cpu", "base", 8);
    const std::vector<std::string> lora = {
        "train.base=" + d.file("base"), "model.lora.rank=4", "model.lora.alpha=8", "train.checkpoint_interval=4",
        R"(model.lora.target_modules=["q_proj","kv_b_proj","o_proj","experts.gate_proj","experts.up_proj",)"
        R"("experts.down_proj","shared_experts.down_proj","gate_proj","down_proj"])"};
    const train::TrainSummary cpu = run(d, kHybrid, "cpu", "cpu", 8, "", lora),
                              gpu = run(d, kHybrid, "cuda", "gpu", 8, "", lora);
    ASSERT_EQ(cpu.losses.size(), 8u);
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
    const train::TrainSummary resumed = resume_copy(d, "gpu", 4, "cuda", "gpu_resumed");  // resumed on the GPU
    ASSERT_EQ(resumed.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], gpu.losses[4 + i]) << "step " << 5 + i;
}

// The same fine-tune on a base held narrow, as Kimi K3's is fine-tuned: the dense GEMM weights in bf16 and the routed
// experts in MXFP4 (frozen; each widened to f32 on the GPU for its products), the adapters f32.
TEST(CudaTrain, LoraOnABaseHeldNarrowFineTunesOnTheGpuWithTheCpusLosses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    run(d, kHybrid, "cpu", "base", 8);
    const std::vector<std::string> lora = {
        "train.base=" + d.file("base"),
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.base_dtype=bf16",
        "model.lora.expert_dtype=mxfp4",
        R"(model.lora.target_modules=["q_proj","o_proj","experts.gate_proj","experts.down_proj","down_proj"])"};
    const train::TrainSummary cpu = run(d, kHybrid, "cpu", "cpu", 6, "", lora),
                              gpu = run(d, kHybrid, "cuda", "gpu", 6, "", lora),
                              wide = run(d, kHybrid, "cpu", "wide", 6, "", {lora[0], lora[1], lora[2], lora[5]});
    ASSERT_EQ(cpu.losses.size(), 6u);
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
    EXPECT_GT(std::abs(cpu.losses.front() - wide.losses.front()), 1e-4) << "the experts must be held in MXFP4";
}

// train.precision = bf16: every GEMM's operands rounded to bf16, products summed in f32 (the tensor cores' form; the
// CPU computes the same as its oracle); parameters, gradients, AdamW state and activations stay f32. The GPU's chunked
// KDA, sparse attention and the indexer KL also run on tensor cores with bf16 operands, where the CPU's stay f32, so
// the first step's loss is the CPU's bf16 one within 1e-5 (1.9e-6 on the emulator; the CPU's bf16 and f32 losses are
// 5.4e-6 apart: the GEMMs' parity is CudaOps.Bf16GemmsMatchTheCpuOnOperandsRoundedToBf16's to check); then rounding
// to bf16 amplifies the devices' differences, so the trajectories stay within 3e-3 of each other and within 1e-2 of
// f32; the model learns. On the GPU the trained GEMM weights are read from bf16 copies rounded once per step
// (memory.weight_copies, train/weight_copies.h): a run that rounds them per GEMM instead has the same bits on the
// emulator (the same operands; run to run too).
TEST(CudaTrain, Bf16GemmsTrainWithTheCpusBf16Losses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const std::vector<std::string> bf16 = {"train.precision=bf16"};
    const train::TrainSummary f32 = run(d, kHybrid, "cpu", "f32"), cpu = run(d, kHybrid, "cpu", "cpu", {}, "", bf16),
                              a = run(d, kHybrid, "cuda", "a", {}, "", bf16),
                              b = run(d, kHybrid, "cuda", "b", {}, "", {bf16[0], "memory.weight_copies=false"});
    // at least the routed experts (3 MoE layers of 3 × 8 experts' 32 × 32) and the untied head (258 × 64), in bf16
    EXPECT_GE(copied_bytes(a), size_t(2 * (3 * 3 * 8 * 32 * 32 + 258 * 64)));
    EXPECT_EQ(copied_bytes(b), 0u);
    expect_same_operands_losses(a, b);
    ASSERT_EQ(a.losses.size(), 20u);
    std::printf("[ bf16 ] first losses: GPU %.9f, CPU %.9f, CPU f32 %.9f\n", a.losses[0], cpu.losses[0], f32.losses[0]);
    EXPECT_NEAR(a.losses[0], cpu.losses[0], 1e-5 * cpu.losses[0]);
    EXPECT_GT(std::abs(cpu.losses[0] - f32.losses[0]), 1e-6) << "the GEMMs must round to bf16";
    expect_close_losses(a.losses, cpu.losses, 3e-3);
    expect_close_losses(cpu.losses, f32.losses, 1e-2);
    EXPECT_LT(a.losses.back(), a.losses.front() - 0.3) << "the model must learn";
    EXPECT_EQ(ops::gemm_precision(), ops::GemmPrecision::f32) << "the runs restore f32";
}

// train.precision = bf16 on Kimi K3's other pieces: gated GQA's dense attention then runs on tensor cores too (forward,
// dQ, dK/dV with bf16 operands) where the CPU's stays f32, under recomputed activations and two micro-batches. The
// first loss is the CPU's bf16 one within 1e-5 (1.5e-6 on the emulator), 10 steps within 1e-3 (8.3e-5 at worst). The
// GEMM weights' bf16 copies, read by recomputed forwards and by both micro-batches, give the bits of rounding per GEMM;
// a run resumed from the step-5 checkpoint rounds them from the loaded weights: the uninterrupted run's bits.
TEST(CudaTrain, Bf16DenseAttentionTrainsWithTheCpusBf16Losses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const std::vector<std::string> bf16 = {"train.precision=bf16"};
    const train::TrainSummary cpu = run(d, kResidualsAndCapacity, "cpu", "cpu", 10, "", bf16),
                              gpu = run(d, kResidualsAndCapacity, "cuda", "gpu", 10, "",
                                        {bf16[0], "train.checkpoint_interval=5"}),
                              per_gemm = run(d, kResidualsAndCapacity, "cuda", "per_gemm", 10, "",
                                             {bf16[0], "memory.weight_copies=false"}),
                              resumed = resume_copy(d, "gpu", 5, "cuda", "resumed");
    ASSERT_EQ(gpu.losses.size(), 10u);
    EXPECT_GT(copied_bytes(gpu), 0u);
    expect_same_operands_losses(per_gemm, gpu);
    EXPECT_EQ(resumed.losses, std::vector<double>(gpu.losses.begin() + 5, gpu.losses.end()));
    std::printf("[ bf16 gqa ] first losses: GPU %.9f, CPU %.9f\n", gpu.losses[0], cpu.losses[0]);
    EXPECT_NEAR(gpu.losses[0], cpu.losses[0], 1e-5 * cpu.losses[0]);
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
}

// train.activation_dtype = bf16: the saved activations round to bf16 on both devices alike (ops::cast and
// round_to_bf16 give the same bits), the KDA and MoE blocks but the last of each keep them as bf16 copies (a smaller
// activation group, the same on both); 10 steps within 1e-3 of the CPU's losses (3e-5 at worst on the emulator).
TEST(CudaTrain, Bf16ActivationsTrainWithTheCpusLosses) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const std::vector<std::string> bf16 = {"train.activation_dtype=bf16"};
    const train::TrainSummary f32 = run(d, kHybrid, "cpu", "f32", 1), cpu = run(d, kHybrid, "cpu", "cpu", 10, "", bf16),
                              gpu = run(d, kHybrid, "cuda", "gpu", 10, "", bf16);
    ASSERT_EQ(gpu.losses.size(), 10u);
    EXPECT_EQ(cpu.losses[0], f32.losses[0]) << "the forward is f32's";
    expect_close_losses(gpu.losses, cpu.losses, 1e-3);
    auto activations = [](const train::TrainSummary& s) {
        for (const auto& g : s.memory.groups)
            if (g.name == "activations") return g.bytes;
        return size_t(0);
    };
    EXPECT_EQ(activations(gpu), activations(cpu));
    EXPECT_LT(activations(cpu), activations(f32));
}

// Kimi K3's image tower feeding a language model (the golden of tests/model/test_vision.cpp) on both devices: the
// CPU's logits, loss and gradients within f32 rounding of each device's own order.
TEST(CudaTrain, AnImageTowerGivesTheCpusLogitsAndGradients) {
    SKIP_WITHOUT_GPU();
    const SafetensorsFile f(test::golden_path("model/vision_lm.safetensors"));
    const model::ModelConfig cfg =
        model::parse_model_config(Json::parse(f.metadata().at("config"))["model"], "vision_lm golden");
    const model::StepShape shape{2, 24};
    model::Model cpu(cfg), gpu(cfg);
    model::ModelRuntime rc(cpu, shape, true, {}), rg(gpu, shape, true, {}, {}, nullptr, Device::cuda);
    for (const BufferSpec& s : cpu.param_specs()) {
        f.load_into("param." + s.name, rc.params().view(s.name));
        const TensorView h = rc.params().view(s.name), d = rg.params().view(s.name);
        copy_bytes(d.data, Device::cuda, h.data, Device::cpu, h.nbytes());
    }
    std::vector<ops::PatchGrid> grids;
    const Tensor g = f.load("grids");
    for (int64_t i = 0; i < g.shape()[0]; ++i) grids.push_back({g.ptr<int64_t>()[2 * i], g.ptr<int64_t>()[2 * i + 1]});
    const Tensor patches = f.load("patches"), ids_t = f.load("ids"), targets_t = f.load("targets");
    const std::span<const int32_t> ids(ids_t.ptr<int32_t>(), size_t(ids_t.numel())),
        targets(targets_t.ptr<int32_t>(), size_t(targets_t.numel()));
    cpu.set_images(grids, patches);
    gpu.set_images(grids, patches);
    Tensor lc(DType::f32, Shape{48, cfg.vocab_size}), lg(DType::f32, Shape{48, cfg.vocab_size}, Device::cuda);
    cpu.forward_logits(shape, ids, lc);
    gpu.forward_logits(shape, ids, lg);
    EXPECT_TRUE(test::rel_rms_close(lg.to(Device::cpu), lc, 1e-5));
    rc.grads().zero();
    rg.grads().zero();
    const double a = cpu.forward_backward(shape, ids, targets, 1.0).loss,
                 b = gpu.forward_backward(shape, ids, targets, 1.0).loss;
    EXPECT_NEAR(b, a, 1e-5 * std::abs(a));
    for (const BufferSpec& s : cpu.trained_specs()) {
        EXPECT_TRUE(test::rel_rms_close(Tensor::copy_of(rg.grads().view(s.name)).to(Device::cpu),
                                        rc.grads().view(s.name), 1e-4))
            << s.name;
    }
}

// Decoding on the GPU (the caches in device memory, ops/decode.h over them): both models decode a 48-token sequence
// position by position from the same weights with the CPU's logits at every step (GQA with gates and KDA; KDA, GDN
// and gated DSA, whose indexer picks 16 of the cached rows once there are more, and the MoE layers), and greedy
// generation writes the CPU's tokens.
TEST_P(CudaTrain, DecodingOnTheGpuGivesTheCpusLogitsAndTokens) {
    SKIP_WITHOUT_GPU();
    const model::ModelConfig cfg = model::parse_model_config(Json::parse(GetParam())["model"], "decoding test");
    const int64_t L = 48, V = cfg.vocab_size;
    model::Model cpu(cfg), gpu(cfg);
    BufferGroup cc("cache", cpu.cache_specs(1, L)), cg("cache", gpu.cache_specs(1, L));
    model::ModelRuntime rc(cpu, {1, 1}, false, {}, {&cc}), rg(gpu, {1, 1}, false, {}, {&cg}, nullptr, Device::cuda);
    cpu.bind_cache(cc);
    gpu.bind_cache(cg);
    cpu.init_params(rc.params(), 5);
    for (const BufferSpec& s : cpu.param_specs()) {
        const TensorView h = rc.params().view(s.name), d = rg.params().view(s.name);
        copy_bytes(d.data, Device::cuda, h.data, Device::cpu, h.nbytes());
    }
    Tensor lc(DType::f32, Shape{1, V}), lg(DType::f32, Shape{1, V}, Device::cuda);
    for (int64_t pos = 0; pos < L; ++pos) {
        const int32_t id = int32_t((pos * 37 + 11) % V);
        cpu.decode_step(pos, std::span(&id, 1), lc);
        gpu.decode_step(pos, std::span(&id, 1), lg);
        ASSERT_TRUE(test::all_close(lg.to(Device::cpu), lc, 1e-4, 1e-5)) << "position " << pos;
    }
    std::vector<int32_t> tc{1, 2, 3}, tg = tc;
    const model::SampleParams greedy{.max_new_tokens = 40, .temperature = 0};
    model::generate(cpu, L, tc, greedy, -1, {});
    model::generate(gpu, L, tg, greedy, -1, {});
    EXPECT_EQ(tg, tc);
}

// A model larger than the GPU's free memory is refused before anything is allocated, with its buffer groups' sizes
// (not cudaMalloc's bare "out of memory"); the host's memory is not what bounds a GPU run.
TEST(CudaTrain, AModelLargerThanTheGpuIsAOneLineError) {
    SKIP_WITHOUT_GPU();
    test::TempDir d;
    const char* huge = R"({"model": {"vocab_size": 16777216, "d_model": 131072, "n_layers": 2, "n_heads": 128,
                                     "ffn_dim": 256},
                           "train": {"seq_len": 64, "batch_size": 2, "steps": 1}})";
    try {
        run(d, huge, "cuda", "run");
        ADD_FAILURE() << "a model larger than the GPU must be refused";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("GiB of GPU memory (params "), std::string::npos) << m;
        EXPECT_NE(m.find("but the GPU has "), std::string::npos) << m;
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
    EXPECT_FALSE(fs::exists(d.file("run"))) << "nothing is written";
}

TEST(CudaTrain, WithoutAGpuTheDeviceIsAOneLineErrorThatLeavesNothing) {
    if (cuda_available()) GTEST_SKIP() << "a CUDA device is present";
    test::TempDir d;
    try {
        run(d, kHybrid, "cuda", "run", 2);
        ADD_FAILURE() << "training on a missing GPU must fail";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("train.device = cuda: "), std::string::npos) << m;
        EXPECT_NE(m.find(cuda_built() ? "no CUDA device on this machine" : "no CUDA backend"), std::string::npos) << m;
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
    EXPECT_FALSE(fs::exists(d.file("run"))) << "nothing is written before the device is known";
}

}  // namespace
}  // namespace tessera
