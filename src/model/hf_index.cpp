// Parsing model.safetensors.index.json.
#include "model/hf_index.h"

#include <filesystem>

#include "core/check.h"
#include "core/json.h"

namespace tessera::model {

std::map<std::string, std::string> parse_hf_index(std::string_view text, const std::string& where) {
    const Json index = parse_json(text, where);
    TESSERA_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                  "{}: no \"weight_map\" object", where);
    std::map<std::string, std::string> out;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
        const Json& v = it.value();
        TESSERA_CHECK(v.is_string(), "{}: weight_map[\"{}\"] must be a file name, not {}", where, excerpt(it.key()),
                      json_excerpt(v));
        const std::filesystem::path file(v.get<std::string>());
        bool inside = !file.empty() && file.is_relative();
        for (const auto& part : file) inside = inside && part != "..";
        TESSERA_CHECK(inside, "{}: weight_map[\"{}\"] = {} is not a file inside the checkpoint directory", where,
                      excerpt(it.key()), json_excerpt(v));
        out[it.key()] = file.string();
    }
    return out;
}

}  // namespace tessera::model
