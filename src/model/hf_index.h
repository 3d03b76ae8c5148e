// The index of a sharded Hugging Face checkpoint (model.safetensors.index.json): which shard file holds each
// tensor. Kept apart from the loader so the parser can be fuzzed on its own (tests/fuzz/).
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace tessera::model {

// tensor name -> shard file, relative to the checkpoint directory. Throws Error naming `where` when the text is
// not JSON, has no "weight_map" object, or maps a tensor to anything but a relative path inside the directory
// (no "..", not absolute).
std::map<std::string, std::string> parse_hf_index(std::string_view text, const std::string& where);

}  // namespace tessera::model
