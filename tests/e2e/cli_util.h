// Running the tessera binary from tests: exit status, stdout and stderr.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/json.h"

namespace tessera::test {

struct CliResult {
    int status = -1;  // exit status (128 + signal if killed)
    std::string out, err;
};

// --set options that turn tests/e2e/tiny.json into a tiny MoE model (8 experts, top-2; add a balance rule) and
// into a KDA : gated DSA hybrid (top-8 of 32 tokens; no gqa layer, so tiny.json's n_kv_heads is dropped).
inline const std::string kTinyMoe =
    " --set model.moe.experts=8 --set model.moe.topk=2 --set model.moe.ffn_dim=32"
    " --set model.moe.shared_ffn_dim=32 --set model.moe.bias_update_rate=0.01";
inline const std::string kTinyHybrid =
    " --set 'model.attention=[\"kda\",\"dsa\"]' --set model.mla.dsa.topk=8 --set model.kda.head_dim=16"
    " --set model.output_gate=headwise --set model.n_kv_heads=null";

// --set options for tiny models that export-hf writes as Kimi-Linear (KDA, KDA, MLA with q_lora, MoE with a shared
// expert) and as Qwen3-Next (GDN and gated GQA with q/k norms, MoE with a gated shared expert in every layer).
inline const std::string kTinyKimiLinear =
    " --set 'model.attention=[\"kda\",\"kda\",\"mla\"]' --set model.n_layers=3 --set model.kda.head_dim=16"
    " --set model.n_kv_heads=null --set model.mla.q_lora_rank=16 --set model.moe.experts=4"
    " --set model.moe.ffn_dim=16 --set model.moe.shared_ffn_dim=32 --set model.output_gate=elementwise"
    " --set model.kda.o_norm_eps=1e-6";
inline const std::string kTinyQwen3Next =
    " --set 'model.attention=[\"gdn\",\"gqa\"]' --set model.n_layers=2 --set model.kda.head_dim=16"
    " --set model.output_gate=elementwise --set model.qk_norm=true --set model.kda.o_norm_eps=1e-6"
    " --set model.moe.experts=4 --set model.moe.ffn_dim=16 --set model.moe.shared_ffn_dim=32"
    " --set model.moe.shared_expert_gate=true --set model.moe.score=softmax --set model.moe.first_dense=0"
    " --set model.moe.balance=frozen --set model.ffn_dim=null";

// args: shell words appended to the binary path (quote them yourself).
CliResult run_tessera(const std::string& args);

// args run by `ranks` processes under mpirun (one OpenMP thread each: the ranks share this machine's cores).
CliResult run_tessera_mpi(int ranks, const std::string& args);

// A tessera process in the background (stdout and stderr to out_file and err_file), for signal tests.
struct Background {
    int pid = -1;
    std::string out_file, err_file;
};
Background start_tessera(const std::string& args, const std::string& dir);
// Waits for it (killing it after timeout_s); status as in CliResult, plus a flag: exited normally (not by a signal).
CliResult wait_tessera(const Background& b, double timeout_s, bool* exited_normally = nullptr);

// The promise for bad input: a non-zero exit (not a signal), one line on stderr starting "error: ", no longer
// than max_chars, containing needle.
void expect_one_line_error(const CliResult& r,
                           const std::string& needle,
                           const std::string& what,
                           size_t max_chars = 2000);

// A run directory's "loss" and "eval_loss" fields of the steps after `after`, by (key, step), exactly as written
// (shortest round-trip text: equal text = equal bits).
std::map<std::pair<std::string, int64_t>, std::string> losses(const std::string& run_dir, int64_t after = 0);
// Two runs' losses of the steps in (after, upto] within 1e-5 relative (gtest expectations).
void expect_close_losses(const std::string& a,
                         const std::string& b,
                         int64_t after = 0,
                         int64_t upto = std::numeric_limits<int64_t>::max());

// The JSON objects of a JSONL file's complete lines (metrics.jsonl, alerts.jsonl, events.jsonl; a running job's
// line still being written is left out); none when the file does not exist.
std::vector<Json> jsonl(const std::string& path);

// TESSERA_FAULT (train/fault.h) for the commands run in one scope (they inherit the environment).
struct FaultEnv {
    explicit FaultEnv(const std::string& fault);
    ~FaultEnv();
    FaultEnv(const FaultEnv&) = delete;
};

}  // namespace tessera::test
