// Reading Hugging Face tokenizer files (hf_tokenizer.h).
#include "train/data/hf_tokenizer.h"

#include <charconv>
#include <filesystem>
#include <unordered_set>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"

namespace tessera::train {

namespace fs = std::filesystem;

const std::string_view kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {
// Unordered (std::map) objects: tessera's ordered Json finds keys by a linear scan, quadratic over a vocabulary of
// 150k entries.
using Json = nlohmann::json;

constexpr size_t kMaxTokenizerBytes = size_t(1) << 30;  // real tokenizer files are 2-20 MB

// The raw bytes a byte-level string (tokenizer.json's vocab) stands for, or nullopt when a character is outside
// the alphabet (an added token's text such as "<｜begin▁of▁sentence｜>").
std::optional<std::string> byte_level_bytes(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
        const auto c = static_cast<unsigned char>(s[i]);
        const size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        char32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
        for (size_t k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (s[i + k] & 0x3F);
        const int b = byte_level_byte(cp);
        if (b < 0) return std::nullopt;
        out += char(b);
        i += len;
    }
    return out;
}

const Json& member(const Json& j, const char* key, const std::string& where) {
    auto it = j.find(key);
    TESSERA_CHECK(it != j.end(), "{}: missing \"{}\"", where, key);
    return *it;
}

std::string type_of(const Json& j, const std::string& where) {
    TESSERA_CHECK(j.is_object(), "{}: must be an object, not {}", where, json_excerpt(j));
    const Json& t = member(j, "type", where);
    TESSERA_CHECK(t.is_string(), "{}.type must be a string", where);
    return t.get<std::string>();
}

bool flag(const Json& j, const char* key, bool fallback, const std::string& where) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    TESSERA_CHECK(it->is_boolean(), "{}.{} must be true or false, not {}", where, key, json_excerpt(*it));
    return it->get<bool>();
}

int32_t token_id_value(const Json& v, const std::string& where) {
    TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t(1) << 31),
                  "{}: a token id must be an integer in [0, 2^31), not {}", where, json_excerpt(v));
    return int32_t(v.get<int64_t>());
}

void set_token(BpeSpec& spec, int32_t id, std::string bytes, bool mergeable) {
    if (size_t(id) >= spec.tokens.size()) {
        spec.tokens.resize(size_t(id) + 1);
        spec.mergeable.resize(size_t(id) + 1, false);
    }
    spec.tokens[size_t(id)] = std::move(bytes);
    spec.mergeable[size_t(id)] = mergeable;
}

void read_normalizer(const Json& n, BpeSpec& spec, const std::string& where) {
    if (n.is_null()) return;
    const std::string type = type_of(n, where);
    if (type == "NFC") {
        spec.nfc = true;
    } else if (type == "Sequence") {
        const Json& list = member(n, "normalizers", where);
        TESSERA_CHECK(list.is_array(), "{}.normalizers must be an array", where);
        for (size_t i = 0; i < list.size(); ++i)
            read_normalizer(list[i], spec, fmt::format("{}.normalizers[{}]", where, i));
    } else {
        TESSERA_FAIL("{}: normalizer {} is not supported (supported: none, NFC)", where, type);
    }
}

// Flattens the pre-tokenizer into spec.splits; returns whether a ByteLevel step was seen (it must be the last).
void read_pre_tokenizer(const Json& p, BpeSpec& spec, bool& byte_level, const std::string& where) {
    TESSERA_CHECK(!p.is_null(),
                  "{}: there is no pre_tokenizer; only byte-level BPE (a ByteLevel pre-tokenizer) is "
                  "supported",
                  where);
    const std::string type = type_of(p, where);
    TESSERA_CHECK(!byte_level, "{}: {} after ByteLevel is not supported (ByteLevel must be the last step)", where,
                  type);
    if (type == "Sequence") {
        const Json& list = member(p, "pretokenizers", where);
        TESSERA_CHECK(list.is_array(), "{}.pretokenizers must be an array", where);
        for (size_t i = 0; i < list.size(); ++i) {
            read_pre_tokenizer(list[i], spec, byte_level, fmt::format("{}.pretokenizers[{}]", where, i));
        }
    } else if (type == "Split") {
        const Json& pattern = member(p, "pattern", where);
        const Json& behavior = member(p, "behavior", where);
        TESSERA_CHECK(behavior == "Isolated", "{}: Split behavior {} is not supported (only Isolated)", where,
                      json_excerpt(behavior));
        TESSERA_CHECK(!flag(p, "invert", false, where), "{}: Split with invert true is not supported", where);
        if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
            spec.splits.push_back(translate_pattern(pattern["Regex"].get<std::string>(), where));
        } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
            spec.splits.push_back(regex_escape(pattern["String"].get<std::string>()));
        } else {
            TESSERA_FAIL("{}.pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}, not {}", where,
                         json_excerpt(pattern));
        }
    } else if (type == "Digits") {
        spec.splits.push_back(flag(p, "individual_digits", false, where) ? R"(\p{N})" : R"(\p{N}+)");
    } else if (type == "ByteLevel") {
        TESSERA_CHECK(!flag(p, "add_prefix_space", true, where),
                      "{}: ByteLevel with add_prefix_space true is not supported", where);
        if (flag(p, "use_regex", true, where)) spec.splits.push_back(translate_pattern(kGpt2Pattern, where));
        byte_level = true;
    } else {
        TESSERA_FAIL("{}: pre-tokenizer {} is not supported (supported: Sequence, Split, Digits, ByteLevel)", where,
                     type);
    }
}

