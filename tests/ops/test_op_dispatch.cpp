// The op dispatch seam (ops/backend.h, core/device.h) on any machine: device memory on the CPU, tensors on
// different devices refused, CUDA tensors given to an op the CUDA backend lacks refused before any memory is
// touched, and `run_op` on Device::cuda refused for those ops. (The CUDA implementations themselves are
// checked against the CPU in tests/ops/test_cuda_ops.cpp, on a machine with a GPU.)
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "core/arena.h"
#include "core/device.h"
#include "ops/attn_res.h"
#include "ops/dsa.h"
#include "ops/kda.h"
#include "ops/kda_gate.h"
#include "ops/lora.h"
#include "ops/moe.h"
#include "ops/moe_balance.h"
#include "ops/registry.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "util/test_util.h"

namespace tessera {
namespace {

// A view that claims to be on the GPU; its pointer is never dereferenced by the checks under test.
TensorView fake_cuda(Shape s) {
    static float sentinel[1];
    return TensorView(sentinel, DType::f32, s, Device::cuda);
}

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(Device, HostTensorsAndCopies) {
    Tensor a = test::randn(DType::f32, Shape{5, 7}, 1);
    Tensor b = a.to(Device::cpu);
    EXPECT_EQ(b.device(), Device::cpu);
    EXPECT_TRUE(test::all_close(a, b, 0, 0));
    EXPECT_NE(a.view().data, b.view().data);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.view().data) % 256, 0u);
    Tensor z(DType::f64, Shape{3}, Device::cpu);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(z.ptr<double>()[i], 0.0);
}

TEST(Device, ArenaOnTheHostHandsOutHostViews) {
    Arena arena(1 << 20, 256, Device::cpu);
    EXPECT_EQ(arena.device(), Device::cpu);
    const TensorView t = arena.allocate_tensor(DType::f32, Shape{16, 16});
    EXPECT_EQ(t.device, Device::cpu);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.base()) % 4096, 0u);
}

TEST(Device, TheCurrentStreamIsScopedPerThread) {
    EXPECT_EQ(current_stream().handle, nullptr);
    int token = 0;
    {
        StreamGuard g(Stream{&token});
        EXPECT_EQ(current_stream().handle, &token);
        std::thread([] { EXPECT_EQ(current_stream().handle, nullptr); }).join();
    }
    EXPECT_EQ(current_stream().handle, nullptr);
}

TEST(Device, CudaMemoryWithoutAGpuIsAClearError) {
    if (cuda_available()) GTEST_SKIP() << "a CUDA device is present (tests/ops/test_cuda_ops.cpp covers it)";
    const std::string e = error_of([] { Tensor t(DType::f32, Shape{4}, Device::cuda); });
    EXPECT_NE(e.find("CUDA"), std::string::npos) << e;
    const std::string a = error_of([] { Arena arena(1 << 16, 256, Device::cuda); });
    EXPECT_NE(a.find("arena: cannot reserve"), std::string::npos) << a;
}

TEST(OpDispatch, TensorsOnDifferentDevicesAreRefused) {
    Tensor x = test::randn(DType::f32, Shape{4, 8}, 2), w = test::randn(DType::f32, Shape{8}, 3);
    Tensor y(DType::f32, Shape{4, 8});
    const std::string e = error_of([&] { ops::rmsnorm_forward({}, x, w, y, fake_cuda(Shape{4})); });
    EXPECT_NE(e.find("rmsnorm: tensors on different devices"), std::string::npos) << e;
}

TEST(OpDispatch, WhatTheCudaBackendLacksRefusesCudaTensors) {
    ops::QuantileBalancer q(16, 2);
    const std::vector<float> bias(16, 0.f);
    const std::string e = error_of([&] { q.add(fake_cuda(Shape{4, 16}), bias); });
    EXPECT_NE(e.find("QuantileBalancer::add: the CUDA backend has no implementation of this op yet"), std::string::npos)
        << e;
}

