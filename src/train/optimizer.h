// AdamW over the parameter group, sharded ZeRO-style: the group's flat f32 element space is
// [replicated | data | expert] (Model::param_specs orders the parameters by their Sharding); each region is
// cut into ranges over the ranks that hold the same values (the data group for the replicated and data
// parameters, with FSDP the shard group for the data ones, the expert-data group for this rank's experts;
// parallel/shard.h, parallel/mesh.h), and each rank keeps the
// first and second moments of its three ranges only, updating those ranges of the parameters from the same
// ranges of the summed gradient (GradientSum). With FSDP the data region's range is all a rank holds of those
// parameters (train/fsdp.h). The moments are buffer groups (kind optimizer), so they are sized,
// allocated and checkpointed like everything else. Weight decay applies to parameters whose spec says so
// (matrices, not norms). Global-norm gradient clipping reduces in a fixed order: Σ g² per fixed chunk of
// kChunk elements of a region (from the start of each of the model's units), the chunk sums of each region gathered
// and added in flat order, the expert region's sums of the EP ranks added in rank order, so the norm has the same bits
// on any thread count, any number of data-parallel ranks, with or without FSDP.
//
// Optimizer offload (memory.optimizer_offload; docs/train.md): m and v live outside the arena, in a scratch file's
// mapping (core/file.h: made in the offload directory, unlinked at once, its blocks reserved), which the kernel pages
// to and from the disk. The update streams through them in state order a window (memory.offload_window_mib) at a time:
// the next window's pages are asked for ahead (MADV_WILLNEED) and each finished window is dropped from the resident
// set, so at most two windows of each moment are resident. The update is elementwise, so the bits are the ones of
// moments in the arena.
#pragma once

#include <algorithm>
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "core/buffer_spec.h"
#include "core/file.h"
#include "parallel/mesh.h"
#include "parallel/shard.h"
#include "train/config.h"

namespace tessera::train {

// This rank's range of each region of the summed gradient, and of the parameters: [replicated, data, expert].
struct GradRanges {
    std::array<std::span<float>, 3> region;
};
struct ParamRanges {
    std::array<std::span<float>, 3> region;
};

// A piece of one parameter's moments held here: elements [whole_offset, whole_offset + length) of the whole
// tensor (all experts, under expert parallelism) at state_offset in m and v. A rank's pieces name its state
// independently of the layout, so a checkpoint's moments re-cut for any number of ranks and EP degree.
struct StatePiece {
    size_t param = 0;  // index into the parameter specs
    int64_t whole_offset = 0, state_offset = 0, length = 0;
    int64_t range_offset = 0;  // where the piece starts in this rank's range of its region
    int region = 0;            // AdamW::Region
};

class AdamW {
  public:
    static constexpr int64_t kChunk = int64_t(1) << 16;
    enum Region { replicated = 0, data = 1, expert = 2 };
    static constexpr size_t kRegions = 3;

    // mesh null (one process): every element here. first_expert: the first of the experts whose (sliced)
    // parameters are here, with expert parallelism. units: the parameters that start one of the model's units (its
    // trained dense parameters, its experts): the regions' segments, where the norm's chunks start afresh, whatever
    // the layout; fsdp: the data and expert regions are cut spread over their ranks, unit by unit (parallel/shard.h).
    AdamW(const std::vector<BufferSpec>& param_specs,
          const parallel::Mesh* mesh = nullptr,
          int64_t first_expert = 0,
          const std::vector<size_t>& units = {},
          bool fsdp = false,
          int64_t offload_window = 0);
    // offload_window: 0, the moments in the arena; else they are offloaded, streamed this many elements at a time.
    // The default window (memory.offload_window_mib): 4 Mi elements, 16 MiB of each moment.
    static int64_t offload_window_elements(double mib) { return std::max<int64_t>(1024, int64_t(mib * (1 << 18))); }

    // Offloaded: the moments' scratch file, made in dir (train() does this; a planned rank never does). Before any
    // other use of m and v.
    void offload_to(const std::string& dir);
    int64_t offload_window() const { return offload_window_; }
    bool offloaded() const { return offload_window_ > 0; }
    const std::string& offload_dir() const { return offload_dir_; }
    size_t offloaded_bytes() const;         // m and v in their file (0 when not offloaded)
    size_t offload_resident_bytes() const;  // the most of them resident during a step (two windows of each)
    void release() const;                   // offloaded: m and v leave the resident set (after a checkpoint)

