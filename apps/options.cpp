// Strict numeric options (see options.h).
#include "apps/options.h"

#include <charconv>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "core/check.h"
#include "core/json.h"
#include "model/hf_config.h"
#include "train/config.h"

namespace tessera::apps {

namespace {
template <class T>
bool parse_whole(const std::string& s, T& out) {
    const char* end = s.data() + s.size();
    auto r = std::from_chars(s.data(), end, out);
    return r.ec == std::errc() && r.ptr == end;
}

std::string shown(const std::string& s) { return "'" + excerpt(s, 40) + "'"; }
}  // namespace

std::pair<int64_t, int64_t> parse_step_range(const std::string& s, const std::string& name) {
    const size_t colon = s.find(':');
    int64_t a = 0, b = 0;
    if (colon == std::string::npos || !parse_whole(s.substr(0, colon), a) || !parse_whole(s.substr(colon + 1), b) ||
        a < 1 || b < a)
        throw CLI::ValidationError(name, fmt::format("{} is not a step range A:B with 1 <= A <= B", shown(s)));
    return {a, b};
}

CLI::Option* add_int_option(
    CLI::App* cmd, const std::string& name, int64_t& target, int64_t lo, int64_t hi, const std::string& description) {
    return cmd
        ->add_option_function<std::string>(
            name,
            [&target, name, lo, hi](const std::string& s) {
                int64_t v = 0;
                if (!parse_whole(s, v) || v < lo || v > hi) {
                    throw CLI::ValidationError(name, fmt::format("{} is not an integer in [{}, {}]", shown(s), lo, hi));
                }
                target = v;
            },
            description)
        ->default_str(std::to_string(target))
        ->type_name("INT");
}

CLI::Option* add_uint_option(CLI::App* cmd, const std::string& name, uint64_t& target, const std::string& description) {
    return cmd
        ->add_option_function<std::string>(
            name,
            [&target, name](const std::string& s) {
                uint64_t v = 0;
                if (!parse_whole(s, v)) {
                    throw CLI::ValidationError(name, fmt::format("{} is not an integer in [0, 2^64)", shown(s)));
                }
                target = v;
            },
            description)
        ->default_str(std::to_string(target))
        ->type_name("UINT");
}

CLI::Option* add_number_option(
    CLI::App* cmd, const std::string& name, double& target, double lo, double hi, const std::string& description) {
    return cmd
        ->add_option_function<std::string>(
            name,
            [&target, name, lo, hi](const std::string& s) {
                double v = 0;
                if (!parse_whole(s, v) || !std::isfinite(v) || v < lo || v > hi) {
                    throw CLI::ValidationError(name, fmt::format("{} is not a number in [{}, {}]", shown(s), lo, hi));
                }
                target = v;
            },
            description)
        ->default_str(fmt::format("{}", target))
        ->type_name("NUMBER");
}

CLI::Option* add_int_list_option(CLI::App* cmd,
                                 const std::string& name,
                                 std::vector<int64_t>& target,
                                 int64_t lo,
                                 int64_t hi,
                                 const std::string& description) {
    return cmd
        ->add_option_function<std::string>(
            name,
            [&target, name, lo, hi](const std::string& s) {
                target.clear();
                for (size_t at = 0; at <= s.size();) {
                    const size_t comma = std::min(s.find(',', at), s.size());
                    int64_t v = 0;
                    if (!parse_whole(s.substr(at, comma - at), v) || v < lo || v > hi)
                        throw CLI::ValidationError(
                            name, fmt::format("{} is not a list of integers in [{}, {}] separated by commas", shown(s),
                                              lo, hi));
                    target.push_back(v);
                    at = comma + 1;
                }
            },
            description)
        ->type_name("INT,...");
}

ModelDoc load_model_doc(const std::string& path) {
    ModelDoc d;
    d.file = std::filesystem::is_directory(path) ? (std::filesystem::path(path) / "config.json").string() : path;
    TESSERA_CHECK(std::filesystem::exists(d.file), "{}: no such file", d.file);
    d.run = train::load_config_json(d.file, {});
    if (model::is_hf_config(d.run)) {
        model::HfImport hf = model::import_hf_config(d.run, d.file);
        d.family = hf.family;
        d.run = Json{{"model", model::to_json(hf.model)}};
        d.unsupported = hf.unsupported;
    }
    return d;
}

}  // namespace tessera::apps
