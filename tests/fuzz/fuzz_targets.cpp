// The fuzz targets (see fuzz_targets.h).
#include "fuzz/fuzz_targets.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string_view>

#include "core/check.h"
#include "core/config_reader.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "model/hf_index.h"
#include "train/config.h"
#include "train/data/loader.h"
#include "train/data/token_source.h"

namespace tessera::fuzz {

namespace {
std::string_view text(Input d) { return {reinterpret_cast<const char*>(d.data()), d.size()}; }

// Runs f; a tessera::Error is a clean refusal, anything else escapes.
template <class F>
void clean(F&& f) {
    try {
        f();
    } catch (const Error&) {
    }
}
}  // namespace

void safetensors(Input data) {
    clean([&] { parse_safetensors(std::as_bytes(data), "fuzz.safetensors"); });
}

void config(Input data) {
    const std::string_view all = text(data);
    const size_t nul = all.find('\0');
    const std::string_view file = all.substr(0, nul);
    std::vector<std::string> sets;
    for (size_t at = nul; at != std::string_view::npos && at < all.size();) {
        const size_t next = all.find('\0', at + 1);
        sets.emplace_back(all.substr(at + 1, next == std::string_view::npos ? std::string_view::npos : next - at - 1));
        at = next;
    }
    clean([&] {
        // as train::load_config_json does for a file, then parse_run_config
        Json doc = parse_json(file, "fuzz.json");
        TESSERA_CHECK(doc.is_object(), "fuzz.json: the config must be a JSON object");
        for (const auto& s : sets) apply_override(doc, s);
        const train::RunConfig c = train::parse_run_config(doc, "fuzz.json");
        (void)train::to_json(c).dump();  // what a checkpoint writes
    });
}

void hf_index(Input data) {
    clean([&] { model::parse_hf_index(text(data), "model.safetensors.index.json"); });
}

void token_shard(Input data) {
    static const std::string path =
        (std::filesystem::temp_directory_path() / ("tessera-fuzz-" + std::to_string(::getpid()) + ".safetensors"))
            .string();
    {
        std::FILE* f = std::fopen(path.c_str(), "wb");
        if (!f) return;
        std::fwrite(data.data(), 1, data.size(), f);
        std::fclose(f);
    }
    clean([&] {
        train::TokenSource tokens(path);
        if (tokens.size() < 5) return;
        train::DataLoader loader(tokens, 2, 1, 0.25, 7);
        std::vector<int32_t> ids(2), targets(2);
        train::ImageBatch images;  // (a shard's images: the windows' rows and patches)
        for (int i = 0; i < 4; ++i) loader.next_batch(ids, targets, &images);
        for (int64_t i = 0; i < loader.num_eval_batches() && i < 4; ++i) loader.eval_batch(i, ids, targets, &images);
    });
    std::remove(path.c_str());
}

}  // namespace tessera::fuzz
