// The memory prediction (the arena, and the GEMM copy buffers outside it) checked against something
// it does not compute: the process's own resident pages. ArenaPeakEqualsPrediction (test_model.cpp) holds by
// construction (the arena is sized from the same specs); here the kernel's count of touched pages must grow by the
// predicted bytes when a runtime is built and trained, within the few MiB that live outside the arena (the allocator's
// bookkeeping, oneDNN's packing buffers and JIT code, the GEMM copy buffers, thread stacks: 0.7 MiB
// measured in a process that ran GEMMs before, 9.4 MiB in a fresh one).
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "model/model_fixture.h"
#include "util/test_util.h"

namespace tessera {
namespace {

// a field of /proc/self/status in bytes ("VmRSS", "VmHWM")
size_t proc_status_bytes(const std::string& key) {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind(key + ":", 0) == 0) return size_t(std::stoull(line.substr(key.size() + 1))) * 1024;
    }
    ADD_FAILURE() << key << " is not in /proc/self/status";
    return 0;
}

// Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0, proc(5)).
bool reset_peak_rss() {
    std::ofstream out("/proc/self/clear_refs");
    out << "5";
    out.flush();
    return bool(out);
}

struct MemoryCase {
    const char* name;
    const char* golden;
    int64_t batch;  // sequences of `seq`: enough that the arena dwarfs everything else
    int64_t seq = 512;
    void (*edit)(Json&) = nullptr;  // changes to the golden's model
};

// DeepSeek-V3.2's entry width (kv_lora_rank 512 + rope 64) on the tiny DSA golden: at long sequences the
// sparse attention's and the indexer's scratch (dkv and dk slab accumulators, delta, per-thread tiles and
// candidate lists) are tens of MiB, so they must be in the arena (the workspace) for the check to hold
void wide_dsa(Json& doc) {
    doc["model"]["mla"]["kv_lora_rank"] = 512;
    doc["model"]["mla"]["qk_rope_dim"] = 64;
    doc["model"]["mla"]["dsa"]["topk"] = 64;
}

void PrintTo(const MemoryCase& c, std::ostream* os) { *os << c.name << " (" << c.batch << " x " << c.seq << ")"; }

class ProcessMemory : public ::testing::TestWithParam<MemoryCase> {};

TEST_P(ProcessMemory, GrowsByThePredictionWhenTraining) {
    if (!reset_peak_rss()) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
    const size_t base = proc_status_bytes("VmRSS");
    const MemoryCase c = GetParam();
    test::GoldenModel g(c.golden, {}, [&](Json& doc) {
        doc["train"]["batch_size"] = c.batch;
        doc["train"]["seq_len"] = c.seq;
        if (c.edit) c.edit(doc);
    });
    std::vector<int32_t> ids(size_t(g.shape.tokens())), tgt(size_t(g.shape.tokens()));
    const size_t V = size_t(g.cfg.model.vocab_size);
    const train::BatchSource batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
        for (size_t k = 0; k < i.size(); ++k) {
            i[k] = int32_t((k * 7 + 3) % V);
            t[k] = int32_t((k * 5 + 1) % V);
        }
        return g.shape;
    };
    for (int64_t step = 0; step < 2; ++step)
        train::train_step(*g.model, *g.rt, *g.opt, *g.grads, g.cfg.train, step, batch, ids, tgt);
    const model::MemoryReport m = g.rt->memory_report();
    const double grown = double(proc_status_bytes("VmHWM") - base),
                 predicted = double(m.predicted_bytes + m.outside_arena_bytes);
    const double mib = 1 << 20;
    std::cout << c.name << ": predicted " << predicted / mib << " MiB, resident growth " << grown / mib << " MiB\n";
    ASSERT_GT(predicted, 200 * mib) << "the shape is too small for the check";
    // every predicted byte is touched (nothing reserved for nothing) ...
    EXPECT_GE(grown, 0.97 * double(m.predicted_bytes));
    // ... and nothing large lives outside the arena
    EXPECT_LE(grown, predicted + 16 * mib);
}

INSTANTIATE_TEST_SUITE_P(Models,
                         ProcessMemory,
                         ::testing::Values(MemoryCase{"dense_gqa", "dense_gqa", 96},
                                           MemoryCase{"hybrid_kda_dsa", "hybrid_kda_dsa", 24},
                                           MemoryCase{"moe_latent_situ", "moe_latent_situ", 80},
                                           MemoryCase{"dsa_sparse_4k_wide", "dsa_sparse", 2, 4096, wide_dsa}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tessera
