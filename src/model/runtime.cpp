// Model runtime: one arena, sized from the buffer specs, holding every group.
#include "model/runtime.h"

#include <omp.h>
#include <unistd.h>

#include <bit>
#include <cstdlib>
#include <fstream>

#include "core/device.h"
#include "ops/backend.h"
#include "ops/gemm.h"

namespace tessera::model {

namespace {
// NOTES: the allocator keeps ~22 bytes of bookkeeping per min_block unit, and each group is one
// block, so the unit only bounds rounding waste: pages (4 KiB), grown so there are at most 2^16 units,
// keep the bookkeeping under 1.5 MiB. 256-byte units cost 23 MiB of it beside a 270 MiB arena, outside
// the prediction (tests/model/test_memory.cpp).
size_t min_block_for(const std::vector<const BufferGroup*>& groups) {
    size_t total = 0;
    for (const BufferGroup* g : groups) total += g->nbytes();
    return std::max<size_t>(4096, std::bit_ceil(total >> 16));
}

// NOTES: VmHWM of /proc/self/status, not getrusage's ru_maxrss, which Linux carries across exec
// (a process started from a large parent would report the parent's peak).
size_t process_peak_rss() {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("VmHWM:", 0) == 0) return size_t(std::strtoull(line.c_str() + 6, nullptr, 10)) * 1024;
    }
    return 0;
}

std::string mib(size_t b) { return fmt::format("{:.1f} MiB", double(b) / double(1 << 20)); }

size_t physical_memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
}

// Every group is zero-filled on allocation, so a run that needs more than the machine's memory would only
// swap or be killed, and one larger than the GPU's free memory would fail in cudaMalloc: refuse it up front, with the
// sizes.
void check_fits_in_memory(const std::vector<BufferGroup*>& groups, Device device) {
    size_t need = 0;
    std::string parts;
    for (const BufferGroup* g : groups) {
        if (__builtin_add_overflow(need, g->nbytes(), &need)) need = SIZE_MAX;
        parts += fmt::format("{}{} {:.1f} GiB", parts.empty() ? "" : ", ", g->name(), double(g->nbytes()) / 0x1p30);
    }
    if (device == Device::cuda) {
        const size_t have = cuda_free_bytes();
        TESSERA_CHECK(have == 0 || need <= have,
                      "the model needs {:.1f} GiB of GPU memory ({}) but the GPU has {:.1f} GiB free; make the model, "
                      "the batch or the sequence smaller, or spread it over more GPUs (parallel.shard, parallel.ep)",
                      double(need) / 0x1p30, parts, double(have) / 0x1p30);
        return;
    }
    const size_t have = physical_memory_bytes();
    TESSERA_CHECK(have == 0 || need <= have,
                  "the model needs {:.1f} GiB of memory ({}) but this machine has {:.1f} GiB; make the model, the "
                  "batch or the sequence smaller",
                  double(need) / 0x1p30, parts, double(have) / 0x1p30);
}
}  // namespace

std::vector<BufferSpec> grad_specs(const std::vector<BufferSpec>& params) {
    std::vector<BufferSpec> g;
    for (const BufferSpec& s : params) {
        if (!s.trainable) continue;  // frozen: no gradient
        g.push_back(s);
        g.back().kind = BufferKind::grad;
    }
    return g;
}

RuntimeGroups runtime_groups(const Model& model,
                             StepShape max,
                             bool with_grads,
                             const Recompute& recompute,
                             ParamPlacement* placement,
                             int threads) {
    RuntimeGroups g;
    g.params = placement ? std::move(placement->params) : BufferGroup("params", model.param_specs());
    g.acts = BufferGroup("activations", model.activation_specs(max, recompute));
    g.workspace = BufferGroup(
        "workspace", {{"workspace", DType::u8, Shape{int64_t(std::max<size_t>(1, model.workspace_bytes(max, threads)))},
                       BufferKind::workspace}});
    g.with_grads = with_grads;
    if (with_grads)
        g.grads = placement ? std::move(placement->grads) : BufferGroup("grads", grad_specs(model.param_specs()));
    return g;
}