// Experts held narrow (bf16, MXFP4: frozen) run in an f32 layer on either device; in an f64 layer they are refused
// before anything is read.
TEST(OpDispatch, MoeRefusesNarrowExpertsInAnF64Layer) {
    auto f64 = [](Shape s) {
        TensorView v = fake_cuda(s);
        v.dtype = DType::f64;
        return v;
    };
    ops::MoeWeights w{.router_w = f64(Shape{4, 8}),
                      .w_gate = f64(Shape{4, 6, 8}),
                      .w_up = f64(Shape{4, 6, 8}),
                      .w_down = f64(Shape{4, 8, 6})};
    const ops::MoeSaved s{};
    const ops::MoeScratch t{};
    const ops::MoeParams p;
    w.w_down = TensorView(w.w_down.data, DType::bf16, w.w_down.shape, Device::cuda);
    const std::string e = error_of([&] { ops::moe_forward(p, w, f64(Shape{3, 8}), f64(Shape{3, 8}), false, s, t); });
    EXPECT_NE(e.find("moe: expert weights in bf16 but the layer in f64"), std::string::npos) << e;
}

TEST(OpDispatch, AnOpTheCudaBackendHasFailsCleanlyWithoutAGpu) {
    if (cuda_available()) GTEST_SKIP() << "a CUDA device is present: fake pointers would reach a kernel";
    const TensorView x = fake_cuda(Shape{4, 8}), w = fake_cuda(Shape{8}), y = fake_cuda(Shape{4, 8}),
                     r = fake_cuda(Shape{4});
    const std::string e = error_of([&] { ops::rmsnorm_forward({}, x, w, y, r); });
    EXPECT_NE(e.find("rmsnorm"), std::string::npos) << e;
    EXPECT_NE(e.find(cuda_built() ? "launch failed" : "this build has no CUDA backend"), std::string::npos) << e;
}

