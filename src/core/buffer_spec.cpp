// Buffer groups: packing, binding and the arena-size prediction.
#include "core/buffer_spec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/device.h"

namespace tessera {

std::string_view buffer_kind_name(BufferKind k) {
    switch (k) {
        case BufferKind::param:
            return "param";
        case BufferKind::grad:
            return "grad";
        case BufferKind::optimizer:
            return "optimizer";
        case BufferKind::activation:
            return "activation";
        case BufferKind::workspace:
            return "workspace";
    }
    return "?";
}

namespace {
constexpr size_t kMaxBytes = size_t(1) << 62;  // far beyond any machine; sums of such sizes cannot wrap
}  // namespace

size_t BufferSpec::nbytes() const {
    const size_t bytes = dtype_bytes(dtype, shape.numel());
    TESSERA_CHECK(bytes <= kMaxBytes, "buffer {} {} {} is too large", name, dtype_name(dtype), shape.str());
    return bytes;
}

BufferGroup::BufferGroup(std::string name, std::vector<BufferSpec> specs)
    : name_(std::move(name)), specs_(std::move(specs)) {
    size_t off = 0;
    for (size_t i = 0; i < specs_.size(); ++i) {
        TESSERA_CHECK(index_.emplace(specs_[i].name, i).second, "buffer group {}: \"{}\" declared twice", name_,
                      specs_[i].name);
        offsets_.push_back(off);
        off += (specs_[i].nbytes() + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
        TESSERA_CHECK(off <= kMaxBytes, "buffer group {} needs more than 2^62 bytes", name_);
    }
    nbytes_ = off;
}

BufferGroup::BufferGroup(std::string name, std::vector<BufferSpec> specs, std::vector<size_t> offsets, size_t nbytes)
    : name_(std::move(name)), specs_(std::move(specs)), offsets_(std::move(offsets)), nbytes_(nbytes) {
    TESSERA_CHECK(offsets_.size() == specs_.size(), "buffer group {}: {} offsets for {} buffers", name_,
                  offsets_.size(), specs_.size());
    for (size_t i = 0; i < specs_.size(); ++i) {
        TESSERA_CHECK(index_.emplace(specs_[i].name, i).second, "buffer group {}: \"{}\" declared twice", name_,
                      specs_[i].name);
        if (offsets_[i] == kOutside) continue;  // placed by place_outside
        TESSERA_CHECK(offsets_[i] % kBufferAlign == 0 && offsets_[i] + specs_[i].nbytes() <= nbytes_,
                      "buffer group {}: \"{}\" at {} does not fit in {} bytes aligned", name_, specs_[i].name,
                      offsets_[i], nbytes_);
    }
}

int BufferGroup::index_of(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : int(it->second);
}

void BufferGroup::allocate(const std::shared_ptr<Arena>& arena) {
    block_ = ArenaBlock(arena, std::max<size_t>(nbytes_, 1));
    device_zero(block_.device(), block_.data(), nbytes_);
}

void BufferGroup::bind(std::byte* base, Device device) {
    TESSERA_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % kBufferAlign == 0,
                  "buffer group {}: bound to an unaligned address", name_);
    borrowed_ = base;
    borrowed_device_ = device;
}

void BufferGroup::zero() const {
    TESSERA_CHECK(base() != nullptr, "buffer group {} is not allocated", name_);
    device_zero(device(), base(), nbytes_);
}

TensorView BufferGroup::view(size_t i) const {
    TESSERA_CHECK(base() != nullptr, "buffer group {} is not allocated", name_);
    if (offsets_[i] == kOutside) {
        TESSERA_CHECK(i < outside_.size() && outside_[i], "buffer group {}: \"{}\" was never placed", name_,
                      specs_[i].name);
        const Outside& o = *outside_[i];
        return o.at.size() == 1 && specs_[i].dtype != DType::mxfp4
                   ? TensorView(o.at[0], specs_[i].dtype, specs_[i].shape, o.device)
                   : TensorView::stored_apart(o.at.data(), specs_[i].dtype, specs_[i].shape);
    }
    return TensorView(base() + offsets_[i], specs_[i].dtype, specs_[i].shape, device());
}

void BufferGroup::place_outside(size_t i, std::vector<std::byte*> where) {
    TESSERA_CHECK(i < specs_.size() && offsets_[i] == kOutside, "buffer group {}: buffer {} is not one placed outside",
                  name_, i);
    const int64_t per_slice = specs_[i].dtype == DType::mxfp4 ? 2 : 1;  // (mxfp4: packed values and scales)
    TESSERA_CHECK((where.size() == 1 && per_slice == 1) ||
                      (specs_[i].shape.ndim >= 1 && int64_t(where.size()) == per_slice * specs_[i].shape[0]),
                  "buffer group {}: \"{}\" {} {} placed in {} pieces (one, or {} per slice)", name_, specs_[i].name,
                  specs_[i].shape.str(), dtype_name(specs_[i].dtype), where.size(), per_slice == 1 ? "one" : "two");
    outside_.resize(specs_.size());
    outside_[i] = std::make_shared<const Outside>(Outside{.at = {where.begin(), where.end()}});
}

BufferGroup BufferGroup::reading(const BufferGroup& copies) const {
    BufferGroup r;
    r.name_ = name_;
    r.specs_ = specs_;
    r.offsets_ = offsets_;
    r.index_ = index_;
    r.outside_ = outside_;
    r.outside_.resize(specs_.size());
    r.nbytes_ = nbytes_;
    r.borrowed_ = base();
    r.borrowed_device_ = device();
    for (size_t i = 0; i < copies.size(); ++i) {
        const BufferSpec& c = copies.specs_[i];
        const int j = index_of(c.name);
        TESSERA_CHECK(j >= 0 && specs_[size_t(j)].shape == c.shape,
                      "buffer group {}: no buffer \"{}\" {} to read from {}", name_, c.name, c.shape.str(),
                      copies.name_);
        const TensorView v = copies.view(i);
        r.specs_[size_t(j)].dtype = c.dtype;
        r.offsets_[size_t(j)] = kOutside;
        r.outside_[size_t(j)] = std::make_shared<const Outside>(Outside{.at = {v.data}, .device = v.device});
    }
    return r;
}

TensorView BufferGroup::view(const std::string& name) const {
    int i = index_of(name);
    TESSERA_CHECK(i >= 0, "buffer group {} has no buffer \"{}\"", name_, name);
    return view(size_t(i));
}

TensorView BufferGroup::find(const std::string& name) const {
    const int i = index_of(name);
    return i < 0 ? TensorView{} : view(size_t(i));
}

namespace {
// index of the first non-finite element, or -1
template <class T, class ToFloat>
int64_t first_non_finite(const T* p, int64_t n, ToFloat to_float) {
    for (int64_t k = 0; k < n; ++k) {
        if (!std::isfinite(to_float(p[k]))) return k;
    }
    return -1;
}
}  // namespace

void check_finite(const BufferGroup& g, const std::string& where) {
    Tensor host;  // a device group's buffer, copied to the host one at a time
    for (size_t i = 0; i < g.size(); ++i) {
        const TensorView whole = g.view(i);
        if (whole.dtype == DType::mxfp4) continue;  // finite by construction (core/mxfp4.h)
        // its contiguous pieces: all of it, or each slice when they are stored apart
        const int64_t pieces = whole.slices ? whole.size(0) : 1;
        for (int64_t k = 0; k < pieces; ++k) {
            TensorView v = whole.slices ? whole.slice0(k, k + 1) : whole;
            if (v.device != Device::cpu) {
                host = Tensor(v.dtype, v.shape);
                copy_bytes(host.view().data, Device::cpu, v.data, v.device, v.nbytes());
                v = host.view();
            }
            int64_t bad = -1;
            double value = 0;
            if (v.dtype == DType::f32) {
                bad = first_non_finite(v.ptr<float>(), v.numel(), [](float x) { return x; });
                if (bad >= 0) value = v.ptr<float>()[bad];
            } else if (v.dtype == DType::f64) {
                bad = first_non_finite(v.ptr<double>(), v.numel(), [](double x) { return x; });
                if (bad >= 0) value = v.ptr<double>()[bad];
            } else if (v.dtype == DType::bf16) {
                bad = first_non_finite(v.ptr<bf16>(), v.numel(), bf16_to_float);
                if (bad >= 0) value = bf16_to_float(v.ptr<bf16>()[bad]);
            }
            TESSERA_CHECK(bad < 0,
                          "{}: tensor \"{}\" holds {} at index {} (a diverged run's weights?); refusing to use it",
                          where, g.specs()[i].name, value, k * v.numel() + bad);
        }
    }
}

size_t predict_arena_bytes(const std::vector<const BufferGroup*>& groups, size_t min_block) {
    std::vector<size_t> sizes;
    for (const auto* g : groups) sizes.push_back(std::max<size_t>(g->nbytes(), 1));
    return buddy_capacity_for(sizes, min_block);
}

void allocate_groups(const std::shared_ptr<Arena>& arena, const std::vector<BufferGroup*>& groups) {
    std::vector<BufferGroup*> order = groups;
    std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->nbytes() > b->nbytes(); });
    for (auto* g : order) g->allocate(arena);
}

}  // namespace tessera
