// safetensors reading (strict header validation, memory-mapped) and atomic writing.
#include "core/safetensors.h"

#include "core/json.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace tessera {

namespace {
constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit
constexpr const char* kChecksumKey = "crc32c";

std::string hex32(uint32_t v) { return fmt::format("{:08x}", v); }
}  // namespace

SafetensorsLayout parse_safetensors(std::span<const std::byte> bytes, const std::string& path) {
    using nlohmann::json;
    SafetensorsLayout out;
    TESSERA_CHECK(bytes.size() >= 8, "{}: not a safetensors file ({} bytes; the 8-byte header length is missing)", path,
                  bytes.size());
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);  // little-endian on every host we build for
    TESSERA_CHECK(header_len <= kMaxHeaderBytes, "{}: header length {} is implausible (limit {})", path, header_len,
                  kMaxHeaderBytes);
    TESSERA_CHECK(8 + header_len <= bytes.size(), "{}: header length {} runs past the end of the {}-byte file", path,
                  header_len, bytes.size());
    std::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8, header_len);
    TESSERA_CHECK(!header.empty() && header.front() == '{', "{}: header does not start with a JSON object", path);
    const json j = parse_json_unordered(header, path + ": header");
    TESSERA_CHECK(j.is_object(), "{}: header is not a JSON object", path);

    out.data_offset = 8 + header_len;
    const std::byte* data = bytes.data() + out.data_offset;
    const size_t data_size = bytes.size() - out.data_offset;
    for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string& name = it.key();
        const json& v = it.value();
        if (name == "__metadata__") {
            TESSERA_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", path);
            for (auto m = v.begin(); m != v.end(); ++m) {
                TESSERA_CHECK(m.value().is_string(), "{}: __metadata__[\"{}\"] is not a string", path,
                              excerpt(m.key()));
                out.metadata[m.key()] = m.value().get<std::string>();
            }
            continue;
        }
        TESSERA_CHECK(
            v.is_object() && v.size() == 3 && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
            "{}: tensor \"{}\" must have exactly dtype, shape and data_offsets", path, excerpt(name));
        SafetensorsEntry e;
        e.name = name;
        const std::string shown = excerpt(name);
        TESSERA_CHECK(v["dtype"].is_string(), "{}: tensor \"{}\": dtype is not a string", path, shown);
        auto dt = dtype_from_safetensors_name(v["dtype"].get<std::string>());
        TESSERA_CHECK(dt.has_value(), "{}: tensor \"{}\": unsupported dtype {}", path, shown, json_excerpt(v["dtype"]));
        e.dtype = *dt;
        const json& shape = v["shape"];
        TESSERA_CHECK(shape.is_array() && shape.size() <= size_t(kMaxDims), "{}: tensor \"{}\": bad shape {}", path,
                      shown, json_excerpt(shape));
        e.shape.ndim = int(shape.size());
        uint64_t numel = 1;
        for (size_t i = 0; i < shape.size(); ++i) {
            TESSERA_CHECK(shape[i].is_number_unsigned(), "{}: tensor \"{}\": bad shape {}", path, shown,
                          json_excerpt(shape));
            uint64_t d = shape[i].get<uint64_t>();
            TESSERA_CHECK(d < (uint64_t(1) << 40) && (d == 0 || numel <= (uint64_t(1) << 50) / d),
                          "{}: tensor \"{}\": shape {} is too large", path, shown, json_excerpt(shape));
            numel *= d;
            e.shape.dims[i] = int64_t(d);
        }
        const json& off = v["data_offsets"];
        TESSERA_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                      "{}: tensor \"{}\": data_offsets must be two non-negative integers", path, shown);
        uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
        TESSERA_CHECK(begin <= end, "{}: tensor \"{}\": data_offsets [{}, {}] are reversed", path, shown, begin, end);
        TESSERA_CHECK(end - begin == numel * dtype_size(e.dtype),
                      "{}: tensor \"{}\": {} {} needs {} bytes but data_offsets span {}", path, shown,
                      dtype_name(e.dtype), e.shape.str(), numel * dtype_size(e.dtype), end - begin);
        TESSERA_CHECK(end <= data_size,
                      "{}: tensor \"{}\" ends at byte {} of the data section, which holds only {} (truncated file?)",
                      path, shown, end, data_size);
        e.offset = begin;
        e.nbytes = end - begin;
        out.entries.push_back(std::move(e));
    }
    // The tensors must tile the data section exactly, in offset order: no gaps, overlaps or trailing bytes.
    std::vector<const SafetensorsEntry*> by_offset;
    for (auto& e : out.entries) by_offset.push_back(&e);
    std::sort(by_offset.begin(), by_offset.end(),
              [](auto* a, auto* b) { return a->offset != b->offset ? a->offset < b->offset : a->nbytes < b->nbytes; });
    size_t expected = 0;
    for (auto* e : by_offset) {
        TESSERA_CHECK(e->offset == expected, "{}: tensor \"{}\" starts at byte {} but {} was expected (overlap or gap)",
                      path, excerpt(e->name), e->offset, expected);
        expected += e->nbytes;
    }
    TESSERA_CHECK(expected == data_size, "{}: the header describes {} bytes of tensor data but the file holds {}{}",
                  path, expected, data_size, expected < data_size ? " (trailing bytes)" : " (truncated file?)");
    if (auto it = out.metadata.find(kChecksumKey); it != out.metadata.end()) {
        uint32_t crc = crc32c(std::span(data, data_size));
        TESSERA_CHECK(hex32(crc) == it->second,
                      "{}: checksum mismatch (data crc32c {} but the header records {}): the file is corrupted", path,
                      hex32(crc), it->second);
    }
    return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
    SafetensorsLayout layout = parse_safetensors(file_.bytes(), path);
    entries_ = std::move(layout.entries);
    metadata_ = std::move(layout.metadata);
    data_ = file_.bytes().data() + layout.data_offset;
}

