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

#include <optional>
#include <string>
#include <vector>

#include "core/buffer_spec.h"
#include "core/config_reader.h"
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
};

// Writes <run_dir>/checkpoints/step_<step>/ atomically; returns its path. With a mesh of several ranks:
// collective, every rank writes its own ranges of the parameters and moments.
std::string save_checkpoint(const std::string& run_dir,
                            const CheckpointContents& c,
                            const parallel::Mesh* mesh = nullptr);

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
    DType dtype = DType::f32;  // of dst: f32, or held narrow (a frozen base in bf16, frozen experts in mxfp4)
    // n f32 values into elements [at, at + n) of the target (rounded to bf16 or quantised to MXFP4 there: then in
    // whole blocks); throws naming `where` and the parameter at a NaN or Inf
    void store(int64_t at, const float* src, int64_t n, const std::string& where, const std::string& name) const;
};
// A parameter's shape in the checkpoint (all experts), and the target for all of it that this rank holds (whole,
// or its expert slice) at dst.
Shape whole_shape(const BufferSpec& spec, ExpertSlice experts);
ParamTarget held_target(size_t param, const BufferSpec& spec, ExpertSlice experts, void* dst);
// held_target for the parameters [first, last) of a group, at their own memory.
std::vector<ParamTarget> held_targets(const BufferGroup& params, size_t first, size_t last, ExpertSlice experts);
// Reads the targets from a checkpoint's parameters, whichever layout wrote them (model.safetensors, or the
// model files of any number of ranks): every target must be covered, every stored tensor must be one of the
// specs with its whole shape, and the values finite (a NaN or Inf weight is an error naming the tensor).
void load_params(const std::string& ckpt_dir,
                 const std::vector<BufferSpec>& specs,
                 const std::vector<ParamTarget>& targets,
                 ExpertSlice experts = {});
// The parameters of a group from index `first` on (whole, or this rank's expert slice).
void load_params(const std::string& ckpt_dir, const BufferGroup& params, ExpertSlice experts = {}, size_t first = 0);
// This rank's pieces of the optimizer moments (AdamW::pieces) from a checkpoint's optimizer files, whatever
// number of ranks and EP degree wrote them: each file names its pieces by parameter and whole-tensor offset.
void load_optimizer(const std::string& ckpt_dir, AdamW& opt);

}  // namespace tessera::train
