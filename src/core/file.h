// Files: read-only memory maps, atomic writes (temporary name, fsync, rename), CRC-32C checksums.
// A crash in the middle of a write never leaves a half-written file under the final name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

class MappedFile {
  public:
    MappedFile() = default;
    explicit MappedFile(const std::string& path);  // throws with the path and the OS error
    MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
    MappedFile& operator=(MappedFile&& o) noexcept;
    MappedFile(const MappedFile&) = delete;
    ~MappedFile();

    std::span<const std::byte> bytes() const { return {data_, size_}; }
    const std::string& path() const { return path_; }

  private:
    std::string path_;
    const std::byte* data_ = nullptr;
    size_t size_ = 0;
};

// The pages of a read-only file mapping that a range touches (rounded out to whole pages): how many are in this
// process's resident set (mapped in its page table: /proc/self/pagemap's present bit, not mincore's page-cache
// view; `scratch` holds one entry a page, grown once), faulting them in by reading a byte of each, and releasing
// them (madvise MADV_DONTNEED: they leave the resident set, and a later read maps them again from the page cache
// or the file). The weight budget's tools (train/weight_budget.h).
size_t resident_bytes(const void* p, size_t n, std::vector<uint64_t>& scratch);
void touch_pages(const void* p, size_t n);
void release_pages(const void* p, size_t n);
size_t page_size();
// Asks the kernel to read a range's pages ahead (madvise MADV_WILLNEED), without waiting for them.
void prefetch_pages(const void* p, size_t n);
// Drops a file's pages from the page cache (posix_fadvise POSIX_FADV_DONTNEED: the clean pages no process maps), so
// the next read of them reads storage.
void drop_cached_pages(const std::string& path);

// Read-write memory backed by a new file in `dir`, unlinked as soon as it is made: the file lives while it is mapped
// and never outlives the process, even one that is killed. Its blocks are reserved up front (posix_fallocate), so a
// full disk is an error here and not a SIGBUS later; it starts zero-filled. The kernel pages it to and from the disk as
// it needs the memory; release_pages drops a range from the resident set (the values stay in the file). AdamW's moments
// under memory.optimizer_offload (train/optimizer.h).
class ScratchFile {
  public:
    ScratchFile(const std::string& dir, size_t bytes);  // throws with the directory and the OS error
    ScratchFile(const ScratchFile&) = delete;
    ScratchFile& operator=(const ScratchFile&) = delete;
    ~ScratchFile();

    std::byte* data() const { return data_; }
    size_t size() const { return size_; }

  private:
    std::byte* data_ = nullptr;
    size_t size_ = 0;
};

// Writes through `write` into "<path>.tmp-<pid>", fsyncs it, renames it to path and fsyncs the
// directory. On any error the temporary file is removed and the previous file at path is untouched.
using ByteSink = std::function<void(std::span<const std::byte>)>;
void write_file_atomic(const std::string& path, const std::function<void(const ByteSink&)>& write);
void write_text_atomic(const std::string& path, const std::string& text);
// The whole file; throws (naming the file) when it cannot be read or holds more than max_bytes (a config
// named /dev/zero must not eat the memory).
// Temporary names carry their writer, "<host>-<pid>", so a later process can tell a dead writer's temporaries
// (removable) from a live one's. writer_is_dead is true only when the writer of a tag ("<host>-<pid>", or an
// older "<pid>") is certainly gone: on this host, and no process has that pid. Another host's, or a pid in use,
// may be alive.
std::string writer_tag();
bool writer_is_dead(const std::string& tag);

std::string read_text(const std::string& path, size_t max_bytes = SIZE_MAX);
// Calls f(line, number) for each line of text (numbered from 1; "\n" or "\r\n" ends a line, not part of it).
void for_each_line(std::string_view text, const std::function<void(std::string_view, size_t)>& f);
void fsync_path(const std::string& path);  // a file or a directory

uint32_t crc32c_update(uint32_t crc, std::span<const std::byte> data);
inline uint32_t crc32c(std::span<const std::byte> data) { return crc32c_update(0, data); }

}  // namespace tessera