bool SafetensorsFile::contains(const std::string& name) const {
    return std::any_of(entries_.begin(), entries_.end(), [&](auto& e) { return e.name == name; });
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
    for (auto& e : entries_) {
        if (e.name == name) return e;
    }
    TESSERA_FAIL("{}: no tensor named \"{}\"", path(), excerpt(name));
}

bool SafetensorsFile::is_aligned(const std::string& name) const {
    const SafetensorsEntry& e = entry(name);
    return reinterpret_cast<uintptr_t>(data_ + e.offset) % dtype_size(e.dtype) == 0;
}

TensorView SafetensorsFile::view(const std::string& name) const {
    const SafetensorsEntry& e = entry(name);
    const std::byte* p = data_ + e.offset;
    TESSERA_CHECK(reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0,
                  "{}: tensor \"{}\" is not aligned for {}; use load()", path(), name, dtype_name(e.dtype));
    return TensorView(const_cast<std::byte*>(p), e.dtype, e.shape);
}

Tensor SafetensorsFile::load(const std::string& name) const {
    const SafetensorsEntry& e = entry(name);
    Tensor t(e.dtype, e.shape);
    if (e.nbytes) std::memcpy(t.view().data, data_ + e.offset, e.nbytes);
    return t;
}

void SafetensorsFile::load_into(const std::string& name, const TensorView& dst) const {
    const SafetensorsEntry& e = entry(name);
    TESSERA_CHECK(e.shape == dst.shape, "{}: tensor \"{}\" is {} but {} was expected", path(), name, e.shape.str(),
                  dst.shape.str());
    if (e.dtype == dst.dtype) {
        check_contiguous(dst, name);
        if (e.nbytes) std::memcpy(dst.data, data_ + e.offset, e.nbytes);
        return;
    }
    TESSERA_CHECK(dtype_is_float(e.dtype) && dtype_is_float(dst.dtype), "{}: tensor \"{}\" is {} but {} was expected",
                  path(), name, dtype_name(e.dtype), dtype_name(dst.dtype));
    Tensor tmp = load(name);
    convert(tmp.view(), dst);
}

void write_safetensors(const std::string& path,
                       const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
    using nlohmann::ordered_json;
    ordered_json header = ordered_json::object();
    std::set<std::string> names;
    size_t offset = 0;
    uint32_t crc = 0;
    for (const auto& t : tensors) {
        TESSERA_CHECK(names.insert(t.name).second, "{}: tensor name \"{}\" appears twice", path, t.name);
        TESSERA_CHECK(t.name != "__metadata__", "{}: \"__metadata__\" is not a tensor name", path);
        check_contiguous(t.tensor, t.name);
        TESSERA_CHECK(t.tensor.dtype != DType::mxfp4, "{}: tensor \"{}\" is mxfp4, which safetensors cannot hold", path,
                      t.name);
        std::vector<int64_t> shape(t.tensor.shape.dims.begin(), t.tensor.shape.dims.begin() + t.tensor.ndim());
        header[t.name] = {{"dtype", dtype_safetensors_name(t.tensor.dtype)},
                          {"shape", shape},
                          {"data_offsets", {offset, offset + t.tensor.nbytes()}}};
        offset += t.tensor.nbytes();
        crc = crc32c_update(crc, std::span(static_cast<const std::byte*>(t.tensor.data), t.tensor.nbytes()));
    }
    ordered_json meta = ordered_json::object();
    for (auto& [k, v] : metadata) meta[k] = v;
    meta[kChecksumKey] = hex32(crc);
    header["__metadata__"] = meta;
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');  // pad so the data section starts 8-byte aligned
    uint64_t n = h.size();
    write_file_atomic(path, [&](const ByteSink& sink) {
        sink(std::as_bytes(std::span(&n, 1)));
        sink(std::as_bytes(std::span(h.data(), h.size())));
        for (const auto& t : tensors) sink(std::span(static_cast<const std::byte*>(t.tensor.data), t.tensor.nbytes()));
    });
}

}  // namespace tessera
