// Depth-checked JSON parsing and short excerpts for messages.
#include "core/json.h"

#include "core/check.h"

namespace tessera {

void check_json_depth(std::string_view text, const std::string& where, int max_depth) {
    int depth = 0;
    bool in_string = false, escaped = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (escaped) {
                escaped = false;
            } else if (c == '\\') {
                escaped = true;
            } else if (c == '"') {
                in_string = false;
            }
            continue;
        }
        if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            TESSERA_CHECK(++depth <= max_depth, "{}: JSON nested deeper than {} levels (at byte {})", where, max_depth,
                          i);
        } else if ((c == ']' || c == '}') && depth > 0) {
            --depth;
        }
    }
}

std::string json_error_text(const std::exception& e) {
    std::string_view s = e.what();
    if (s.starts_with("[json.exception.")) {
        const size_t close = s.find("] ");
        if (close != std::string_view::npos) s.remove_prefix(close + 2);
    }
    return excerpt(s, 200);
}

namespace {
template <class J>
J parse_checked(std::string_view text, const std::string& where) {
    check_json_depth(text, where);
    try {
        return J::parse(text);
    } catch (const nlohmann::json::exception& e) {
        TESSERA_FAIL("{}: not valid JSON: {}", where, json_error_text(e));
    }
}

template <class J>
std::string excerpt_of(const J& v, size_t max_chars) {
    // NOTES: replace, not strict: a string from --set or a file may hold invalid UTF-8, and dump() would throw.
    return excerpt(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max_chars);
}
}  // namespace

Json parse_json(std::string_view text, const std::string& where) { return parse_checked<Json>(text, where); }

nlohmann::json parse_json_unordered(std::string_view text, const std::string& where) {
    return parse_checked<nlohmann::json>(text, where);
}

std::string excerpt(std::string_view s, size_t max_chars) {
    std::string out;
    size_t n = std::min(s.size(), max_chars);
    while (n < s.size() && n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // whole UTF-8 characters
    for (size_t i = 0; i < n; ++i) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c < 0x20 || c == 0x7f) {
            out += fmt::format("\\x{:02x}", c);
        } else {
            out += char(c);
        }
    }
    if (s.size() > n) out += fmt::format("… ({} more bytes)", s.size() - n);
    return out;
}

std::string json_excerpt(const Json& v, size_t max_chars) { return excerpt_of(v, max_chars); }
std::string json_excerpt(const nlohmann::json& v, size_t max_chars) { return excerpt_of(v, max_chars); }

}  // namespace tessera
