// safetensors files (https://github.com/huggingface/safetensors, format section of its README):
// 8-byte little-endian header length N, N bytes of JSON header, then the tensor data. Reading maps
// the file and validates the header strictly (every dtype, shape and offset; the data section tiled
// exactly); writing is atomic and records a CRC-32C of the data in the metadata, checked on read.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/file.h"
#include "core/tensor.h"

namespace tessera {

struct SafetensorsEntry {
    std::string name;
    DType dtype;
    Shape shape;
    size_t offset = 0;  // within the data section
    size_t nbytes = 0;
};

// What a safetensors file holds, from its bytes (the whole file), validated as SafetensorsFile's constructor
// does; `path` names it in messages. The entry point the fuzzer calls (tests/fuzz/).
struct SafetensorsLayout {
    std::vector<SafetensorsEntry> entries;
    std::map<std::string, std::string> metadata;
    size_t data_offset = 0;  // where the data section starts
};
SafetensorsLayout parse_safetensors(std::span<const std::byte> bytes, const std::string& path);

class SafetensorsFile {
  public:
    // Maps and validates; throws tessera::Error naming the file and what is wrong with it.
    explicit SafetensorsFile(const std::string& path);

    const std::string& path() const { return file_.path(); }
    const std::vector<SafetensorsEntry>& entries() const { return entries_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    bool contains(const std::string& name) const;
    const SafetensorsEntry& entry(const std::string& name) const;  // throws if absent
    // Whether the tensor's bytes in the mapping are aligned for its dtype (files written by this engine and by
    // the reference library are; view() needs it).
    bool is_aligned(const std::string& name) const;
    // Read-only view into the mapping (the data must be aligned for its dtype).
    TensorView view(const std::string& name) const;
    Tensor load(const std::string& name) const;  // an owned copy
    // Copies into dst after checking dtype and shape (f32/f64/bf16 files convert into float dst).
    void load_into(const std::string& name, const TensorView& dst) const;

  private:
    MappedFile file_;
    std::vector<SafetensorsEntry> entries_;
    std::map<std::string, std::string> metadata_;
    const std::byte* data_ = nullptr;
};

struct NamedTensor {
    std::string name;
    TensorView tensor;  // contiguous
};

// Writes atomically; adds metadata "crc32c" (hex of the data section's CRC-32C).
void write_safetensors(const std::string& path,
                       const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace tessera
