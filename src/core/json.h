// JSON text from files, headers and the command line, read safely: nesting is bounded before parsing (copying
// or printing a value recurses once per level, so a few hundred thousand levels would overflow the stack), a
// parse error names where the text came from and what is wrong without nlohmann's exception prefix, and values
// echoed in messages are cut to a short excerpt (an input can be megabytes long).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace tessera {

using Json = nlohmann::ordered_json;

// Far deeper than any config, header or index needs (they nest 2 to 5 levels).
constexpr int kMaxJsonDepth = 64;

// Throws Error "<where>: JSON nested deeper than 64 levels" when the arrays and objects of `text` (outside
// strings) nest deeper than max_depth. Linear in the text; does not validate anything else.
void check_json_depth(std::string_view text, const std::string& where, int max_depth = kMaxJsonDepth);

// The reason of a nlohmann exception without its "[json.exception.parse_error.101] " prefix, cut to a line.
std::string json_error_text(const std::exception& e);

// Parses text (depth-checked); throws Error "<where>: not valid JSON: <reason>" on any fault.
Json parse_json(std::string_view text, const std::string& where);
nlohmann::json parse_json_unordered(std::string_view text, const std::string& where);

// At most max_chars of s, with "… (N more bytes)" when cut; control characters shown escaped, so a message
// stays one line.
std::string excerpt(std::string_view s, size_t max_chars = 80);
// A value as compact JSON for a message (invalid UTF-8 replaced, never throws), cut by excerpt().
std::string json_excerpt(const Json& v, size_t max_chars = 80);
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 80);

}  // namespace tessera
