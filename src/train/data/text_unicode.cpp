// PCRE2 patterns, UTF-8 checks and NFC for the tokenizers (text_unicode.h).
// PCRE2: https://www.pcre.org/current/doc/html/ (pcre2api, pcre2jit, pcre2pattern); utf8proc: utf8proc_map with
// UTF8PROC_STABLE | UTF8PROC_COMPOSE is NFC (https://juliastrings.github.io/utf8proc/doc/).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "train/data/text_unicode.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>

#include "core/check.h"
#include "core/json.h"

namespace tessera::train {

namespace {
// Unicode White_Space, which \s means in Oniguruma and Rust's regex: PCRE2's \s (with UCP) adds U+180E.
constexpr std::string_view kWhiteSpace =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
}  // namespace

std::string translate_pattern(std::string_view p, const std::string& where) {
    std::string out;
    out.reserve(p.size() + 64);
    bool in_class = false;
    for (size_t i = 0; i < p.size(); ++i) {
        const char c = p[i];
        if (c == '\\') {
            TESSERA_CHECK(i + 1 < p.size(), "{}: the pattern ends in a lone backslash", where);
            const char e = p[++i];
            if (e == 's') {
                out += in_class ? std::string(kWhiteSpace) : fmt::format("[{}]", kWhiteSpace);
            } else if (e == 'S') {
                TESSERA_CHECK(!in_class, "{}: \\S inside a character class is not supported", where);
                out += fmt::format("[^{}]", kWhiteSpace);
            } else {
                TESSERA_CHECK(e != 'Q' && e != 'E' && e != 'h' && e != 'H',
                              "{}: \\{} reads differently in PCRE2 than in the tokenizer's regex engine; not supported",
                              where, e);
                out += c;
                out += e;
            }
        } else if (c == '[' && !in_class) {
            in_class = true;
            out += c;
            if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
            if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is a literal
        } else if (c == '[' && in_class) {
            TESSERA_CHECK(i + 1 < p.size() && p[i + 1] == ':',
                          "{}: nested character classes (set operations) are not supported", where);
            const size_t end = p.find(":]", i + 2);
            TESSERA_CHECK(end != std::string_view::npos, "{}: an unterminated [: class", where);
            out += p.substr(i, end + 2 - i);
            i = end + 1;
        } else if (c == '&' && in_class && i + 1 < p.size() && p[i + 1] == '&') {
            TESSERA_FAIL("{}: character class intersection (&&) is not supported", where);
        } else {
            if (c == ']' && in_class) in_class = false;
            out += c;
        }
    }
    return out;
}

std::string regex_escape(std::string_view literal) {
    std::string out;
    for (char c : literal) {
        const auto u = static_cast<unsigned char>(c);
        const bool plain = u >= 0x80 || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        if (!plain) out += '\\';
        out += c;
    }
    return out;
}

struct Regex::Impl {
    pcre2_code* code = nullptr;
    pcre2_match_data* data = nullptr;
    pcre2_match_context* context = nullptr;
    pcre2_jit_stack* stack = nullptr;
    bool jit = false;
    std::string where;
    ~Impl() {
        pcre2_jit_stack_free(stack);
        pcre2_match_context_free(context);
        pcre2_match_data_free(data);
        pcre2_code_free(code);
    }
};

Regex::Regex(const std::string& pattern, const std::string& where) : impl_(std::make_unique<Impl>()) {
    impl_->where = where;
    int err = 0;
    PCRE2_SIZE offset = 0;
    impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                                &err, &offset, nullptr);
    if (!impl_->code) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(err, message, sizeof message);
        TESSERA_FAIL("{}: bad regex at offset {} ({}): {}", where, offset, reinterpret_cast<const char*>(message),
                     excerpt(pattern));
    }
    impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;  // the interpreter where JIT is missing
    impl_->data = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
    impl_->context = pcre2_match_context_create(nullptr);
    TESSERA_CHECK(impl_->data && impl_->context, "{}: out of memory compiling a regex", where);
    if (impl_->jit) {
        impl_->stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
        TESSERA_CHECK(impl_->stack, "{}: out of memory for the regex JIT stack", where);
        pcre2_jit_stack_assign(impl_->context, nullptr, impl_->stack);
    }
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

void Regex::for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t start = 0;
    while (start < text.size()) {
        // the text was checked to be UTF-8 once by the caller: no check per call
        const int rc = impl_->jit
                           ? pcre2_jit_match(impl_->code, subject, text.size(), start, 0, impl_->data, impl_->context)
                           : pcre2_match(impl_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, impl_->data,
                                         impl_->context);
        if (rc == PCRE2_ERROR_NOMATCH) return;
        if (rc < 0) {
            PCRE2_UCHAR message[256];
            pcre2_get_error_message(rc, message, sizeof message);
            TESSERA_FAIL("{}: regex matching failed at byte {}: {}", impl_->where, start,
                         reinterpret_cast<const char*>(message));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(impl_->data);
        if (ov[1] > ov[0]) {
            on_match(ov[0], ov[1]);
            start = ov[1];
        } else {  // an empty match: step over one character
            start = ov[0] + 1;
            while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
        }
    }
}

size_t invalid_utf8_at(std::string_view s) {
    const auto* b = reinterpret_cast<const unsigned char*>(s.data());
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
        const unsigned c = b[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        size_t len = 0;
        uint32_t cp = 0;
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2, cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3, cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4, cp = c & 0x07;
        } else {
            return i;
        }
        if (i + len > n) return i;
        for (size_t k = 1; k < len; ++k) {
            if ((b[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (b[i + k] & 0x3F);
        }
        const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
        if (overlong || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
        i += len;
    }
    return std::string_view::npos;
}

std::string nfc(std::string_view text) {
    bool ascii = true;
    for (char c : text) ascii &= static_cast<unsigned char>(c) < 0x80;
    if (ascii) return std::string(text);  // ASCII is its own NFC
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), utf8proc_ssize_t(text.size()), &out,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (n < 0) TESSERA_FAIL("NFC normalization failed: {}", utf8proc_errmsg(n));
    std::string s(reinterpret_cast<const char*>(out), size_t(n));
    std::free(out);
    return s;
}

}  // namespace tessera::train
