// Unicode text services for the tokenizers: regular expressions through PCRE2 (UTF + UCP, JIT when available),
// UTF-8 validation and NFC normalization through utf8proc.
//
// Patterns in tokenizer files are written for Oniguruma (Hugging Face tokenizers) or Rust's regex / fancy-regex
// (tiktoken). PCRE2 reads them the same way with one exception handled here: with UCP, PCRE2's \s also matches
// U+180E (MONGOLIAN VOWEL SEPARATOR, no longer White_Space since Unicode 6.3), which the others do not, so
// translate_pattern() spells \s and \S as the White_Space set. Constructs PCRE2 reads differently (class
// intersection "&&", \Q, \h) are refused by translate_pattern() rather than matched differently.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace tessera::train {

// `pattern` (Oniguruma / Rust syntax) in PCRE2 syntax; throws Error "<where>: ..." for a construct it cannot
// carry over.
std::string translate_pattern(std::string_view pattern, const std::string& where);

// A compiled PCRE2 pattern. Matching reuses per-object match data: one object serves one thread at a time.
class Regex {
  public:
    // pattern in PCRE2 syntax; where names it in errors ("tokenizer.json: pre_tokenizer Split")
    Regex(const std::string& pattern, const std::string& where);
    ~Regex();
    Regex(Regex&&) noexcept;
    Regex& operator=(Regex&&) noexcept;

    // Calls on_match(begin, end) for each successive non-overlapping, non-empty match in text (valid UTF-8),
    // leftmost first, the next search starting where the last match ended.
    void for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// A PCRE2 pattern matching `literal` exactly (every non-alphanumeric ASCII byte escaped).
std::string regex_escape(std::string_view literal);

// Byte offset of the first invalid UTF-8 sequence in text, or npos when it is all valid (overlong forms,
// surrogates and code points past U+10FFFF are invalid).
size_t invalid_utf8_at(std::string_view text);

// The NFC form of valid UTF-8 text (Unicode canonical composition, utf8proc).
std::string nfc(std::string_view text);

}  // namespace tessera::train