// Returns the vocabulary (token text -> id).
std::unordered_map<std::string, int32_t> read_model(const Json& m, BpeSpec& spec, const std::string& where) {
    TESSERA_CHECK(m.is_object(), "{}: must be an object", where);
    if (m.contains("type")) {
        TESSERA_CHECK(m["type"] == "BPE", "{}: model type {} is not supported (only BPE)", where,
                      json_excerpt(m["type"]));
    }
    if (auto it = m.find("dropout"); it != m.end() && !it->is_null()) {
        TESSERA_CHECK(it->is_number() && it->get<double>() == 0.0, "{}: BPE dropout {} is not supported", where,
                      json_excerpt(*it));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
        auto it = m.find(key);
        TESSERA_CHECK(it == m.end() || it->is_null() || *it == "", "{}: {} {} is not supported", where, key,
                      json_excerpt(*it));
    }
    spec.whole_words = flag(m, "ignore_merges", false, where);
    const Json& vocab = member(m, "vocab", where);
    TESSERA_CHECK(vocab.is_object(), "{}.vocab must be an object of token -> id", where);
    std::unordered_map<std::string, int32_t> ids;
    for (auto& [text, v] : vocab.items()) {
        const int32_t id = token_id_value(v, fmt::format("{}.vocab[{}]", where, excerpt(text)));
        TESSERA_CHECK(size_t(id) >= spec.tokens.size() || spec.tokens[size_t(id)].empty(),
                      "{}.vocab: id {} is given to two tokens", where, id);
        std::optional<std::string> bytes = byte_level_bytes(text);
        set_token(spec, id, bytes ? *bytes : text, bytes.has_value());
        ids.emplace(text, id);
    }
    const Json& merges = member(m, "merges", where);
    TESSERA_CHECK(merges.is_array(), "{}.merges must be an array", where);
    spec.merges.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
        const Json& e = merges[r];
        std::string a, b;
        if (e.is_string()) {  // the older form: "left right"
            const std::string s = e.get<std::string>();
            const size_t space = s.find(' ');
            TESSERA_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                          "{}.merges[{}]: \"{}\" is not two tokens separated by one space", where, r, excerpt(s));
            a = s.substr(0, space), b = s.substr(space + 1);
        } else {
            TESSERA_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
                          "{}.merges[{}] must be \"a b\" or [\"a\", \"b\"], not {}", where, r, json_excerpt(e));
            a = e[0].get<std::string>(), b = e[1].get<std::string>();
        }
        auto ia = ids.find(a), ib = ids.find(b);
        TESSERA_CHECK(ia != ids.end() && ib != ids.end(), "{}.merges[{}]: \"{}\" is not in the vocabulary", where, r,
                      excerpt(ia == ids.end() ? a : b));
        TESSERA_CHECK(spec.mergeable[size_t(ia->second)] && spec.mergeable[size_t(ib->second)],
                      "{}.merges[{}]: a token outside the byte-level alphabet", where, r);
        spec.merges.emplace_back(ia->second, ib->second);
    }
    return ids;
}

// bos_token / eos_token: a string, {"content": ...} (an AddedToken), or null.
std::optional<std::string> config_token(const Json& cfg, const char* key, const std::string& where) {
    auto it = cfg.find(key);
    if (it == cfg.end() || it->is_null()) return std::nullopt;
    if (it->is_string()) return it->get<std::string>();
    if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
        return (*it)["content"].get<std::string>();
    TESSERA_FAIL("{}: {} must be a string or {{\"content\": ...}}, not {}", where, key, json_excerpt(*it));
}

