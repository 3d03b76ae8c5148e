// Tensor parallelism of an attention block (see tensor_slice.h).
#include "model/layers/tensor_slice.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "core/check.h"
#include "core/device.h"
#include "ops/rows.h"

namespace tessera::model {

namespace {
std::span<std::byte> bytes_of(TensorView v, int64_t rows) {
    return {static_cast<std::byte*>(v.data), size_t(rows * v.size(1)) * sizeof(float)};
}
}  // namespace

TensorSlice::TensorSlice(std::unique_ptr<Block> whole,
                         std::unique_ptr<Block> part,
                         parallel::Comm& group,
                         int64_t d_model)
    : whole_(std::move(whole)),
      part_(std::move(part)),
      group_(group),
      T_(group.size()),
      t_(group.rank()),
      C_(d_model),
      counts_(size_t(T_)) {
    TESSERA_CHECK(whole_->kind() == part_->kind(), "tensor slice: a {} block sliced as a {} block", whole_->kind(),
                  part_->kind());
    part_->set_residual(false);  // it adds only its heads' share; the residual is added once, here
    std::vector<BufferSpec> ws, ps;
    std::vector<ParamInit> wi, pi;
    whole_->declare_params(ws, wi);
    part_->declare_params(ps, pi);
    std::unordered_map<std::string, const BufferSpec*> by_name;
    for (const BufferSpec& s : ws) by_name.emplace(s.name, &s);
    for (const BufferSpec& p : ps) {
        auto it = by_name.find(p.name);
        TESSERA_CHECK(it != by_name.end(), "tensor slice: the sliced block has a parameter {} the whole has not",
                      p.name);
        const Shape& w = it->second->shape;
        TESSERA_CHECK(w.ndim == p.shape.ndim && p.dtype == it->second->dtype,
                      "tensor slice: parameter {} is {} {} whole and {} {} sliced", p.name,
                      dtype_name(it->second->dtype), w.str(), dtype_name(p.dtype), p.shape.str());
        Piece piece{.name = p.name, .once = part_->head_independent_gradient(p.name)};
        for (int k = 0; k < w.ndim; ++k) {
            if (w[k] == p.shape[k]) continue;
            TESSERA_CHECK(piece.dim < 0 && w[k] == T_ * p.shape[k],
                          "tensor slice: parameter {} is {} whole and {} sliced, not 1/{} of one dimension", p.name,
                          w.str(), p.shape.str(), T_);
            piece.dim = k;
        }
        if (piece.dim >= 0) {
            for (int k = 0; k < piece.dim; ++k) piece.outer *= w[k];
            for (int k = piece.dim + 1; k < w.ndim; ++k) piece.inner *= w[k];
            piece.d = p.shape[piece.dim];
        } else {
            piece.inner = w.numel();
        }
        pieces_.push_back(std::move(piece));
    }
    part_specs_ = std::move(ps);
    held_as(ws);
}

void TensorSlice::held_as(const std::vector<BufferSpec>& params) {
    std::unordered_map<std::string, const BufferSpec*> by_name;
    for (const BufferSpec& s : params) by_name.emplace(s.name, &s);
    for (size_t i = 0; i < pieces_.size(); ++i) {
        auto it = by_name.find(pieces_[i].name);
        TESSERA_CHECK(it != by_name.end(), "tensor slice: the model holds no parameter {}", pieces_[i].name);
        const DType held = it->second->dtype;
        TESSERA_CHECK(held == DType::f32 || held == DType::bf16,
                      "tensor slice: parameter {} is held in {}; tensor parallelism slices f32 and bf16 ones",
                      pieces_[i].name, dtype_name(held));
        part_specs_[i].dtype = held;
        part_specs_[i].trainable = it->second->trainable;
        pieces_[i].bytes = dtype_size(held);
    }
    lay_out();
}

void TensorSlice::lay_out() {
    part_params_ = BufferGroup("tensor slice parameters", part_specs_);
    std::vector<BufferSpec> grads;
    for (const BufferSpec& p : part_specs_) {
        if (!p.trainable) continue;
        grads.push_back(p);
        grads.back().kind = BufferKind::grad;
    }
    part_grads_ = BufferGroup("tensor slice gradients", std::move(grads));
}

void TensorSlice::declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const {
    whole_->declare_params(specs, inits);
}

void TensorSlice::declare_saved(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    part_->declare_saved(specs, prefix, max);
}

void TensorSlice::declare_scratch(std::vector<BufferSpec>& specs, const std::string& prefix, StepShape max) const {
    part_->declare_scratch(specs, prefix, max);
    specs.push_back({prefix + "tensor.x", DType::f32, Shape{max.tokens(), C_}});
    specs.push_back({prefix + "tensor.y", DType::f32, Shape{max.tokens(), C_}});
    specs.push_back({prefix + "tensor.params", DType::u8, Shape{int64_t(part_params_.nbytes())}});
    specs.push_back({prefix + "tensor.grads", DType::u8, Shape{int64_t(part_grads_.nbytes())}});
}

size_t TensorSlice::workspace_bytes(StepShape max, int num_threads) const {
    return part_->workspace_bytes(max, num_threads);
}

void TensorSlice::bind_params(const BufferGroup& params, const BufferGroup* grads) {
    has_grads_ = grads != nullptr;
    whole_params_.clear();
    whole_grads_.clear();
    for (const Piece& p : pieces_) {
        whole_params_.push_back(params.view(p.name));
        whole_grads_.push_back(grads ? grads->find(p.name) : TensorView{});
    }
}

void TensorSlice::bind_saved(const BufferGroup& acts, const std::string& prefix) { part_->bind_saved(acts, prefix); }

void TensorSlice::bind_scratch(const BufferGroup& acts, const std::string& prefix) {
    part_params_.bind(static_cast<std::byte*>(acts.view(prefix + "tensor.params").data), acts.device());
    part_grads_.bind(static_cast<std::byte*>(acts.view(prefix + "tensor.grads").data), acts.device());
    part_->bind_params(part_params_, has_grads_ ? &part_grads_ : nullptr);
    part_grads_of_.clear();
    for (const BufferSpec& p : part_specs_)  // (model.lora: only the adapters and modules_to_save train)
        part_grads_of_.push_back(has_grads_ && p.trainable ? part_grads_.view(p.name) : TensorView{});
    part_->bind_scratch(acts, prefix);
    x_ = acts.view(prefix + "tensor.x");
    y_ = acts.view(prefix + "tensor.y");
}

void TensorSlice::pack_params() {
    for (size_t i = 0; i < pieces_.size(); ++i) {
        const Piece& p = pieces_[i];
        const TensorView whole = whole_params_[i], part = part_params_.view(i);
        if (p.dim < 0) {
            copy_bytes(part.data, part.device, whole.data, whole.device, size_t(p.inner) * p.bytes);
            continue;
        }
        // one outer index's slice: contiguous in both, T of them to an outer index in the whole
        const size_t run = size_t(p.d * p.inner) * p.bytes;
        copy_bytes_2d(part.data, run, part.device, static_cast<const std::byte*>(whole.data) + size_t(t_) * run,
                      size_t(T_) * run, whole.device, run, size_t(p.outer));
    }
}

void TensorSlice::add_grads() {
    for (size_t i = 0; i < pieces_.size(); ++i) {
        const Piece& p = pieces_[i];
        if (!whole_grads_[i].defined() || !part_grads_of_[i].defined() || (p.once && t_ != 0)) continue;
        // the part's [outer, d, inner] onto [outer, T·d, inner]'s slice t (a whole-shared one: [1, 1, inner] at 0)
        const bool whole = p.dim < 0;
        const int64_t run = whole ? p.inner : p.d * p.inner, outer = whole ? 1 : p.outer;
        const TensorView part = part_grads_of_[i], all = whole_grads_[i];
        ops::add_rows(TensorView(part.data, DType::f32, Shape{outer, run}, part.device),
                      TensorView(all.data, DType::f32, Shape{outer, whole ? run : T_ * run}, all.device)
                          .columns(whole ? 0 : t_ * run, run));
    }
}

void TensorSlice::gather_rows(TensorView rows, TensorView all, int64_t n) {
    group_.all_gather(bytes_of(rows, n), bytes_of(all, n * T_));
}

void TensorSlice::add_scattered(TensorView all, TensorView rows, int64_t n) {
    std::fill(counts_.begin(), counts_.end(), n * C_);
    group_
        .reduce_scatter_v_async(DType::f32, all.data, counts_, rows.data, n * C_, /*accumulate=*/true,
                                bytes_of(x_, n * T_))  // (scratch: the gathered input is no longer read)
        .wait();
}

void TensorSlice::forward(StepShape s, TensorView x_in, TensorView x_out, std::span<std::byte> ws) {
    const int64_t N = s.tokens(), n = N / T_;
    pack_params();
    gather_rows(x_in, x_, n);
    part_->forward(s, x_.slice0(0, N), y_.slice0(0, N), ws);
    start_output(x_in, x_out, n);
    add_scattered(y_, x_out, n);
}

void TensorSlice::backward(StepShape s, TensorView x_in, TensorView dres, std::span<std::byte> ws) {
    const int64_t N = s.tokens(), n = N / T_;
    pack_params();
    gather_rows(x_in, x_, n);
    gather_rows(dres, y_, n);
    if (has_grads_) part_grads_.zero();
    part_->backward(s, x_.slice0(0, N), y_.slice0(0, N), ws);  // y: this rank's heads' share of dL/dx
    start_input_grad(dres, n);
    add_scattered(y_, dres, n);
    if (has_grads_) add_grads();
}

void TensorSlice::step(int64_t, int64_t, TensorView, TensorView, std::span<std::byte>) {
    throw Error("parallel.tensor: decoding with tensor parallelism is not supported (decode on one rank)");
}

}  // namespace tessera::model
