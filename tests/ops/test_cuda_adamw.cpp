// The CUDA backend against the CPU oracle (built with -DTESSERA_CUDA=ON; skipped without a GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "ops/adamw.h"
#include "ops/cuda/cuda_ops.h"
#include "util/test_util.h"

namespace tessera {
namespace {

TEST(CudaAdamW, MatchesTheCpuOracle) {
    if (!ops::cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine";
    const Shape s{1000, 37};
    Tensor p = test::randn(DType::f32, s, 1), g = test::randn(DType::f32, s, 2), m = test::randn(DType::f32, s, 3, 0.1),
           v = test::uniform(DType::f32, s, 4, 0.0, 0.01);
    std::vector<TensorView> dev;
    for (Tensor* t : {&p, &g, &m, &v}) {
        void* d = nullptr;
        ASSERT_EQ(cudaMalloc(&d, t->view().nbytes()), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d, t->view().data, t->view().nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
        dev.emplace_back(d, DType::f32, s, Device::cuda);
    }
    const ops::AdamWParams params{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1, .step = 7};
    ops::adamw_update(params, dev[0], dev[1], dev[2], dev[3]);
    ops::adamw_update(params, p, g, m, v);
    Tensor back(DType::f32, s);
    ASSERT_EQ(cudaMemcpy(back.view().data, dev[0].data, back.view().nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(test::all_close(back, p, 1e-6, 1e-7));
    for (auto& t : dev) cudaFree(t.data);
}

}  // namespace
}  // namespace tessera
