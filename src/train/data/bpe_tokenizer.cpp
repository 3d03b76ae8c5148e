// Byte-level BPE encode/decode (bpe_tokenizer.h). The merge loop follows the rule both reference libraries apply
// (tokenizers' BPE word merge, tiktoken's byte_pair_merge): lowest rank first, leftmost among equals. It keeps a
// heap of candidate pairs, so a piece of n bytes costs O(n log n), not O(n²).
#include "train/data/bpe_tokenizer.h"

#include <algorithm>
#include <queue>

#include "core/check.h"
#include "core/json.h"

namespace tessera::train {

namespace {
// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards.
bool byte_is_printable(unsigned b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

constexpr size_t kCacheEntries = size_t(1) << 18;  // pieces remembered before the cache starts over
}  // namespace

namespace {
struct ByteLevelTables {
    char32_t to_char[256];
    int16_t to_byte[0x144];  // the alphabet ends at U+0143
    ByteLevelTables() {
        std::fill(std::begin(to_byte), std::end(to_byte), int16_t(-1));
        char32_t next = 0x100;
        for (unsigned b = 0; b < 256; ++b) {
            to_char[b] = byte_is_printable(b) ? char32_t(b) : next++;
            to_byte[to_char[b]] = int16_t(b);
        }
    }
};
const ByteLevelTables& byte_level() {
    static const ByteLevelTables t;
    return t;
}
}  // namespace

char32_t byte_level_char(uint8_t byte) { return byte_level().to_char[byte]; }

int byte_level_byte(char32_t c) { return c < 0x144 ? byte_level().to_byte[c] : -1; }

BpeTokenizer::BpeTokenizer(BpeSpec spec)
    : name_(std::move(spec.name)),
      tokens_(std::move(spec.tokens)),
      nfc_(spec.nfc),
      whole_words_(spec.whole_words),
      ranks_are_ids_(spec.ranks_are_ids) {
    TESSERA_CHECK(spec.mergeable.size() == tokens_.size(), "{}: internal: mergeable flags for {} of {} tokens", name_,
                  spec.mergeable.size(), tokens_.size());
    for (size_t id = 0; id < tokens_.size(); ++id) {
        if (spec.mergeable[id]) by_bytes_.emplace(tokens_[id], int32_t(id));
    }
    for (unsigned b = 0; b < 256; ++b) {
        auto it = by_bytes_.find(std::string(1, char(b)));
        TESSERA_CHECK(it != by_bytes_.end(), "{}: the vocabulary has no token for the byte 0x{:02X}", name_, b);
        byte_ids_[b] = it->second;
    }
    for (size_t r = 0; r < spec.merges.size(); ++r) {
        const auto [l, rr] = spec.merges[r];
        auto it = by_bytes_.find(tokens_[size_t(l)] + tokens_[size_t(rr)]);
        TESSERA_CHECK(it != by_bytes_.end(), "{}: merge {} ({} + {}) makes a token that is not in the vocabulary",
                      name_, r, excerpt(tokens_[size_t(l)]), excerpt(tokens_[size_t(rr)]));
        // a pair listed twice takes its last rank, as in the tokenizers library (its merge map is built in order)
        merges_.insert_or_assign(uint64_t(uint32_t(l)) << 32 | uint32_t(rr), Merge{int32_t(r), it->second});
    }
    std::vector<std::string> literals;
    for (auto& [text, id] : spec.specials) {
        TESSERA_CHECK(!text.empty(), "{}: special token {} is empty", name_, id);
        TESSERA_CHECK(invalid_utf8_at(text) == std::string_view::npos, "{}: special token {} is not UTF-8", name_, id);
        specials_.insert_or_assign(text, id);
        literals.push_back(text);
    }
    if (!literals.empty()) {
        // longest first: at one position the alternation takes the first that matches
        std::sort(literals.begin(), literals.end(), [](const std::string& a, const std::string& b) {
            return a.size() != b.size() ? a.size() > b.size() : a < b;
        });
        std::string alternation;
        for (auto& t : literals) {
            if (!alternation.empty()) alternation += '|';
            alternation += regex_escape(t);
        }
        special_regex_.emplace(alternation, name_ + ": special tokens");
    }
    for (size_t i = 0; i < spec.splits.size(); ++i) {
        splits_.emplace_back(spec.splits[i], fmt::format("{}: pre-tokenizer pattern {}", name_, i));
    }
}

std::optional<BpeTokenizer::Merge> BpeTokenizer::pair_merge(int32_t left, int32_t right) const {
    if (ranks_are_ids_) {
        scratch_.assign(tokens_[size_t(left)]);
        scratch_ += tokens_[size_t(right)];
        auto it = by_bytes_.find(scratch_);
        if (it == by_bytes_.end()) return std::nullopt;
        return Merge{it->second, it->second};
    }
    auto it = merges_.find(uint64_t(uint32_t(left)) << 32 | uint32_t(right));
    if (it == merges_.end()) return std::nullopt;
    return it->second;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) {
    std::string key(piece);
    if (auto it = cache_.find(key); it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
    }
    std::vector<int32_t> ids;
    auto whole = whole_words_ ? by_bytes_.find(key) : by_bytes_.end();
    if (whole != by_bytes_.end()) {
        ids.push_back(whole->second);
    } else {
        const int32_t n = int32_t(piece.size());
        const size_t len = piece.size();
        std::vector<int32_t> sym(len), prev(len), next(len);
        for (int32_t i = 0; i < n; ++i) {
            sym[size_t(i)] = byte_ids_[static_cast<unsigned char>(piece[size_t(i)])];
            prev[size_t(i)] = i - 1;
            next[size_t(i)] = i + 1 < n ? i + 1 : -1;
        }
        struct Candidate {
            int32_t rank, pos;
            bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
        };
        std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
        auto offer = [&](int32_t pos) {
            if (pos < 0 || next[size_t(pos)] < 0) return;
            if (auto m = pair_merge(sym[size_t(pos)], sym[size_t(next[size_t(pos)])])) heap.push({m->rank, pos});
        };
        for (int32_t i = 0; i + 1 < n; ++i) offer(i);
        while (!heap.empty()) {
            const Candidate c = heap.top();
            heap.pop();
            const int32_t j = next[size_t(c.pos)];
            if (sym[size_t(c.pos)] < 0 || j < 0) continue;  // merged away, or no right neighbour any more
            const auto m = pair_merge(sym[size_t(c.pos)], sym[size_t(j)]);
            if (!m || m->rank != c.rank) continue;  // the pair changed since it was offered
            sym[size_t(c.pos)] = m->id;
            sym[size_t(j)] = -1;
            next[size_t(c.pos)] = next[size_t(j)];
            if (next[size_t(j)] >= 0) prev[size_t(next[size_t(j)])] = c.pos;
            offer(prev[size_t(c.pos)]);
            offer(c.pos);
        }
        for (int32_t i = 0; i >= 0 && i < n; i = next[size_t(i)]) ids.push_back(sym[size_t(i)]);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::move(key), std::move(ids));
}

void BpeTokenizer::encode_ordinary(std::string_view raw, std::vector<int32_t>& out) {
    if (raw.empty()) return;
    std::string normalized;
    if (nfc_) normalized = nfc(raw);
    const std::string_view text = nfc_ ? std::string_view(normalized) : raw;
    // pieces as [begin, end) offsets into text, refined by each split pattern in turn
    std::vector<std::pair<size_t, size_t>> pieces{{0, text.size()}}, refined;
    for (const Regex& split : splits_) {
        refined.clear();
        for (const auto& piece : pieces) {  // (no structured binding: clang 14 cannot capture one)
            const size_t b = piece.first, e = piece.second;
            size_t last = b;
            split.for_each_match(text.substr(b, e - b), [&](size_t mb, size_t me) {
                if (b + mb > last) refined.emplace_back(last, b + mb);  // the text between matches is a piece too
                refined.emplace_back(b + mb, b + me);
                last = b + me;
            });
            if (e > last) refined.emplace_back(last, e);
        }
        pieces.swap(refined);
    }
    for (auto [b, e] : pieces) encode_piece(text.substr(b, e - b), out);
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
    const size_t bad = invalid_utf8_at(text);
    TESSERA_CHECK(bad == std::string_view::npos, "{}: the text is not valid UTF-8 (at byte {})", name_, bad);
    if (!special_regex_) return encode_ordinary(text, out);
    size_t last = 0;
    special_regex_->for_each_match(text, [&](size_t b, size_t e) {
        encode_ordinary(text.substr(last, b - last), out);
        out.push_back(specials_.at(std::string(text.substr(b, e - b))));
        last = e;
    });
    encode_ordinary(text.substr(last), out);
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
    std::string s;
    for (int32_t id : ids) {
        TESSERA_CHECK(id >= 0 && size_t(id) < tokens_.size() && !tokens_[size_t(id)].empty(),
                      "{}: token id {} is not in the vocabulary", name_, id);
        s += tokens_[size_t(id)];
    }
    return s;
}

std::optional<int32_t> BpeTokenizer::token_id(std::string_view text) const {
    const std::string key(text);
    if (auto it = specials_.find(key); it != specials_.end()) return it->second;
    if (auto it = by_bytes_.find(key); it != by_bytes_.end()) return it->second;
    return std::nullopt;
}

}  // namespace tessera::train
