// Training examples from JSON Lines files (`tessera data`): each line one JSON object, either
//   {"text": "..."}                              a document: every token is a training target, or
//   {"prompt": "...", "completion": "..."}       supervised: the loss is on the completion only.
// A bad line is an Error "<file>:<line>: what is wrong", never skipped: not JSON, not an object, an unknown
// key, a value that is not a string, an empty text or completion, "text" together with "prompt", a prompt
// without a completion (or the reverse), an empty line.
#pragma once

#include <string>
#include <vector>

namespace tessera::train {

struct Example {
    std::string prompt;       // tokens that are never targets (empty for a document)
    std::string completion;   // the document's text, or the completion
    bool supervised = false;  // from {"prompt", "completion"}
};

std::vector<Example> read_jsonl(const std::string& path);

}  // namespace tessera::train
