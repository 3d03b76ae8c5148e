// Kimi K3's image tower and projector (model/vision.h) at the released shape (27 blocks of width 1024, 12 heads of
// 128, MLP 4096, projector to 7168): one forward per image grid, its achieved GFLOP/s (VisionTower::forward_flops:
// the GEMMs and the attention scores) against the machine's GEMM rate measured in the same run, median of --reps.
//   build/bench/bench_vision [--layers 27] [--grids 32x32,16x64] [--reps 3]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "model/vision.h"
#include "ops/gemm.h"

namespace {

using namespace tessera;

constexpr const char* kUsage =
    "usage: bench_vision [--layers N] [--grids HxW,...] [--reps R]\n"
    "  --layers  tower blocks (default 27, the release's)\n"
    "  --grids   patch grids, one forward each (default 32x32,16x64: 448x448 and 224x896 pixels, 256 image tokens)\n"
    "  --reps    forwards per grid; the median is reported (default 3)\n";

[[noreturn]] void usage_error(const std::string& what) {
    std::fprintf(stderr, "bench_vision: %s (see --help)\n", what.c_str());
    std::exit(2);
}

int64_t positive(const std::string& s, const char* flag) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v <= 0)
        usage_error(std::string(flag) + " needs a positive integer, got '" + s + "'");
    return v;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t layers = 27, reps = 3;
    std::vector<ops::PatchGrid> grids{{32, 32}, {16, 64}};
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help") {
            std::fputs(kUsage, stdout);
            return 0;
        }
        if (i + 1 == argc) usage_error("missing value for '" + a + "'");
        const std::string v = argv[++i];
        if (a == "--layers") {
            layers = positive(v, "--layers");
        } else if (a == "--reps") {
            reps = positive(v, "--reps");
        } else if (a == "--grids") {
            grids.clear();
            std::stringstream ss(v);
            std::string item;
            while (std::getline(ss, item, ',')) {
                const size_t x = item.find('x');
                if (x == std::string::npos) usage_error("--grids takes HxW,..., got '" + v + "'");
                grids.push_back({positive(item.substr(0, x), "--grids"), positive(item.substr(x + 1), "--grids")});
            }
        } else {
            usage_error("unknown argument '" + a + "'");
        }
    }
    model::VisionConfig c;  // the release's shape (spec/kimi_k3.md §1.5)
    c.layers = layers;
    c.text_width = 7168;
    c.image_token = 1;
    int64_t max_patches = 0;
    for (const ops::PatchGrid& g : grids) max_patches = std::max(max_patches, g.patches());
    c.max_patches = max_patches;
    model::VisionTower tower(c);
    std::vector<BufferSpec> specs;
    std::vector<model::ParamInit> inits;
    tower.declare_params(specs, inits);
    BufferGroup params("params", specs), acts("acts", tower.activation_specs(max_patches));
    BufferGroup ws("ws",
                   {{"ws", DType::u8, Shape{int64_t(tower.workspace_bytes(max_patches, omp_get_max_threads())) + 1},
                     BufferKind::workspace}});
    auto arena = std::make_shared<Arena>(predict_arena_bytes({&params, &acts, &ws}, 4096), 4096);
    allocate_groups(arena, {&params, &acts, &ws});
    for (size_t i = 0; i < specs.size(); ++i) {  // weights ~ N(0, 0.02)-sized, norms 1: activations stay O(1)
        const TensorView p = params.view(i);
        const bool norm = p.ndim() == 1;
        const Tensor r = bench::random_tensor(p.shape, 7, norm ? 1.0 : -0.035, norm ? 1.0 : 0.035, i);
        std::memcpy(p.data, r.view().data, p.nbytes());
    }
    tower.bind(params, acts, std::span(ws.base(), ws.nbytes()), 1);
    const double gemm = ops::measure_gemm_gflops();
    std::printf("image tower: %lld blocks of width %lld, %d threads; GEMM rate %.0f GFLOP/s\n",
                static_cast<long long>(layers), static_cast<long long>(c.width), omp_get_max_threads(), gemm);
    std::printf("| grid (patches) | image tokens | forward s (median of %lld) | GFLOP | GFLOP/s | of GEMM rate |\n",
                static_cast<long long>(reps));
    std::printf("|---|---|---|---|---|---|\n");
    for (const ops::PatchGrid& g : grids) {
        const std::vector<ops::PatchGrid> one{g};
        const Tensor patches = bench::random_tensor(Shape{g.patches(), c.patch_dim()}, 3, -1.0, 1.0, 1);
        Tensor out(DType::f32, Shape{tower.tokens(one), c.text_width});
        std::vector<double> t;
        for (int64_t r = 0; r < reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            tower.forward(one, patches, out);
            t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        const double s = t[t.size() / 2], gflop = tower.forward_flops(one) / 1e9;
        std::printf("| %lldx%lld (%lld) | %lld | %.3f | %.1f | %.1f | %.2f |\n", static_cast<long long>(g.h),
                    static_cast<long long>(g.w), static_cast<long long>(g.patches()),
                    static_cast<long long>(tower.tokens(one)), s, gflop, gflop / s, gflop / s / gemm);
    }
    return 0;
}
