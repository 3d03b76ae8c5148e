// Strict reading of JSON configs: every key is type-checked, defaults are explicit, and a key the
// reader does not know is an error naming it (with the nearest known key as a hint). Also the
// "--set section.key=value" overrides applied to a JSON document before it is read.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "core/json.h"

namespace tessera {

class ConfigReader {
  public:
    // obj: one section; where: "config.json: model" (prefix of every message)
    ConfigReader(const Json& obj, std::string where);

    double number(const std::string& key, double def);
    int64_t integer(const std::string& key, int64_t def);
    bool boolean(const std::string& key, bool def);
    std::string text(const std::string& key, const std::string& def);
    // a text value restricted to `choices`
    std::string choice(const std::string& key, const std::string& def, const std::set<std::string>& choices);
    // one choice (a string) or a list of them (an array of strings)
    std::vector<std::string> choice_list(const std::string& key,
                                         const std::string& def,
                                         const std::set<std::string>& choices);
    // a list of non-empty strings (empty if absent)
    std::vector<std::string> names(const std::string& key);
    bool has(const std::string& key) const { return obj_.contains(key); }
    // a value of a shape of its own, read by parse(value, "<where>: <section.key>") (def when absent)
    template <class T, class Parse>
    T parsed(const std::string& key, T def, Parse parse) {
        const Json* v = find(key);
        return v ? parse(*v, where_ + ": " + key_path(key)) : def;
    }
    const Json& section(const std::string& key);  // a nested object (empty if absent)

    // Throws if the section held keys nobody read.
    void finish() const;

  private:
    const Json* find(const std::string& key);
    std::string key_path(const std::string& key) const;
    const Json& obj_;
    std::string where_;
    std::set<std::string> known_;
};

// Applies "a.b=value" to doc (a JSON object): value is parsed as JSON (numbers, true/false, quoted strings,
// arrays; nested at most kMaxJsonDepth levels) and otherwise taken as a plain string (valid UTF-8); "a.b=null"
// removes the key (its default applies: how a derived run drops a key the base config sets). Missing sections
// are created; the strict reader later rejects any key or section it does not know.
void apply_override(Json& doc, const std::string& assignment);

// Edit distance, for "did you mean" hints.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace tessera
