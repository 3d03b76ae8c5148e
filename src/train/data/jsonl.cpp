// JSON Lines examples (jsonl.h).
#include "train/data/jsonl.h"

#include <filesystem>

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"

namespace tessera::train {

namespace {
Example parse_example(std::string_view line, const std::string& where, const std::filesystem::path& dir) {
    TESSERA_CHECK(line.find_first_not_of(" \t") != std::string_view::npos,
                  "{}: an empty line (every line must be one JSON object)", where);
    const Json j = parse_json(line, where);
    TESSERA_CHECK(j.is_object(), "{}: expected an object with \"text\", or \"prompt\" and \"completion\"; not {}",
                  where, json_excerpt(j));
    Example e;
    for (auto& [key, value] : j.items()) {
        TESSERA_CHECK(key == "text" || key == "prompt" || key == "completion" || key == "images",
                      "{}: unknown key \"{}\" (expected \"text\", or \"prompt\" and \"completion\"; and \"images\")",
                      where, excerpt(key));
        if (key == "images") {
            TESSERA_CHECK(value.is_array() && !value.empty(),
                          "{}: \"images\" must be a non-empty array of image file paths, not {}", where,
                          json_excerpt(value));
            for (const Json& f : value) {
                TESSERA_CHECK(f.is_string() && !f.get<std::string>().empty(),
                              "{}: \"images\" must hold image file paths, not {}", where, json_excerpt(f));
                e.images.push_back((dir / f.get<std::string>()).string());
            }
            continue;
        }
        TESSERA_CHECK(value.is_string(), "{}: \"{}\" must be a string, not {}", where, key, json_excerpt(value));
    }
    if (j.contains("text")) {
        TESSERA_CHECK(!j.contains("prompt") && !j.contains("completion"),
                      "{}: \"text\" together with \"prompt\" or \"completion\" (a line is one or the other)", where);
        e.completion = j["text"].get<std::string>();
        TESSERA_CHECK(!e.completion.empty(), "{}: \"text\" is empty", where);
        return e;
    }
    TESSERA_CHECK(j.contains("prompt") && j.contains("completion"), "{}: \"{}\" without \"{}\"", where,
                  j.contains("prompt") ? "prompt" : "completion", j.contains("prompt") ? "completion" : "prompt");
    e.prompt = j["prompt"].get<std::string>();
    e.completion = j["completion"].get<std::string>();
    e.supervised = true;
    TESSERA_CHECK(!e.completion.empty(), "{}: \"completion\" is empty", where);
    return e;
}
}  // namespace

std::vector<Example> read_jsonl(const std::string& path) {
    const std::string text = read_text(path);
    std::vector<Example> examples;
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    for_each_line(text, [&](std::string_view line, size_t number) {
        examples.push_back(parse_example(line, fmt::format("{}:{}", path, number), dir));
    });
    TESSERA_CHECK(!examples.empty(), "{}: no examples (the file is empty)", path);
    return examples;
}

}  // namespace tessera::train