std::vector<BufferGroup*> RuntimeGroups::all(const std::vector<BufferGroup*>& extra) {
    std::vector<BufferGroup*> v = {&params, &acts, &workspace};
    if (with_grads) v.push_back(&grads);
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
}

std::vector<size_t> arena_block_bytes(const std::vector<const BufferGroup*>& groups) {
    const size_t unit = min_block_for(groups);
    const BuddyAllocator rounding(unit, unit);
    std::vector<size_t> b;
    for (const BufferGroup* g : groups) b.push_back(rounding.rounded_size(std::max<size_t>(g->nbytes(), 1)));
    return b;
}

ModelRuntime::ModelRuntime(Model& model,
                           StepShape max,
                           bool with_grads,
                           const Recompute& recompute,
                           std::vector<BufferGroup*> extra,
                           ParamPlacement* placement,
                           Device device)
    : ModelRuntime(model,
                   max,
                   recompute,
                   std::move(extra),
                   runtime_groups(
                       model, max, with_grads, recompute, placement, device == Device::cpu ? omp_get_max_threads() : 1),
                   device) {}

ModelRuntime::ModelRuntime(Model& model,
                           StepShape max,
                           const Recompute& recompute,
                           std::vector<BufferGroup*> extra,
                           RuntimeGroups groups,
                           Device device)
    : model_(model),
      max_(max),
      g_(std::move(groups)),
      params_(g_.params),
      grads_(g_.grads),
      acts_(g_.acts),
      workspace_(g_.workspace) {
    groups_ = g_.all(extra);
    check_fits_in_memory(groups_, device);
    std::vector<const BufferGroup*> cg(groups_.begin(), groups_.end());
    const size_t min_block = min_block_for(cg);
    arena_ = std::make_shared<Arena>(predict_arena_bytes(cg, min_block), min_block, device);
    allocate_groups(arena_, groups_);
    TensorView ws = workspace_.view(0);
    model.bind(params_, g_.with_grads ? &grads_ : nullptr, acts_,
               std::span(static_cast<std::byte*>(ws.data), ws.nbytes()), max, recompute);
}

MemoryReport ModelRuntime::memory_report() const {
    MemoryReport r;
    const std::vector<const BufferGroup*> cg(groups_.begin(), groups_.end());
    const std::vector<size_t> blocks = arena_block_bytes(cg);
    for (size_t i = 0; i < cg.size(); ++i) {
        r.groups.push_back({cg[i]->name(), cg[i]->nbytes(), blocks[i]});
        r.predicted_bytes += blocks[i];
    }
    r.capacity_bytes = arena_->stats().capacity;
    if (device() == Device::cpu) r.outside_arena_bytes = ops::gemm_copy_buffer_bytes() * size_t(omp_get_max_threads());
    if (device() == Device::cuda) r.device_scratch_bytes = ops::cuda_scratch_bytes();
    r.process_peak_rss_bytes = process_peak_rss();
    r.arena_peak_bytes = arena_->stats().peak_bytes_in_use;
    return r;
}

std::string MemoryReport::str() const {
    std::string s = "memory by buffer group (one arena):";
    for (auto& g : groups) s += fmt::format(" {} {},", g.name, mib(g.block_bytes));
    s.back() = '\n';
    s += fmt::format("  predicted peak {}, arena high-water mark {} (arena reserves {} of address space)",
                     mib(predicted_bytes), mib(arena_peak_bytes), mib(capacity_bytes));
    s += fmt::format("; outside it, GEMM copy buffers {}", mib(outside_arena_bytes));
    if (device_scratch_bytes)
        s += fmt::format(", on the device kernel scratch and GEMM operand copies {} so far", mib(device_scratch_bytes));
    if (process_peak_rss_bytes) s += fmt::format("; process peak RSS {}", mib(process_peak_rss_bytes));
    return s;
}

}  // namespace tessera::model