std::string base64_decode(std::string_view s, const std::string& where) {
    auto value = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        return c == '+' ? 62 : c == '/' ? 63 : -1;
    };
    TESSERA_CHECK(!s.empty() && s.size() % 4 == 0, "{}: \"{}\" is not base64", where, excerpt(s));
    std::string out;
    for (size_t i = 0; i < s.size(); i += 4) {
        uint32_t acc = 0;
        int pad = 0;
        for (size_t k = 0; k < 4; ++k) {
            const char c = s[i + k];
            const bool tail_pad = c == '=' && i + 4 == s.size() && k >= 2 && (k == 3 || s[i + 3] == '=');
            const int v = tail_pad ? 0 : value(c);
            TESSERA_CHECK(v >= 0, "{}: \"{}\" is not base64", where, excerpt(s));
            pad += tail_pad;
            acc = acc << 6 | uint32_t(v);
        }
        out += char(acc >> 16);
        if (pad < 2) out += char(acc >> 8 & 0xFF);
        if (pad < 1) out += char(acc & 0xFF);
    }
    return out;
}

Json read_json_file(const std::string& path) { return parse_json_unordered(read_text(path, kMaxTokenizerBytes), path); }
}  // namespace

BpeSpec read_tokenizer_json(const std::string& path) {
    const Json j = read_json_file(path);
    TESSERA_CHECK(j.is_object(), "{}: not a tokenizer.json (the top level is not an object)", path);
    BpeSpec spec;
    spec.name = path;
    const std::unordered_map<std::string, int32_t> vocab = read_model(member(j, "model", path), spec, path + ": model");
    read_normalizer(j.value("normalizer", Json()), spec, path + ": normalizer");
    bool byte_level = false;
    read_pre_tokenizer(j.value("pre_tokenizer", Json()), spec, byte_level, path + ": pre_tokenizer");
    TESSERA_CHECK(byte_level, "{}: the pre_tokenizer has no ByteLevel step; only byte-level BPE is supported", path);
    if (auto d = j.find("decoder"); d != j.end() && !d->is_null()) {
        const std::string type = type_of(*d, path + ": decoder");
        TESSERA_CHECK(type == "ByteLevel", "{}: decoder {} is not supported (only ByteLevel)", path, type);
    }
    if (auto added = j.find("added_tokens"); added != j.end() && !added->is_null()) {
        TESSERA_CHECK(added->is_array(), "{}: added_tokens must be an array", path);
        int64_t next_id = int64_t(vocab.size());
        std::unordered_set<std::string> added_texts;
        for (size_t i = 0; i < added->size(); ++i) {
            const Json& t = (*added)[i];
            const std::string where = fmt::format("{}: added_tokens[{}]", path, i);
            TESSERA_CHECK(t.is_object() && t.contains("content") && t["content"].is_string(),
                          "{}: must be an object with a string \"content\"", where);
            const int32_t id = token_id_value(member(t, "id", where), where);
            const std::string content = t["content"].get<std::string>();
            for (const char* key : {"lstrip", "rstrip", "single_word"}) {
                TESSERA_CHECK(!flag(t, key, false, where), "{}: {} with {} true is not supported", where,
                              excerpt(content), key);
            }
            // The tokenizers library does not read the ids: an added token in the vocabulary takes its id there, the
            // others the ids after the vocabulary in file order. A file that says otherwise is refused.
            auto v = vocab.find(content);
            const int64_t library_id = v != vocab.end() ? v->second : next_id;
            TESSERA_CHECK(id == library_id,
                          "{}: {} has id {}, but the tokenizers library gives it {} (added tokens outside the "
                          "vocabulary take the ids after it, in file order)",
                          where, excerpt(content), id, library_id);
            TESSERA_CHECK(added_texts.insert(content).second, "{}: {} is added twice", where, excerpt(content));
            if (v == vocab.end()) ++next_id;
            // a vocabulary entry keeps the bytes BPE gives it; otherwise the token is its text
            if (v == vocab.end() || !spec.mergeable[size_t(id)]) set_token(spec, id, content, false);
            spec.specials.emplace_back(content, id);
        }
    }
    return spec;
}

