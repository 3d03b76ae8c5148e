// JSON Lines examples (jsonl.h).
#include "train/data/jsonl.h"

#include "core/check.h"
#include "core/file.h"
#include "core/json.h"

namespace tessera::train {

namespace {
Example parse_example(std::string_view line, const std::string& where) {
    TESSERA_CHECK(line.find_first_not_of(" \t") != std::string_view::npos,
                  "{}: an empty line (every line must be one JSON object)", where);
    const Json j = parse_json(line, where);
    TESSERA_CHECK(j.is_object(), "{}: expected an object with \"text\", or \"prompt\" and \"completion\"; not {}",
                  where, json_excerpt(j));
    for (auto& [key, value] : j.items()) {
        TESSERA_CHECK(key == "text" || key == "prompt" || key == "completion",
                      "{}: unknown key \"{}\" (expected \"text\", or \"prompt\" and \"completion\")", where,
                      excerpt(key));
        TESSERA_CHECK(value.is_string(), "{}: \"{}\" must be a string, not {}", where, key, json_excerpt(value));
    }
    Example e;
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
    for_each_line(text, [&](std::string_view line, size_t number) {
        examples.push_back(parse_example(line, fmt::format("{}:{}", path, number)));
    });
    TESSERA_CHECK(!examples.empty(), "{}: no examples (the file is empty)", path);
    return examples;
}

}  // namespace tessera::train
