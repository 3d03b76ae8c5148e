// Training examples from JSON Lines files (`tessera data`): each line one JSON object, either
//   {"text": "..."}                              a document: every token is a training target, or
//   {"prompt": "...", "completion": "..."}       supervised: the loss is on the completion only,
// either with "images": ["a.safetensors", ...]: image files as Kimi's processor writes them (pixel_values and
// image_grid_hws; a path relative to the JSONL file's directory), one for each image token in the text, in order
// (a model with an image tower; token_source.h).
// A bad line is an Error "<file>:<line>: what is wrong", never skipped: not JSON, not an object, an unknown
// key, a value that is not a string (images: not a non-empty array of strings), an empty text or completion, "text"
// together with "prompt", a prompt without a completion (or the reverse), an empty line.
#pragma once

#include <string>
#include <vector>

namespace tessera::train {

struct Example {
    std::string prompt;               // tokens that are never targets (empty for a document)
    std::string completion;           // the document's text, or the completion
    bool supervised = false;          // from {"prompt", "completion"}
    std::vector<std::string> images;  // image files (paths as read from the JSONL file's directory)
};

std::vector<Example> read_jsonl(const std::string& path);

}  // namespace tessera::train