BpeSpec read_tiktoken(const std::string& model_path, const std::string& config_path) {
    BpeSpec spec;
    spec.name = model_path;
    spec.ranks_are_ids = true;
    spec.whole_words = true;
    spec.splits.push_back(translate_pattern(kKimiPattern, model_path + ": Kimi's pattern"));
    const std::string text = read_text(model_path, kMaxTokenizerBytes);
    std::unordered_map<std::string, int64_t> seen;
    for_each_line(text, [&](std::string_view line, size_t number) {
        if (line.empty()) return;  // as tiktoken's load_tiktoken_bpe
        const std::string where = fmt::format("{}:{}", model_path, number);
        const size_t space = line.find(' ');
        TESSERA_CHECK(space != std::string_view::npos, "{}: expected \"base64 rank\", not \"{}\"", where,
                      excerpt(line));
        std::string bytes = base64_decode(line.substr(0, space), where);
        const std::string_view r = line.substr(space + 1);
        int64_t rank = -1;
        auto res = std::from_chars(r.data(), r.data() + r.size(), rank);
        TESSERA_CHECK(res.ec == std::errc() && res.ptr == r.data() + r.size() && rank >= 0 && rank < (int64_t(1) << 31),
                      "{}: bad rank \"{}\"", where, excerpt(r));
        TESSERA_CHECK(size_t(rank) >= spec.tokens.size() || spec.tokens[size_t(rank)].empty(),
                      "{}: rank {} is given twice", where, rank);
        auto [it, fresh] = seen.emplace(bytes, rank);
        TESSERA_CHECK(fresh, "{}: the same bytes as the token of rank {}", where, it->second);
        set_token(spec, int32_t(rank), std::move(bytes), true);
    });
    const size_t n = seen.size();
    TESSERA_CHECK(n > 0, "{}: no tokens", model_path);
    TESSERA_CHECK(spec.tokens.size() == n, "{}: the ranks are not 0..{} (rank {} is the largest)", model_path, n - 1,
                  spec.tokens.size() - 1);

    const Json cfg = read_json_file(config_path);
    TESSERA_CHECK(cfg.is_object(), "{}: the top level is not an object", config_path);
    std::unordered_map<int64_t, std::string> named;
    if (auto d = cfg.find("added_tokens_decoder"); d != cfg.end()) {
        TESSERA_CHECK(d->is_object(), "{}: added_tokens_decoder must be an object of id -> token", config_path);
        for (auto& [key, t] : d->items()) {
            const std::string where = fmt::format("{}: added_tokens_decoder[{}]", config_path, key);
            int64_t id = -1;
            auto res = std::from_chars(key.data(), key.data() + key.size(), id);
            TESSERA_CHECK(res.ec == std::errc() && res.ptr == key.data() + key.size(), "{}: the key is not an id",
                          where);
            TESSERA_CHECK(id >= int64_t(n) && id < int64_t(n) + 258,
                          "{}: Kimi's special tokens take the ids {}..{} after the {} ranks", where, n, n + 257, n);
            TESSERA_CHECK(t.is_object() && t.contains("content") && t["content"].is_string(),
                          "{}: must be an object with a string \"content\"", where);
            named.emplace(id, t["content"].get<std::string>());
        }
    }
    // tokenization_kimi.py: num_reserved_special_tokens = 256, ids len(ranks) .. len(ranks) + 256 + 2
    for (size_t id = n; id < n + 258; ++id) {
        auto it = named.find(int64_t(id));
        std::string name = it != named.end() ? it->second : fmt::format("<|reserved_token_{}|>", id);
        set_token(spec, int32_t(id), name, false);
        spec.specials.emplace_back(std::move(name), int32_t(id));
    }
    return spec;
}

HfTokenizer load_hf_tokenizer(const std::string& dir) {
    std::error_code ec;
    TESSERA_CHECK(fs::is_directory(dir, ec),
                  "{}: not a directory (a Hugging Face checkpoint directory with "
                  "tokenizer.json or tiktoken.model)",
                  dir);
    const std::string json = (fs::path(dir) / "tokenizer.json").string();
    const std::string tiktoken = (fs::path(dir) / "tiktoken.model").string();
    const std::string config = (fs::path(dir) / "tokenizer_config.json").string();
    const bool has_config = fs::exists(config, ec);
    std::string source;
    std::optional<BpeTokenizer> bpe;
    if (fs::exists(json, ec)) {
        bpe.emplace(read_tokenizer_json(json));
        source = json;
    } else if (fs::exists(tiktoken, ec)) {
        TESSERA_CHECK(has_config, "{}: tiktoken.model needs tokenizer_config.json beside it (its special tokens)", dir);
        bpe.emplace(read_tiktoken(tiktoken, config));
        source = tiktoken;
    } else {
        TESSERA_FAIL("{}: holds neither tokenizer.json nor tiktoken.model", dir);
    }
    HfTokenizer t{std::move(*bpe), source, std::nullopt, std::nullopt, false};
    if (!has_config) return t;
    const Json cfg = read_json_file(config);
    TESSERA_CHECK(cfg.is_object(), "{}: the top level is not an object", config);
    auto id_of = [&](const char* key) -> std::optional<int32_t> {
        const std::optional<std::string> name = config_token(cfg, key, config);
        if (!name) return std::nullopt;
        const std::optional<int32_t> id = t.bpe.token_id(*name);
        TESSERA_CHECK(id.has_value(), "{}: {} \"{}\" is not a token of {}", config, key, excerpt(*name), source);
        return id;
    };
    t.bos = id_of("bos_token");
    t.eos = id_of("eos_token");
    t.add_bos = flag(cfg, "add_bos_token", false, config);
    TESSERA_CHECK(!t.add_bos || t.bos.has_value(), "{}: add_bos_token is true but there is no bos_token", config);
    return t;
}

}  // namespace tessera::train