// The checks the entry points gained when they became shared by both backends: one-line errors on the CPU too.
TEST(OpDispatch, SharedEntryChecksAreOneLineErrors) {
    Tensor v = test::randn(DType::f32, Shape{4, 8}, 1), g = test::randn(DType::f32, Shape{8}, 2);
    Tensor out(DType::f32, Shape{4, 8}), probs(DType::f32, Shape{4, 2}),
        scratch(DType::f32, Shape{ops::attn_res_mix_scratch(4, 2, 8)});
    const std::vector<TensorView> mixed{v, fake_cuda(Shape{4, 8})};
    std::string e = error_of([&] { ops::attn_res_mix_forward({}, mixed, g, g, out, probs, scratch); });
    EXPECT_NE(e.find("attn_res_mix: tensors on different devices"), std::string::npos) << e;

    Tensor f = test::randn(DType::f32, Shape{4, 2, 3}, 3), A = test::randn(DType::f32, Shape{2}, 4),
           bias = test::randn(DType::f32, Shape{2, 3}, 5), wide(DType::f32, Shape{4, 2, 6});
    e = error_of([&] { ops::kda_gate_forward({}, f, A, bias, wide.view().narrow(2, 0, 3)); });
    EXPECT_NE(e.find("kda_gate: g"), std::string::npos) << e;

    Tensor w = test::randn(DType::f32, Shape{6, 8}, 6), a = test::randn(DType::f32, Shape{2, 8}, 7),
           b64 = test::randn(DType::f64, Shape{6, 2}, 8), merged(DType::f32, Shape{6, 8});
    e = error_of([&] { ops::lora_merge({}, w, a, b64, merged); });
    EXPECT_NE(e.find("lora merge: every tensor must share one dtype"), std::string::npos) << e;
    Tensor b = test::randn(DType::f32, Shape{5, 2}, 9);
    e = error_of([&] { ops::lora_weight_backward({}, w, a, b, {}, {}); });
    EXPECT_NE(e.find("lora: dW [6, 8] needs A [r, 8] and B [6, r]"), std::string::npos) << e;

    Tensor q = test::randn(DType::f32, Shape{1, 4, 1, 8}, 10), vv = test::randn(DType::f32, Shape{1, 4, 1, 8}, 11),
           gg = test::uniform(DType::f32, Shape{1, 4, 1, 8}, 12, -0.5, -0.1),
           beta = test::uniform(DType::f32, Shape{1, 4, 1}, 13, 0.1, 0.9), o64(DType::f64, Shape{1, 4, 1, 8}),
           o(DType::f32, Shape{1, 4, 1, 8}), dv64(DType::f64, Shape{1, 4, 1, 8});
    const ops::KdaInputs in{q, q, vv, gg, beta, {}, {}};
    std::vector<std::byte> ws(ops::kda_workspace_bytes({}, in, true, 1));
    e = error_of([&] { ops::kda_forward({}, in, o64, {}, ws); });
    EXPECT_NE(e.find("kda: o"), std::string::npos) << e;
    e = error_of([&] { ops::kda_backward({}, in, o, {}, {.dv = dv64}, ws); });
    EXPECT_NE(e.find("kda: dv"), std::string::npos) << e;

    // DSA: a gradient of another dtype
    Tensor sq = test::randn(DType::f32, Shape{1, 4, 2, 8}, 14), skv = test::randn(DType::f32, Shape{1, 4, 8}, 15),
           sidx(DType::i32, Shape{1, 4, 2}), so(DType::f32, Shape{1, 4, 2, 8}), slse(DType::f32, Shape{1, 4, 2}),
           sdq(DType::f32, Shape{1, 4, 2, 8}), sdkv64(DType::f64, Shape{1, 4, 8});
    std::vector<std::byte> sws(ops::sparse_attention_workspace_bytes(DType::f32, {}, 1, 4, 2, 8, 2, 1));
    e = error_of([&] { ops::sparse_attention_backward({}, so, sq, skv, sidx, so, slse, sdq, sdkv64, sws); });
    EXPECT_NE(e.find("sparse_attention: do, dq and dkv must have q's dtype"), std::string::npos) << e;
    Tensor iw = test::randn(DType::f32, Shape{1, 4, 2}, 16), ip(DType::f32, Shape{1, 4, 2}),
           idq64(DType::f64, Shape{1, 4, 2, 8}), idk(DType::f32, Shape{1, 4, 8}), idw(DType::f32, Shape{1, 4, 2});
    std::vector<std::byte> iws(ops::indexer_kl_workspace_bytes(DType::f32, 1, 4, 2, 8, 2, 4, 1));
    e = error_of([&] { ops::indexer_kl(sq, skv, iw, ip, sidx, {}, 1.0, idq64, idk, idw, iws); });
    EXPECT_NE(e.find("indexer_kl: dq"), std::string::npos) << e;

    // the router's aux losses: a gradient of another dtype, a missing one
    Tensor logits = test::randn(DType::f32, Shape{4, 6}, 17), dlogits64(DType::f64, Shape{4, 6});
    e = error_of([&] { ops::router_z_loss(0.1, logits, dlogits64); });
    EXPECT_NE(e.find("router: dlogits"), std::string::npos) << e;
    const std::vector<double> grad(6, 0.1);
    e = error_of([&] { ops::router_balance_backward(grad, logits, {}); });
    EXPECT_NE(e.find("router balance backward: dscores is required"), std::string::npos) << e;
}

TEST(OpDispatch, RunOpOnCudaNamesTheOpsTheBackendHas) {
    for (const ops::OpDef& op : ops::op_registry().all()) {  // every op of `tessera op --list`
        EXPECT_TRUE(op.cuda) << op.name;
        EXPECT_NE(ops::cuda_op_names().find(op.name), std::string::npos) << op.name;
    }
    ops::OpDef lacking = *ops::op_registry().find("moe");  // an op without the backend is refused before any copy
    lacking.cuda = false;
    std::map<std::string, Tensor> in;
    in.emplace("q", test::randn(DType::f32, Shape{1, 2, 1, 4}, 4));
    const std::string e = error_of([&] { ops::run_op(lacking, std::move(in), {}, Device::cuda); });
    EXPECT_NE(e.find("op moe: the CUDA backend has no implementation of it yet"), std::string::npos) << e;
    EXPECT_NE(e.find("linear"), std::string::npos) << e;  // and names the ops it has
}

}  // namespace
}  // namespace tessera
