// Checkpoints: a directory <run>/checkpoints/step_NNNNNNN/ holding
//   config.json          the full run config
//   model.safetensors    parameters under their Hugging Face names (a run of one process)
//   model-RRRRR-of-WWWWW.safetensors  a run of W ranks: rank R's ranges of the parameters, one f32 tensor
//                        "params" laid out as its optimizer file's moments, with the same "pieces" metadata
//   model.index.json     a run of W ranks: the W model files and every tensor's whole shape
//   optimizer-RRRRR-of-WWWWW.safetensors  AdamW moments "m", "v" of rank R's ranges (train/optimizer.h),
//                        one file per rank of the W that trained, metadata "pieces": which elements of
//                        which whole parameter each stretch of m and v holds
//   trainer_state.json   step, optimizer step, data position, format version
// written under a temporary name, fsync'd, then renamed into place: a crash mid-write leaves the
// previous checkpoints intact. With several ranks every rank writes its model and optimizer files into
// rank 0's temporary directory and rank 0 renames it when all have finished: no rank ever holds more than
// its own ranges (FSDP's dense parameters stay sharded, experts stay on their ranks). The ranges are
// re-cut on loading, so a run resumes on any number of ranks and EP degree, and export-hf, logits and
// generate read either layout. Loading validates every file and tensor and names what is wrong.
#pragma once

#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/buffer_spec.h"
#include "core/config_reader.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "parallel/mesh.h"
#include "train/data/loader.h"
#include "train/optimizer.h"

namespace tessera::train {

struct TrainerState {
    int64_t step = 0;            // optimizer steps completed
    int64_t optimizer_step = 0;  // AdamW's step counter
    LoaderPosition data;
    int64_t tokens_seen = 0;
    // a fine-tune with a frozen base (train.base + model.lora): frozen_hash of the base it started from
    std::optional<int64_t> base_hash;
};

// Expert parallelism: the experts [first, first + count) of `total` a rank holds; expert-sharded parameters
// (Sharding::expert) are that slice of the whole tensor (total 0: whole tensors everywhere).
struct ExpertSlice {
    int64_t first = 0, total = 0;
};

struct CheckpointContents {
    const Json& config;
    const BufferGroup& params;  // one process: written whole as model.safetensors
    const AdamW& opt;           // this rank's moments
    ParamRanges ranges;         // several ranks: this rank's ranges of the parameters (the optimizer's)
    ExpertSlice experts;        // expert parallelism: this rank's experts (for the index's whole shapes)
    TrainerState state;
    size_t frozen = 0;  // the first `frozen` parameters are a frozen base (train.base): not written
    // pipeline stages: every trained parameter of the whole model (the index names them all; a rank holds its
    // stage's); null: the optimizer's
    const std::vector<BufferSpec>* all_specs = nullptr;
};

// Writes <run_dir>/checkpoints/step_<step>/ atomically; returns its path. With a mesh of several ranks:
// collective, every rank writes its own ranges of the parameters and moments.
std::string save_checkpoint(const std::string& run_dir,
                            const CheckpointContents& c,
                            const parallel::Mesh* mesh = nullptr);

// What one rank writes into a checkpoint's directory: safetensors files of named tensors, views of the live
// buffers or (copy: a snapshot that lives on while training goes on) of copies it owns; and what rank 0 writes
// when every rank's files are in place.
struct RankFiles {
    struct File {
        std::string name;
        std::vector<NamedTensor> tensors;
        std::map<std::string, std::string> meta;
    };
    std::vector<File> files;
    std::vector<Tensor> owned;
    std::vector<std::shared_ptr<ScratchFile>> mapped;  // copies of offloaded moments (train/optimizer.h)
    int rank = 0, world = 1;
    Json config;
    TrainerState state;
    std::vector<BufferSpec> specs;
    ExpertSlice experts;
};
RankFiles rank_files(const CheckpointContents& c, int rank, int world, bool copy);
// Writes them into dir; `between` (if set) runs between two files (a test fault: a writer killed mid-write).
void write_rank_files(const RankFiles& f, const std::filesystem::path& dir, const std::function<void()>& between = {});

// Asynchronous checkpoints (docs/operations.md): begin() copies this rank's part (parameters or its ranges, AdamW
// moments) and a thread of its own writes it while training goes on; poll() between steps is a collective that
// tells whether every rank's files are on disk, and then rank 0 completes the checkpoint (config, trainer state,
// the rename into place) and every rank gets its path. A crash at any point leaves the previous checkpoints as
// they were: the new one is a temporary directory until the rename. One checkpoint is in flight at a time.
class CheckpointWriter {
  public:
    CheckpointWriter(std::string run_dir, const parallel::Mesh* mesh, std::function<void()> between = {});
    ~CheckpointWriter();
    CheckpointWriter(const CheckpointWriter&) = delete;
    void begin(const CheckpointContents& c);  // collective (with a mesh); waits for the one in flight first
    // The completed checkpoint's path when the one in flight is done (wait: block until it is), else nothing.
    std::optional<std::string> poll(bool wait = false);
    std::string finish() { return poll(true).value_or(""); }
    bool pending() const { return job_ != nullptr; }