    BufferGroup& m() { return m_; }
    BufferGroup& v() { return v_; }
    const BufferGroup& m() const { return m_; }
    const BufferGroup& v() const { return v_; }
    // Where the moments live (their arena's device), and with them the parameter and gradient ranges it updates.
    Device device() const { return m_.device(); }
    // m and v hold this rank's range of each region in turn
    const std::array<parallel::ShardedRegion, kRegions>& regions() const { return regions_; }
    // Where region r starts in a group of param_specs() (whole, or placed by FSDP with the data region
    // elsewhere: the replicated and expert regions are laid out alike in both); null for an empty region.
    float* region_base(const BufferGroup& g, size_t r) const;
    // this rank's ranges of the parameters of a group of param_specs()
    ParamRanges ranges_of(const BufferGroup& params) const;
    const std::vector<StatePiece>& pieces() const { return pieces_; }
    // Whether this rank writes a piece to a checkpoint: every piece but HSDP's copies of the dense ranges, which
    // the first replica writes.
    bool saves(const StatePiece& p) const {
        const parallel::Comm* rep = regions_[size_t(p.region)].replicas;
        return !rep || rep->rank() == 0;
    }
    const std::vector<BufferSpec>& param_specs() const { return specs_; }
    int64_t step() const { return step_; }
    void set_step(int64_t s) { step_ = s; }

    // L2 norm of the whole gradient from this rank's ranges of it; collective over the mesh.
    double grad_norm(const GradRanges& g);
    // Scales the ranges by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_).
    void clip(const GradRanges& g, double norm, double max_norm) const;
    // One AdamW step of this rank's ranges of every trainable parameter at learning rate lr (all, when
    // `trainable` is empty; frozen ones are left alone: no update, no decay, moments unchanged).
    void update(const TrainConfig& c,
                const ParamRanges& params,
                const GradRanges& g,
                double lr,
                const std::vector<bool>& trainable = {});
    // After update on every rank: each rank's ranges of the parameters to the others of its groups (collective);
    // fsdp: not the data and expert regions (FSDP keeps only ranges of them).
    void share_params(const BufferGroup& params, bool fsdp = false) const;

  private:
    TensorView flat(std::span<const float> range) const;  // a range as a flat f32 view on device()
    // AdamW on elements [lo, hi) of a piece
    void update_piece(const TrainConfig& c,
                      const StatePiece& piece,
                      int64_t lo,
                      int64_t hi,
                      const ParamRanges& params,
                      const GradRanges& g,
                      double lr);
    double region_sum_of_squares(int region, std::span<const float> g);
    void order_norm_chunks();  // sizes mine_ and fills order_ (at the first norm)

    std::array<parallel::ShardedRegion, kRegions> regions_;
    std::array<int64_t, kRegions> state_at_{};   // where each region's range starts in m and v
    std::array<size_t, kRegions> first_spec_{};  // each region's first parameter (specs_.size(): empty)
    parallel::Comm* expert_ = nullptr;           // the EP ranks (their expert regions differ), null without EP
    parallel::Comm* pipeline_ = nullptr;         // the pipeline stages (their parameters differ), null without
    std::vector<BufferSpec> specs_;
    std::vector<int64_t> offsets_;  // flat element offset of each parameter
    std::vector<StatePiece> pieces_;
    BufferGroup m_, v_;
    int64_t offload_window_ = 0;
    std::unique_ptr<ScratchFile> offload_;
    std::string offload_dir_;
    std::array<std::vector<double>, kRegions> mine_,
        partial_;  // Σ g² per chunk: this rank's, every rank's (sized at the first norm)
    struct ChunkRun {
        size_t at = 0, n = 0;  // chunks [at, at + n) of partial_
    };
    std::array<std::vector<ChunkRun>, kRegions> order_;  // partial_'s chunks in flat order, run by run
    int64_t step_ = 0;
};

}  // namespace tessera::train
