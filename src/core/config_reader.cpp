// Strict config reading and --set overrides.
#include "core/config_reader.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"

namespace tessera {

ConfigReader::ConfigReader(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {
    TESSERA_CHECK(obj.is_object() || obj.is_null(), "{}: must be a JSON object", where_);
}

std::string ConfigReader::key_path(const std::string& key) const {
    auto colon = where_.rfind(": ");
    std::string section = colon == std::string::npos ? "" : where_.substr(colon + 2);
    return section.empty() ? key : section + "." + key;
}

const Json* ConfigReader::find(const std::string& key) {
    known_.insert(key);
    if (!obj_.is_object()) return nullptr;
    auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
}

double ConfigReader::number(const std::string& key, double def) {
    const Json* v = find(key);
    if (!v) return def;
    TESSERA_CHECK(v->is_number(), "{}: {} must be a number, not {}", where_, key_path(key), json_excerpt(*v));
    double x = v->get<double>();
    TESSERA_CHECK(std::isfinite(x), "{}: {} must be finite", where_, key_path(key));
    return x;
}

int64_t ConfigReader::integer(const std::string& key, int64_t def) {
    const Json* v = find(key);
    if (!v) return def;
    TESSERA_CHECK(v->is_number_integer() || (v->is_number_float() && v->get<double>() == std::floor(v->get<double>())),
                  "{}: {} must be an integer, not {}", where_, key_path(key), json_excerpt(*v));
    // NOTES: 2^63 and above (unsigned in the parser, or a float like 1e30) would wrap or be undefined as int64
    constexpr double kTwo63 = 9223372036854775808.0;
    const bool fits = v->is_number_unsigned() ? v->get<uint64_t>() <= uint64_t(INT64_MAX)
                      : v->is_number_float()  ? v->get<double>() >= -kTwo63 && v->get<double>() < kTwo63
                                              : true;
    TESSERA_CHECK(fits, "{}: {} = {} is out of range", where_, key_path(key), json_excerpt(*v));
    return v->is_number_float() ? int64_t(v->get<double>()) : v->get<int64_t>();
}

bool ConfigReader::boolean(const std::string& key, bool def) {
    const Json* v = find(key);
    if (!v) return def;
    TESSERA_CHECK(v->is_boolean(), "{}: {} must be true or false, not {}", where_, key_path(key), json_excerpt(*v));
    return v->get<bool>();
}

std::string ConfigReader::text(const std::string& key, const std::string& def) {
    const Json* v = find(key);
    if (!v) return def;
    TESSERA_CHECK(v->is_string(), "{}: {} must be a string, not {}", where_, key_path(key), json_excerpt(*v));
    return v->get<std::string>();
}

namespace {
void check_choice(const std::string& v, const std::set<std::string>& choices, const std::string& what) {
    if (choices.count(v)) return;
    std::string list;
    for (auto& c : choices) list += (list.empty() ? "" : ", ") + c;
    TESSERA_FAIL("{} = \"{}\" must be one of: {}", what, excerpt(v), list);
}
}  // namespace

std::string ConfigReader::choice(const std::string& key, const std::string& def, const std::set<std::string>& choices) {
    std::string v = text(key, def);
    check_choice(v, choices, where_ + ": " + key_path(key));
    return v;
}

std::vector<std::string> ConfigReader::choice_list(const std::string& key,
                                                   const std::string& def,
                                                   const std::set<std::string>& choices) {
    const Json* v = find(key);
    if (!v || v->is_string()) return {choice(key, def, choices)};
    TESSERA_CHECK(v->is_array() && !v->empty(), "{}: {} must be a string or a non-empty list of strings, not {}",
                  where_, key_path(key), json_excerpt(*v));
    std::vector<std::string> out;
    for (size_t i = 0; i < v->size(); ++i) {
        const Json& e = (*v)[i];
        const std::string what = fmt::format("{}: {}[{}]", where_, key_path(key), i);
        TESSERA_CHECK(e.is_string(), "{} must be a string, not {}", what, json_excerpt(e));
        check_choice(e.get<std::string>(), choices, what);
        out.push_back(e.get<std::string>());
    }
    return out;
}

std::vector<std::string> ConfigReader::names(const std::string& key) {
    const Json* v = find(key);
    if (!v) return {};
    TESSERA_CHECK(v->is_array(), "{}: {} must be a list of strings, not {}", where_, key_path(key), json_excerpt(*v));
    std::vector<std::string> out;
    for (size_t i = 0; i < v->size(); ++i) {
        const Json& e = (*v)[i];
        TESSERA_CHECK(e.is_string() && !e.get<std::string>().empty(), "{}: {}[{}] must be a non-empty string, not {}",
                      where_, key_path(key), i, json_excerpt(e));
        out.push_back(e.get<std::string>());
    }
    return out;
}

const Json& ConfigReader::section(const std::string& key) {
    static const Json kEmpty = Json::object();
    const Json* v = find(key);
    if (!v) return kEmpty;
    TESSERA_CHECK(v->is_object(), "{}: {} must be an object", where_, key_path(key));
    return *v;
}

void ConfigReader::finish() const {
    if (!obj_.is_object()) return;
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
        if (known_.count(it.key())) continue;
        std::string best;
        size_t best_d = 4;
        for (auto& k : known_) {
            if (it.key().size() > 64) break;  // no hint for a long key (the distance is quadratic)
            size_t d = edit_distance(it.key(), k);
            if (d < best_d) {
                best_d = d;
                best = k;
            }
        }
        TESSERA_FAIL("{}: unknown key \"{}\"{}", where_, excerpt(key_path(it.key())),
                     best.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", key_path(best)));
    }
}

namespace {
bool valid_utf8(std::string_view s) {
    // NOTES: a value nlohmann cannot dump would make every later message (and the saved config) throw
    try {
        (void)Json(s).dump();
        return true;
    } catch (const Json::exception&) {
        return false;
    }
}
}  // namespace

void apply_override(Json& doc, const std::string& assignment) {
    auto eq = assignment.find('=');
    TESSERA_CHECK(eq != std::string::npos && eq > 0, "--set {}: expected key=value", excerpt(assignment));
    const std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
    TESSERA_CHECK(valid_utf8(assignment), "--set {}: not valid UTF-8", excerpt(assignment));
    TESSERA_CHECK(doc.is_object(), "--set {}: the config is not a JSON object", excerpt(key));
    Json* node = &doc;
    size_t start = 0;
    while (true) {
        size_t dot = key.find('.', start);
        std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        TESSERA_CHECK(!part.empty(), "--set {}: empty key component", excerpt(assignment));
        if (dot == std::string::npos) {
            check_json_depth(value, "--set " + excerpt(key));
            Json parsed = Json::parse(value, nullptr, /*allow_exceptions=*/false);
            if (parsed.is_null()) {  // key=null removes the key: its default applies
                node->erase(part);
                return;
            }
            (*node)[part] = parsed.is_discarded() ? Json(value) : parsed;
            return;
        }
        if (!node->contains(part)) (*node)[part] = Json::object();
        node = &(*node)[part];
        TESSERA_CHECK(node->is_object(), "--set {}: {} is not a section", excerpt(assignment),
                      excerpt(key.substr(0, dot)));
        start = dot + 1;
    }
}

size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        cur[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
        }
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

}  // namespace tessera