  private:
    void loop();
    int comm_rank() const;
    std::string run_dir_;
    parallel::Comm* comm_;
    std::function<void()> between_;
    std::filesystem::path final_, tmp_;
    std::shared_ptr<RankFiles> job_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool written_ = false, quit_ = false;
    std::string error_;
    std::thread thread_;
};

// A checkpoint directory itself, or the latest complete checkpoint under <dir>/checkpoints.
// Throws if there is none.
std::string resolve_checkpoint(const std::string& dir);
// Whether <run_dir>/checkpoints holds a complete checkpoint (a run that --resume can continue).
bool holds_checkpoint(const std::string& run_dir);
// Removes what killed writers left in a run directory: checkpoints/.step_N.tmp-<host>-<pid> (incomplete) and
// config.json / metrics.jsonl .tmp-<pid> files, only when the writer is certainly dead (this host, no such pid);
// a checkpoints/.step_N.old-... moved aside while its replacement was written goes back to step_N when that
// replacement never arrived. Returns one line per action.
std::vector<std::string> clean_stale_temporaries(const std::string& run_dir);

Json load_checkpoint_config(const std::string& ckpt_dir);
// Validated: its step must match the directory name step_NNNNNNN, optimizer_step must not exceed it.
TrainerState load_trainer_state(const std::string& ckpt_dir);
// Elements [whole_offset, whole_offset + length) of the whole tensor of parameter spec `param`, into dst.
struct ParamTarget {
    size_t param = 0;
    int64_t whole_offset = 0, length = 0;  // elements
    void* dst = nullptr;
    DType dtype = DType::f32;     // of dst: f32, or held narrow (a frozen base in bf16, frozen experts in mxfp4)
    Device device = Device::cpu;  // where dst is (a device's values go through host memory)
    // set: an mxfp4 target read in place in the checkpoint's layout (core/mxfp4.h), dst its packed values
    const void* scales = nullptr;
    // n f32 values into elements [at, at + n) of the target (rounded to bf16 or quantised to MXFP4 there: then in
    // whole blocks); throws naming `where` and the parameter at a NaN or Inf
    void store(int64_t at, const float* src, int64_t n, const std::string& where, const std::string& name) const;
    // its values on the host: dst itself, or a device's copied into `staging`
    const void* host_values(std::vector<std::byte>& staging) const;
};
// A parameter's shape in the checkpoint (all experts), and the target for all of it that this rank holds (whole,
// or its expert slice) at dst.
Shape whole_shape(const BufferSpec& spec, ExpertSlice experts);
ParamTarget held_target(
    size_t param, const BufferSpec& spec, ExpertSlice experts, void* dst, Device device = Device::cpu);
// held_target for the parameters [first, last) of a group, at their own memory (one per slice of a parameter whose
// slices are stored apart).
std::vector<ParamTarget> held_targets(const BufferGroup& params, size_t first, size_t last, ExpertSlice experts);
// Reads the targets from a checkpoint's parameters, whichever layout wrote them (model.safetensors, or the
// model files of any number of ranks): every target must be covered, every stored tensor must be one of the
// specs with its whole shape, and the values finite (a NaN or Inf weight is an error naming the tensor).
// elsewhere: the names of parameters other pipeline stages hold (skipped, not refused).
void load_params(const std::string& ckpt_dir,
                 const std::vector<BufferSpec>& specs,
                 const std::vector<ParamTarget>& targets,
                 ExpertSlice experts = {},
                 const std::set<std::string>& elsewhere = {});
// The parameters of a group from index `first` on (whole, or this rank's expert slice).
void load_params(const std::string& ckpt_dir, const BufferGroup& params, ExpertSlice experts = {}, size_t first = 0);
// This rank's pieces of the optimizer moments (AdamW::pieces) from a checkpoint's optimizer files, whatever
// number of ranks and EP degree wrote them: each file names its pieces by parameter and whole-tensor offset.
void load_optimizer(const std::string& ckpt_dir, AdamW& opt, const std::set<std::string>& elsewhere = {});

}  // namespace tessera::train
