// Byte-level tokenizer.
#include "train/data/tokenizer.h"

namespace tessera::train {

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
    out.reserve(out.size() + text.size());
    for (unsigned char c : text) out.push_back(int32_t(c));
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) {
    std::string s;
    s.reserve(ids.size());
    for (int32_t id : ids) {
        if (0 <= id && id < 256) {
            s.push_back(char(id));
        } else if (id == kEndOfText) {
            s += "<|endoftext|>";
        } else if (id == kPad) {
            s += "<|pad|>";
        } else {
            s += "<?>";
        }
    }
    return s;
}

}  // namespace tessera::train
