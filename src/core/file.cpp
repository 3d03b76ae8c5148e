// Memory maps, atomic writes and CRC-32C (Castagnoli; SSE4.2 instruction when present, table otherwise).
#include "core/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/check.h"

namespace tessera {

namespace {
std::string os_error() { return std::strerror(errno); }

struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};
}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    TESSERA_CHECK(f.fd >= 0, "{}: cannot open: {}", path, os_error());
    struct stat st {};
    TESSERA_CHECK(::fstat(f.fd, &st) == 0, "{}: cannot stat: {}", path, os_error());
    TESSERA_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", path);
    size_ = size_t(st.st_size);
    if (size_ > 0) {
        void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
        TESSERA_CHECK(p != MAP_FAILED, "{}: cannot map {} bytes: {}", path, size_, os_error());
        data_ = static_cast<const std::byte*>(p);
    }
}

size_t page_size() {
    static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    return page;
}

namespace {
// [first page, end of the last page) of a range
std::pair<uintptr_t, size_t> page_span(const void* p, size_t n) {
    const uintptr_t page = page_size(), lo = reinterpret_cast<uintptr_t>(p) / page * page;
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n + page - 1) / page * page;
    return {lo, size_t(hi - lo)};
}
}  // namespace

size_t resident_bytes(const void* p, size_t n, std::vector<uint64_t>& scratch) {
    if (n == 0) return 0;
    static const int pagemap = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);  // for the process's life
    TESSERA_CHECK(pagemap >= 0, "/proc/self/pagemap: {}", os_error());
    const auto [lo, len] = page_span(p, n);
    const size_t pages = len / page_size();
    if (scratch.size() < pages) scratch.resize(pages);
    const ssize_t got = ::pread(pagemap, scratch.data(), pages * sizeof(uint64_t), off_t(lo / page_size() * 8));
    TESSERA_CHECK(got == ssize_t(pages * sizeof(uint64_t)), "/proc/self/pagemap: {}", os_error());
    size_t resident = 0;
    for (size_t i = 0; i < pages; ++i) resident += scratch[i] >> 63;  // bit 63: present
    return resident * page_size();
}

void touch_pages(const void* p, size_t n) {
    if (n == 0) return;
    const auto [lo, len] = page_span(p, n);
    volatile unsigned char sink = 0;
    for (size_t at = 0; at < len; at += page_size()) sink = sink + *reinterpret_cast<const unsigned char*>(lo + at);
}

void release_pages(const void* p, size_t n) {
    if (n == 0) return;
    const auto [lo, len] = page_span(p, n);
    TESSERA_CHECK(::madvise(reinterpret_cast<void*>(lo), len, MADV_DONTNEED) == 0, "madvise: {}", os_error());
}

void prefetch_pages(const void* p, size_t n) {
    if (n == 0) return;
    const auto [lo, len] = page_span(p, n);
    ::madvise(reinterpret_cast<void*>(lo), len, MADV_WILLNEED);  // advice only: a refusal changes nothing
}

void drop_cached_pages(const std::string& path) {
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    TESSERA_CHECK(f.fd >= 0, "{}: {}", path, os_error());
    ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);  // advice only: a refusal leaves the pages cached
}

ScratchFile::ScratchFile(const std::string& dir, size_t bytes) : size_(bytes) {
    std::error_code ec;
    TESSERA_CHECK(std::filesystem::is_directory(dir, ec), "{}: not a directory (for a scratch file of {} bytes)", dir,
                  bytes);
    std::string path = (std::filesystem::path(dir) / "tessera-scratch-XXXXXX").string();
    Fd f{::mkostemp(path.data(), O_CLOEXEC)};
    TESSERA_CHECK(f.fd >= 0, "{}: cannot make a scratch file: {}", dir, os_error());
    ::unlink(path.c_str());  // nothing is left on disk, however the process ends
    if (bytes == 0) return;
    const int err = ::posix_fallocate(f.fd, 0, off_t(bytes));
    TESSERA_CHECK(err == 0, "{}: cannot reserve {:.1f} MiB for a scratch file: {}", dir, double(bytes) / (1 << 20),
                  std::strerror(err));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
    TESSERA_CHECK(p != MAP_FAILED, "{}: cannot map a scratch file of {} bytes: {}", dir, bytes, os_error());
    data_ = static_cast<std::byte*>(p);
}

