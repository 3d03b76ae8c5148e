// Which blocks recompute their activations (see recompute.h).
#include "model/recompute.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/check.h"

namespace tessera::model {

namespace {
std::vector<std::string> sorted_unique(std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
}
}  // namespace

const std::vector<std::string>& Recompute::known_kinds() {
    static const std::vector<std::string> kinds = {"attention", "dsa", "gdn", "kda", "mla", "mlp", "moe"};
    return kinds;
}

Recompute Recompute::of(std::vector<std::string> kinds) {
    kinds = sorted_unique(std::move(kinds));
    if (kinds == known_kinds()) return every();
    return {.all = false, .kinds = std::move(kinds)};
}

Recompute Recompute::from_json(const Json& v, const std::string& where) {
    if (v.is_boolean()) return {.all = v.get<bool>()};
    const auto& known = known_kinds();
    TESSERA_CHECK(v.is_array() || v.is_string(), "{} must be true, false, a block kind or a list of them ({}), not {}",
                  where, fmt::join(known, ", "), json_excerpt(v));
    const Json list = v.is_string() ? Json::array({v}) : v;
    std::vector<std::string> kinds;
    for (size_t i = 0; i < list.size(); ++i) {
        const Json& e = list[i];
        TESSERA_CHECK(e.is_string() && std::find(known.begin(), known.end(), e.get<std::string>()) != known.end(),
                      "{}{} must be a block kind ({}), not {}", where, v.is_string() ? "" : fmt::format("[{}]", i),
                      fmt::join(known, ", "), json_excerpt(e));
        kinds.push_back(e.get<std::string>());
    }
    return of(std::move(kinds));
}

bool Recompute::covers(std::string_view kind) const {
    return all || std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

void Recompute::check(const std::vector<std::string>& block_kinds) const {
    for (const std::string& kind : kinds) {
        if (std::find(block_kinds.begin(), block_kinds.end(), kind) != block_kinds.end()) continue;
        TESSERA_FAIL("train.recompute names '{}' blocks, which the model does not have (its blocks: {})", kind,
                     fmt::join(sorted_unique(block_kinds), ", "));
    }
}

Json Recompute::to_json() const {
    if (all || kinds.empty()) return Json(all);
    Json a = Json::array();
    for (const std::string& k : kinds) a.push_back(k);
    return a;
}

std::string Recompute::str() const {
    return all ? "all" : kinds.empty() ? "off" : fmt::format("{}", fmt::join(kinds, "+"));
}

}  // namespace tessera::model
