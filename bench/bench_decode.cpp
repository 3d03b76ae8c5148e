// Decoding speed of a model config (default: the demo hybrid, configs/demo.json) with the incremental
// caches: tokens/s of one sequence at context positions 1K and 16K (the KV / indexer-key caches grow with
// the position, the KDA state does not), next to re-running the forward over the whole context per token
// (generation without caches). Weights are random (speed does not depend on them); caches hold zeros.
//   build/bench/bench_decode [--config FILE] [--positions 1024,16384] [--tokens 64]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/runtime.h"
#include "train/config.h"

using namespace tessera;

int main(int argc, char** argv) {
    std::string config = std::string(TESSERA_SOURCE_DIR) + "/configs/demo.json";
    std::vector<int64_t> positions = {1024, 16384};
    int64_t tokens = 64;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help") {
            std::puts("usage: bench_decode [--config FILE] [--positions P,P,...] [--tokens N]");
            return 0;
        }
        if (i + 1 == argc) {
            std::fprintf(stderr, "bench_decode: %s needs a value\n", a.c_str());
            return 2;
        }
        const std::string v = argv[++i];
        if (a == "--config") {
            config = v;
        } else if (a == "--positions") {
            positions.clear();
            for (size_t p = 0; p < v.size();) {
                const size_t q = v.find(',', p);
                positions.push_back(std::stoll(v.substr(p, q - p)));
                p = q == std::string::npos ? v.size() : q + 1;
            }
        } else if (a == "--tokens") {
            tokens = std::stoll(v);
        } else {
            std::fprintf(stderr, "bench_decode: unknown argument %s (see --help)\n", a.c_str());
            return 2;
        }
    }
    const train::RunConfig cfg = train::parse_run_config(train::load_config_json(config, {}), config);
    const int64_t max_pos = *std::max_element(positions.begin(), positions.end()) + tokens, V = cfg.model.vocab_size;
    using Clock = std::chrono::steady_clock;
    std::printf("decoding %s on %d threads, one sequence, %lld tokens per measurement\n\n", config.c_str(),
                omp_get_max_threads(), (long long)tokens);
    std::printf("| context position | incremental tok/s | full re-forward tok/s | speed-up |\n|---|---|---|---|\n");
    for (int64_t pos : positions) {
        double inc = 0, full = 0;
        {
            model::Model m(cfg.model);
            BufferGroup cache("cache", m.cache_specs(1, max_pos));
            model::ModelRuntime rt(m, {1, 1}, false, {}, {&cache});
            m.bind_cache(cache);
            m.init_params(rt.params(), 1);
            Tensor logits(DType::f32, Shape{1, V});
            int32_t id = 65;
            const auto t0 = Clock::now();
            for (int64_t i = 0; i < tokens; ++i) m.decode_step(pos + i, std::span(&id, 1), logits);
            inc = double(tokens) / std::chrono::duration<double>(Clock::now() - t0).count();
        }
        {
            model::Model m(cfg.model);
            model::ModelRuntime rt(m, {1, pos + 1}, false, {});
            m.init_params(rt.params(), 1);
            std::vector<int32_t> ids(size_t(pos + 1), 65);
            Tensor logits(DType::f32, Shape{pos + 1, V});
            const int64_t reps = std::max<int64_t>(1, std::min<int64_t>(tokens, 4));
            const auto t0 = Clock::now();
            for (int64_t i = 0; i < reps; ++i) m.forward_logits({1, pos + 1}, ids, logits);
            full = double(reps) / std::chrono::duration<double>(Clock::now() - t0).count();
        }
        std::printf("| %lld | %.1f | %.2f | %.0fx |\n", (long long)pos, inc, full, inc / full);
        std::fflush(stdout);
    }
    return 0;
}