ScratchFile::~ScratchFile() {
    if (data_) ::munmap(data_, size_);
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
    if (this != &o) {
        if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
        path_ = std::move(o.path_);
        data_ = o.data_;
        size_ = o.size_;
        o.data_ = nullptr;
        o.size_ = 0;
    }
    return *this;
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

namespace {
std::string host_name() {
    char buf[HOST_NAME_MAX + 1] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0) return "host";
    std::string h(buf);
    for (char& c : h) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';  // the name is part of a file name
    }
    return h;
}
}  // namespace

std::string writer_tag() { return host_name() + "-" + std::to_string(::getpid()); }

bool writer_is_dead(const std::string& tag) {
    const size_t dash = tag.rfind('-');
    const std::string host = dash == std::string::npos ? host_name() : tag.substr(0, dash);
    const std::string pid_text = dash == std::string::npos ? tag : tag.substr(dash + 1);
    int pid = 0;
    const auto r = std::from_chars(pid_text.data(), pid_text.data() + pid_text.size(), pid);
    if (r.ec != std::errc() || r.ptr != pid_text.data() + pid_text.size() || pid <= 0) return false;
    if (host != host_name() || pid == ::getpid()) return false;
    return ::kill(pid, 0) != 0 && errno == ESRCH;
}

void fsync_path(const std::string& path) {
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    TESSERA_CHECK(f.fd >= 0, "{}: cannot open for fsync: {}", path, os_error());
    TESSERA_CHECK(::fsync(f.fd) == 0, "{}: fsync failed: {}", path, os_error());
}

void write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& write) {
    namespace fs = std::filesystem;
    const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
    Fd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    TESSERA_CHECK(f.fd >= 0, "{}: cannot create: {}", tmp, os_error());
    try {
        ByteSink sink = [&](std::span<const std::byte> bytes) {
            const std::byte* p = bytes.data();
            size_t left = bytes.size();
            while (left > 0) {
                ssize_t n = ::write(f.fd, p, left);
                if (n < 0 && errno == EINTR) continue;
                TESSERA_CHECK(n > 0, "{}: write failed: {}", tmp, os_error());
                p += n;
                left -= size_t(n);
            }
        };
        write(sink);
        TESSERA_CHECK(::fsync(f.fd) == 0, "{}: fsync failed: {}", tmp, os_error());
        ::close(f.fd);
        f.fd = -1;
        TESSERA_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "{}: cannot rename into place: {}", path, os_error());
    } catch (...) {
        std::error_code ec;
        fs::remove(tmp, ec);
        throw;
    }
    fs::path dir = fs::path(path).parent_path();
    fsync_path(dir.empty() ? "." : dir.string());
}

void write_text_atomic(const std::string& path, const std::string& text) {
    write_file_atomic(path, [&](const ByteSink& sink) { sink(std::as_bytes(std::span(text.data(), text.size()))); });
}

void for_each_line(std::string_view text, const std::function<void(std::string_view, size_t)>& f) {
    size_t number = 0;
    for (size_t pos = 0; pos < text.size();) {
        const size_t end = std::min(text.find('\n', pos), text.size());
        std::string_view line = text.substr(pos, end - pos);
        pos = end + 1;
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        f(line, ++number);
    }
}

std::string read_text(const std::string& path, size_t max_bytes) {
    std::error_code ec;
    TESSERA_CHECK(!std::filesystem::is_directory(path, ec), "{}: is a directory, not a file", path);
    std::ifstream in(path, std::ios::binary);
    TESSERA_CHECK(in.good(), "{}: cannot open: {}", path, os_error());
    std::string text;
    char buf[1 << 16];
    while (in) {
        in.read(buf, sizeof buf);
        text.append(buf, size_t(in.gcount()));
        TESSERA_CHECK(text.size() <= max_bytes, "{}: larger than {} bytes; not a file of this kind", path, max_bytes);
    }
    TESSERA_CHECK(in.eof(), "{}: read failed: {}", path, os_error());
    return text;
}

namespace {
constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> make_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
        t[i] = c;
    }
    return t;
}

uint32_t crc32c_table(uint32_t crc, const unsigned char* p, size_t n) {
    static const std::array<uint32_t, 256> table = make_table();
    for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return crc;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const unsigned char* p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        std::memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = uint32_t(c);
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
}  // namespace

uint32_t crc32c_update(uint32_t crc, std::span<const std::byte> data) {
    static const bool has_hw = __builtin_cpu_supports("sse4.2");
    const auto* p = reinterpret_cast<const unsigned char*>(data.data());
    crc = ~crc;
    crc = has_hw ? crc32c_hw(crc, p, data.size()) : crc32c_table(crc, p, data.size());
    return ~crc;
}

}  // namespace tessera
