// The row glue ops' CUDA entry points (ops/rows.h): 2-D memsets and memcpys where no arithmetic is needed, the
// kernels of ops/cuda/rows.cu otherwise. The neutral entry points (ops/cpu/rows.cpp) have checked the shapes.
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/entry_util.h"

namespace tessera::ops::cuda {

void copy_rows(TensorView src, TensorView dst, float scale) {
    const RowsArg<const float> s = carg<float>(src, "copy_rows: src");
    const RowsArg<float> d = marg<float>(dst, "copy_rows: dst");
    if (s.rows == 0 || s.cols == 0) return;
    if (scale != 1.f) return check_launch(launch_scale_rows(s, scale, d, stream()), "copy_rows");
    const cudaError_t err =
        cudaMemcpy2DAsync(d.data, size_t(d.ld) * sizeof(float), s.data, size_t(s.ld) * sizeof(float),
                          size_t(s.cols) * sizeof(float), size_t(s.rows), cudaMemcpyDeviceToDevice, stream());
    check_launch(err, "copy_rows");
}

void add_rows(TensorView src, TensorView dst) {
    check_launch(launch_add_rows(carg<float>(src, "add_rows: src"), marg<float>(dst, "add_rows: dst"), stream()),
                 "add_rows");
}

void copy_blocks(TensorView src, TensorView dst, std::span<const CopyBlock> blocks) {
    static_assert(sizeof(CopyBlock) == 3 * sizeof(int64_t));
    if (blocks.empty()) return;
    const size_t bytes = blocks.size() * sizeof(CopyBlock);
    auto* table = static_cast<int64_t*>(scratch(bytes));  // (the copy from pageable memory is staged before it returns)
    copy_bytes(table, Device::cuda, blocks.data(), Device::cpu, bytes);
    check_launch(launch_copy_blocks(src.ptr<float>(), dst.ptr<float>(), table, int64_t(blocks.size()), stream()),
                 "copy_blocks");
}

void cast(TensorView src, TensorView dst) {
    const int64_t n = src.numel();
    cudaError_t err = cudaSuccess;
    if (src.dtype == dst.dtype) {
        err = cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream());
    } else if (src.dtype == DType::bf16) {
        err = launch_widen_bf16(static_cast<const uint16_t*>(src.data), n, dst.ptr<float>(), stream());
    } else {
        err = launch_narrow_bf16(src.ptr<float>(), n, static_cast<uint16_t*>(dst.data), stream());
    }
    check_launch(err, "cast");
}

void round_to_bf16(TensorView t) {
    check_launch(launch_round_to_bf16(t.ptr<float>(), t.numel(), stream()), "round_to_bf16");
}

void zero_rows(TensorView t, int64_t rows) {
    const size_t row_bytes = dtype_bytes(t.dtype, t.numel() / t.size(0));
    const size_t pitch = t.is_contiguous() ? row_bytes : dtype_bytes(t.dtype, t.strides[0]);
    check_launch(cudaMemset2DAsync(t.data, pitch, 0, row_bytes, size_t(rows), stream()), "zero_rows");
}

void sigmoid_forward(TensorView x, TensorView y) {
    check_launch(launch_sigmoid_forward(carg<float>(x, "sigmoid: x"), marg<float>(y, "sigmoid: y"), stream()),
                 "sigmoid");
}

void sigmoid_backward(TensorView dy, TensorView y, TensorView dx) {
    check_launch(launch_sigmoid_backward(carg<float>(dy, "sigmoid: dy"), carg<float>(y, "sigmoid: y"),
                                         marg<float>(dx, "sigmoid: dx"), stream()),
                 "sigmoid backward");
}

void expand_groups(TensorView src, TensorView dst) {
    const RowsArg<const float> s = carg<float>(src, "expand_groups: src");
    const RowsArg<float> d = marg<float>(dst, "expand_groups: dst");
    check_launch(launch_expand_groups(s, d, d.cols / s.cols, stream()), "expand_groups");
}

void sum_groups(TensorView src, TensorView dst) {
    const RowsArg<const float> s = carg<float>(src, "sum_groups: src");
    const RowsArg<float> d = marg<float>(dst, "sum_groups: dst");
    check_launch(launch_sum_groups(s, d, s.cols / d.cols, stream()), "sum_groups");
}

void output_gate_forward(TensorView z, TensorView o, TensorView gate, TensorView y) {
    const RowsArg<const float> Z = carg<float>(z, "output_gate: z"), O = carg<float>(o, "output_gate: o");
    check_launch(launch_output_gate_forward(Z, O, marg<float>(gate, "output_gate: gate"),
                                            marg<float>(y, "output_gate: y"), O.cols / Z.cols, stream()),
                 "output_gate");
}

void output_gate_backward(TensorView dy, TensorView o, TensorView gate, TensorView dov, TensorView dz) {
    const RowsArg<const float> O = carg<float>(o, "output_gate: o"), G = carg<float>(gate, "output_gate: gate");
    check_launch(
        launch_output_gate_backward(carg<float>(dy, "output_gate: dy"), O, G, marg<float>(dov, "output_gate: do"),
                                    marg<float>(dz, "output_gate: dz"), O.cols / G.cols, stream()),
        "output_gate backward");
}

}  // namespace tessera::ops::cuda
