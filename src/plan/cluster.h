// A cluster description (docs/plan.md, spec/scale.md §8): the devices (memory, peak FLOP/s per dtype, the fraction
// of peak each op class reaches, memory bandwidth), the hosts (devices per host, host memory and disk for offload)
// and the links by level (each level joins groups of `span` consecutive devices: NVLink inside a node, a supernode's
// fabric, the scale-out network), as one JSON file. Shipped examples: configs/cluster/. Units in the file are the
// ones datasheets use (GB = 1e9 bytes, GB/s, TFLOP/s, µs); in memory everything is in base units.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace tessera::plan {

// The op classes a device's efficiency is given for (fraction of the compute dtype's peak).
enum class OpClass { gemm, grouped_gemm, attention, kda };
inline constexpr OpClass kOpClasses[] = {OpClass::gemm, OpClass::grouped_gemm, OpClass::attention, OpClass::kda};
// Its key in cluster files: "gemm", "grouped_gemm", "attention", "kda".
const char* op_class_name(OpClass cls);
// The class a block's own FLOPs are priced at, by the block's kind (model::Model::block_kinds): KDA and GDN kda,
// attention, MLA and DSA attention, the rest (dense MLP; an MoE block's router and shared experts) gemm. An MoE
// block's routed experts are grouped_gemm.
OpClass block_class(const std::string& kind);

// The collectives the runtime's traffic is made of: FSDP's and ZeRO-2's parameter gathers and gradient
// reduce-scatters (parallel/comm.h: an all-to-all of the chunks and a sum in rank order), expert parallelism's
// exchanges.
enum class Collective { all_gather, reduce_scatter, all_to_all };
inline constexpr Collective kCollectives[] = {Collective::all_gather, Collective::reduce_scatter,
                                              Collective::all_to_all};
// Its key in cluster files: "all_gather", "reduce_scatter", "all_to_all".
const char* collective_name(Collective k);

struct Link {
    std::string name;
    int64_t span = 0;      // devices per group at this level (0: the whole cluster)
    double bandwidth = 0;  // bytes/s per device per direction
    double latency = 0;    // seconds per message
    // measured (`tessera calibrate`): per collective, the bandwidth and latency of groups of `ranks` devices
    // (ascending), which take the place of bandwidth and latency for that collective where present
    std::vector<double> ranks;
    std::map<Collective, std::vector<double>> bandwidth_by_ranks, latency_by_ranks;
    // α-β time of one collective over a group of `group` devices that moves `bytes` per device in `messages`
    // messages: the collective's measured bandwidth and latency at that group size (interpolated linearly in log
    // ranks, held at the ends), or the link's.
    double seconds(Collective k, int64_t group, double bytes, double messages) const;
};

// A collective's time t = α + x / β for x bytes, fitted to measured (x, t) points by least squares on relative
// errors (Σ ((α + x/β − t) / t)²: a small call's latency weighs as much as a large one's bandwidth). When the
// unconstrained fit's α is negative (the larger calls' line crosses zero: late wake-ups slowed the small calls, or the
// bandwidth falls with size), the line through the smallest and the largest call instead: the latency from the one, the
// bandwidth from the other, α no less than 0 and no more than the fastest call took. At least two distinct sizes.
struct AlphaBeta {
    double alpha = 0, beta = 0;  // seconds; bytes per second
};
AlphaBeta fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds);

struct Cluster {
    std::string name, source;  // source: where the numbers come from (a datasheet, `tessera calibrate`)
    int64_t devices = 1;
    struct Device {
        std::string name;
        double memory = 0;             // bytes
        double usable_fraction = 0.9;  // of memory a run may plan for (the rest: runtime, libraries, fragmentation)
        // bytes a rank's process holds outside the engine's arena (a GPU's CUDA context and communication
        // libraries; on a CPU the process's code, libraries, MPI and data), taken off the usable memory
        double reserved = 0;
        double usable() const { return memory * usable_fraction - reserved; }
        std::map<std::string, double> peak_flops;  // per dtype (f32, bf16, fp8), FLOP/s
        std::string compute_dtype = "bf16";        // the dtype the engine's GEMMs run in on it
        std::map<OpClass, double> efficiency;      // fraction of peak per op class (a datasheet's one number)
        // measured (`tessera calibrate`): the fraction by tokens per call, at `tokens` ascending, which takes the place
        // of `efficiency` where present; and the share of a forward + backward's time that is the forward
        std::vector<double> tokens;
        std::map<OpClass, std::vector<double>> efficiency_by_tokens;
        std::map<OpClass, double> forward_share;
        // The class's fraction of peak for calls of `tokens` tokens (a micro-batch's; for grouped_gemm the tokens
        // routed over the whole expert set): `efficiency_by_tokens` interpolated linearly in log tokens and held at
        // its ends, or `efficiency`.
        double efficiency_at(OpClass cls, double tokens) const;
        // The forward's share of a forward + backward's time: measured, or the FLOP count's 1/3.
        double forward_fraction(OpClass cls) const;
        // measured (`tessera calibrate` under mpirun): how much slower a block of the class computes while FSDP's
        // gathers and reduce-scatters of its unit run beside it (memory bandwidth and caches shared with the
        // transfers), as a fraction: 0.1 = 10% slower. Absent: 0.
        std::map<OpClass, double> beside_fsdp;
        double beside_fsdp_factor(OpClass cls) const {
            const auto it = beside_fsdp.find(cls);
            return 1.0 + (it == beside_fsdp.end() ? 0.0 : it->second);
        }
        // measured (`tessera calibrate`): the share of a block's time per token that every rank of a tensor group
        // repeats (norms, latent down-projections, DSA's indexer, per-token costs of the kernels), from the block over
        // half its heads: t(H/2) = (1 + s) / 2 · t(H) on the same tokens. A part over 1/T of the heads then takes
        // s + (1 − s) / T of the whole block's time. Above 1 when the part is slower than half. Absent: the FLOPs'
        // share.
        std::map<OpClass, double> tensor_shared;
        double memory_bandwidth = 0;  // bytes/s
        int64_t threads = 0;          // CPU devices: OpenMP threads per rank (sizes the workspace)
        double peak() const { return peak_flops.at(compute_dtype); }
    } device;
    struct Host {
        int64_t devices = 1;          // per host
        double memory = 0, disk = 0;  // bytes (optimizer / expert offload)
        double link_bandwidth = 0;    // bytes/s device <-> host memory (PCIe, C2C)
        // optimizer offload (memory.optimizer_offload): the offloaded update's extra seconds per moment byte, as a
        // rate (`tessera calibrate` measures it; 0: offload is not searched)
        double offload_bandwidth = 0;
        // the weight budget (memory.weights_budget): bytes/s a frozen base's released pages are read back from
        // storage as the prefetch thread faults them in (`tessera calibrate` measures it; 0: the budget is not
        // searched)
        double read_bandwidth = 0;
    } host;
    std::vector<Link> links;  // innermost first; the last spans the cluster

    // The level a group of `size` consecutive devices communicates over: the innermost that holds it whole.
    const Link& link_for(int64_t size) const;
};

// Reads and checks a cluster file: a key it does not know, a missing value or an impossible one is a one-line error
// naming the file and the key.
Cluster load_cluster(const std::string& path);

}  // namespace tessera::plan
