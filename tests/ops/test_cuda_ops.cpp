// The CUDA backend against the CPU oracle, on a machine with a GPU (built with -DTESSERA_CUDA=ON; every test
// skips without a device): every golden file of every op the backend implements, through the op registry on
// Device::cuda (the `tessera op --device cuda` path) in f64 and f32 against the reference's expected values;
// the model-glue ops (ops/rows.h, ops/matmul.h) and the blocks' small ops against the CPU on the same inputs, as
// the blocks call them (column blocks, strided heads, packed sequences, decoding steps);
// bitwise run-to-run determinism; the device arena.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/mxfp4.h"
#include "core/safetensors.h"
#include "ops/adamw.h"
#include "ops/attention.h"
#include "ops/attn_res.h"
#include "ops/causal_conv1d.h"
#include "ops/cuda/entry_util.h"
#include "ops/decode.h"
#include "ops/dsa.h"
#include "ops/embedding.h"
#include "ops/gated_rmsnorm.h"
#include "ops/kda.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/layernorm.h"
#include "ops/linear.h"
#include "ops/lora.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "ops/registry.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/rows.h"
#include "ops/verify.h"
#include "ops/vision.h"
#include "util/test_util.h"

namespace tessera {
namespace {

#define SKIP_WITHOUT_GPU() \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device on this machine"

// The largest difference between two f32 tensors relative to the expected one's largest value: a bf16 kernel's
// error against the CPU's f32. Equal values (infinities too) differ by 0; a NaN on either side, or an infinity on
// one, is an infinite difference.
double largest_difference(const Tensor& got, const Tensor& want) {
    double diff = 0, size = 0;
    for (int64_t e = 0; e < got.numel(); ++e) {
        const double g = got.ptr<float>()[e], w = want.ptr<float>()[e];
        if (std::isfinite(w)) size = std::max(size, std::abs(w));
        if (g == w) continue;  // equal, infinities included (an lse of +inf: no entry)
        const double d = std::abs(g - w);
        if (std::isnan(d)) return INFINITY;  // (std::max would skip it)
        diff = std::max(diff, d);
    }
    return diff / std::max(size, 1e-30);
}

// cuBLAS is opened at the first GEMM, not at start (its libraries cost a CUDA build's every process ~200 MB of
// resident memory): not mapped until then, then mapped with every entry point the backend calls bound. Runs without a
// GPU too (nothing is called).
TEST(CudaOps, CublasLoadsAtItsFirstUse) {
#if TESSERA_CUDA_EMULATOR
    GTEST_SKIP() << "the CUDA emulator's cuBLAS is linked, not opened";
#endif
    const auto mapped = [] {
        std::ifstream maps("/proc/self/maps");
        const std::string text((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
        return text.find("libcublas") != std::string::npos;
    };
    EXPECT_FALSE(mapped()) << "cuBLAS mapped before any GEMM";
    ops::cuda::load_cublas();
    EXPECT_TRUE(mapped());
    ops::cuda::load_cublas();  // once per process
}

TEST(CudaOps, EveryGoldenOfEveryCudaOpMatchesItsReference) {
    SKIP_WITHOUT_GPU();
    int checked = 0;
    for (const std::string& f : ops::golden_files(test::golden_path("ops"))) {
        const SafetensorsFile file(f);
        const ops::OpDef* op = ops::op_registry().find(file.metadata().at("op"));
        ASSERT_NE(op, nullptr) << f;
        if (!op->cuda) continue;
        ops::GoldenCheck r;
        try {  // one op's error does not hide the others'
            r = ops::check_golden(f, Device::cuda);
        } catch (const std::exception& e) {
            ADD_FAILURE() << f << " (CUDA): " << e.what();
            continue;
        }
        for (const std::string& p : r.problems) ADD_FAILURE() << r.name << " (" << r.op << ", CUDA): " << p;
        std::printf("[ cuda ] %-28s f64 %.2e  f32 %.2e\n", r.name.c_str(), r.f64_error, r.f32_error);
        ++checked;
    }
    EXPECT_GE(checked, 23) << "fewer golden cases than CUDA ops";
}

TEST(CudaOps, LinearIsBitwiseRunToRun) {
    SKIP_WITHOUT_GPU();
    Tensor x = test::randn(DType::f32, Shape{384, 256}, 1).to(Device::cuda);
    Tensor w = test::randn(DType::f32, Shape{512, 256}, 2).to(Device::cuda);
    Tensor b = test::randn(DType::f32, Shape{512}, 3).to(Device::cuda);
    Tensor dy = test::randn(DType::f32, Shape{384, 512}, 4).to(Device::cuda);
    std::vector<Tensor> runs;
    for (int r = 0; r < 2; ++r) {
        Tensor y(DType::f32, Shape{384, 512}, Device::cuda), dx(DType::f32, Shape{384, 256}, Device::cuda),
            dw(DType::f32, Shape{512, 256}, Device::cuda), db(DType::f32, Shape{512}, Device::cuda);
        ops::linear_forward({}, x, w, b, y);
        ops::linear_backward(dy, x, w, dx, dw, db);
        for (Tensor* t : {&y, &dx, &dw, &db}) runs.push_back(t->to(Device::cpu));
    }
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(test::all_close(runs[i], runs[i + 4], 0, 0)) << "tensor " << i;
}

// A frozen weight held narrow (bf16: model.lora.base_dtype; MXFP4) with f32 activations: the GPU widens the weight
// in row blocks and runs the f32 GEMMs; forward and dx against the CPU (which widens per GEMM block) at f32
// tolerance, the bias gradient too; f64 inputs are refused. The weight gradient (a trained weight read from its bf16
// copy, docs/train.md) does not read the weight: the CPU's within f32 tolerance, and the bits of the f32 weight's.
// At train.precision = bf16 the GPU reads a bf16 weight in place and dequantizes an MXFP4 one to bf16 in the same row
// blocks: against the CPU's bf16 products (the same operands, summed in another order) at f32 tolerance, and away
// from the f32 products by the activations' rounding.
TEST(CudaOps, LinearWithANarrowWeightMatchesTheCpu) {
    SKIP_WITHOUT_GPU();
    // one row block; and a weight of 300 rows of 131072 (150 MB in f32), widened in blocks of 128 rows (64 MiB)
    for (const bool at_bf16 : {false, true})
        for (const DType dt : {DType::bf16, DType::mxfp4})
            for (const auto [N, IN, OUT] :
                 {std::array<int64_t, 3>{384, 256, 512}, std::array<int64_t, 3>{8, 131072, 300}}) {
                const std::string what =
                    fmt::format("{} weight, IN {}{}", dtype_name(dt), IN, at_bf16 ? ", bf16 precision" : "");
                const Tensor x = test::randn(DType::f32, Shape{N, IN}, 1),
                             dy = test::randn(DType::f32, Shape{N, OUT}, 4);
                const Tensor wf = test::randn(DType::f32, Shape{OUT, IN}, 2),
                             b = test::randn(DType::f32, Shape{OUT}, 3);
                Tensor w(dt, wf.shape());
                if (dt == DType::bf16) {
                    for (int64_t i = 0; i < w.numel(); ++i) w.ptr<bf16>()[i] = float_to_bf16(wf.ptr<float>()[i]);
                } else {
                    f32_to_mxfp4(wf.ptr<float>(), wf.numel(), static_cast<uint8_t*>(w.view().data));
                }
                Tensor y(DType::f32, Shape{N, OUT}), dx(DType::f32, x.shape()), db(DType::f32, Shape{OUT}),
                    dw(DType::f32, wf.shape());
                Tensor y32(DType::f32, Shape{N, OUT});
                ops::linear_forward({}, x, w, b, y32);
                std::optional<ops::GemmPrecisionScope> precision;
                if (at_bf16) precision.emplace(ops::GemmPrecision::bf16);
                ops::linear_forward({}, x, w, b, y);
                ops::linear_backward(dy, x, w, dx, dw, db);
                const Tensor xg = x.to(Device::cuda), wg = w.to(Device::cuda), bg = b.to(Device::cuda),
                             dyg = dy.to(Device::cuda), wfg = wf.to(Device::cuda);
                Tensor yg(DType::f32, y.shape(), Device::cuda), dxg(DType::f32, x.shape(), Device::cuda),
                    dbg(DType::f32, Shape{OUT}, Device::cuda), dwg(DType::f32, wf.shape(), Device::cuda),
                    dwf(DType::f32, wf.shape(), Device::cuda), dxf(DType::f32, x.shape(), Device::cuda);
                ops::linear_forward({}, xg, wg, bg, yg);
                ops::linear_backward(dyg, xg, wg, dxg, dwg, dbg);
                ops::linear_backward(dyg, xg, wfg, dxf, dwf, {});
                EXPECT_TRUE(test::rel_rms_close(dwg.to(Device::cpu), dw, 1e-5)) << "dw, " << what;
                EXPECT_TRUE(test::all_close(dwg.to(Device::cpu), dwf.to(Device::cpu), 0, 0)) << "dw, " << what;
                EXPECT_TRUE(test::rel_rms_close(yg.to(Device::cpu), y, 1e-5)) << "y, " << what;
                EXPECT_TRUE(test::rel_rms_close(dxg.to(Device::cpu), dx, 1e-5)) << "dx, " << what;
                EXPECT_TRUE(test::rel_rms_close(dbg.to(Device::cpu), db, 1e-5)) << "db, " << what;
                if (at_bf16) {
                    EXPECT_FALSE(test::rel_rms_close(yg.to(Device::cpu), y32, 1e-4)) << "x must be rounded, " << what;
                }
                const Tensor x64 = test::randn(DType::f64, Shape{N, IN}, 1).to(Device::cuda);
                Tensor y64(DType::f64, y.shape(), Device::cuda);
                test::expect_error([&] { ops::linear_forward({}, x64, wg, {}, y64); }, "in a f64 product");
            }
}

// A narrow weight whose rows are stored apart (as a checkpoint's mapped experts may be) is not one device tensor: the
// GPU's linear refuses it in one line at both precisions (widened at f32; read in place at bf16), before any launch.
TEST(CudaOps, ANarrowWeightStoredApartIsAClearError) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 4, IN = 16, OUT = 2;
    Tensor rows[OUT] = {Tensor(DType::bf16, Shape{1, IN}, Device::cuda),
                        Tensor(DType::bf16, Shape{1, IN}, Device::cuda)};
    void* slices[OUT] = {rows[0].view().data, rows[1].view().data};
    TensorView w = TensorView::stored_apart(slices, DType::bf16, Shape{OUT, IN});
    w.device = Device::cuda;
    const Tensor x = test::randn(DType::f32, Shape{N, IN}, 1).to(Device::cuda);
    Tensor y(DType::f32, Shape{N, OUT}, Device::cuda);
    for (const auto precision : {ops::GemmPrecision::f32, ops::GemmPrecision::bf16}) {
        const ops::GemmPrecisionScope scope(precision);
        test::expect_error([&] { ops::linear_forward({}, x, w, {}, y); }, "linear: w must be contiguous");
    }
}

TEST(CudaOps, AdamWMatchesTheCpuOracle) {
    SKIP_WITHOUT_GPU();
    const Shape s{1000, 37};
    Tensor p = test::randn(DType::f32, s, 1), g = test::randn(DType::f32, s, 2), m = test::randn(DType::f32, s, 3, 0.1),
           v = test::uniform(DType::f32, s, 4, 0.0, 0.01);
    Tensor dp = p.to(Device::cuda), dg = g.to(Device::cuda), dm = m.to(Device::cuda), dv = v.to(Device::cuda);
    const ops::AdamWParams params{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1, .step = 7};
    ops::adamw_update(params, dp, dg, dm, dv);
    ops::adamw_update(params, p, g, m, v);
    EXPECT_TRUE(test::all_close(dp.to(Device::cpu), p, 1e-6, 1e-7));
    EXPECT_TRUE(test::all_close(dm.to(Device::cpu), m, 1e-6, 1e-7));
    EXPECT_TRUE(test::all_close(dv.to(Device::cpu), v, 1e-6, 1e-7));
}

// Runs `op` on random host tensors of these shapes and on copies of them on the GPU: afterwards every tensor agrees,
// but those listed in `private_scratch` (an op's own scratch, whose contents each backend uses its own way).
// `bf16_operands`: the GPU runs its GEMMs at GemmPrecision::bf16 and these f32 GEMM operands are rounded to bf16 on the
// host first (the products of bf16 values are exact in f32, so both sides differ by the order of the f32 sums only);
// they are not compared.
// Ops whose results sum many terms in a backend's own order (parameter gradients, GEMMs) compare in f64, where both
// backends' rounding is far below the tolerance; in f32 such sums differ by their rounding (cancellation included).
template <class Op>
void expect_cuda_like_cpu(const std::vector<Shape>& shapes,
                          Op op,
                          double rtol = 1e-5,
                          double atol = 1e-6,
                          DType dtype = DType::f32,
                          const std::vector<size_t>& private_scratch = {},
                          const std::vector<size_t>& bf16_operands = {}) {
    std::vector<Tensor> host, dev;
    std::vector<TensorView> hv, dv;
    auto listed = [](const std::vector<size_t>& l, size_t i) { return std::find(l.begin(), l.end(), i) != l.end(); };
    for (size_t i = 0; i < shapes.size(); ++i) {
        host.push_back(test::randn(dtype, shapes[i], 100 + i));
        dev.push_back(host.back().to(Device::cuda));
        if (listed(bf16_operands, i))
            for (int64_t j = 0; j < host.back().numel(); ++j) {
                float& v = host.back().ptr<float>()[j];
                v = bf16_to_float(float_to_bf16(v));
            }
    }
    for (size_t i = 0; i < host.size(); ++i) {
        hv.push_back(host[i]);
        dv.push_back(dev[i]);
    }
    op(hv);
    {
        std::optional<ops::GemmPrecisionScope> bf16;
        if (!bf16_operands.empty()) bf16.emplace(ops::GemmPrecision::bf16);
        op(dv);
    }
    for (size_t i = 0; i < host.size(); ++i) {
        if (listed(private_scratch, i) || listed(bf16_operands, i)) continue;
        EXPECT_TRUE(test::all_close(dev[i].to(Device::cpu), host[i], rtol, atol)) << "tensor " << i;
    }
}

TEST(CudaOps, RowGlueOpsMatchTheCpuOnColumnBlocks) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 300, G = 6, K = 16;
    expect_cuda_like_cpu({Shape{N, 40}, Shape{N, 50}}, [&](std::vector<TensorView> t) {
        ops::copy_rows(t[0].columns(3, 20), t[1].columns(10, 20));
        ops::copy_rows(t[0].columns(0, 8), t[1].columns(40, 8), 0.25f);
        ops::add_rows(t[0].columns(20, 10), t[1].columns(0, 10));
        ops::zero_rows(t[1].columns(30, 5), N - 7);
    });
    // blocks longer than a CUDA block's threads, empty ones, one source read twice (expert parallelism's regrouping)
    const std::vector<ops::CopyBlock> blocks{{0, 5, 700}, {700, 1000, 3}, {1234, 2000, 0}, {700, 3000, 260}};
    expect_cuda_like_cpu({Shape{N * 5}, Shape{N * 12}},
                         [&](std::vector<TensorView> t) { ops::copy_blocks(t[0], t[1], blocks); });
    {  // cast to bf16 and back: the same bits on both devices
        const Tensor x = test::randn(DType::f32, Shape{N, 40}, 3, 2.0);
        Tensor narrow(DType::bf16, x.shape()), back(DType::f32, x.shape());
        Tensor dnarrow(DType::bf16, x.shape(), Device::cuda), dback(DType::f32, x.shape(), Device::cuda);
        ops::cast(x, narrow);
        ops::cast(narrow, back);
        ops::cast(x.to(Device::cuda), dnarrow);
        ops::cast(dnarrow, dback);
        const Tensor hn = dnarrow.to(Device::cpu), hb = dback.to(Device::cpu);
        EXPECT_EQ(std::memcmp(hn.view().data, narrow.view().data, narrow.view().nbytes()), 0);
        EXPECT_EQ(std::memcmp(hb.view().data, back.view().data, back.view().nbytes()), 0);
        EXPECT_FALSE(test::all_close(back, x, 1e-6, 0)) << "rounded";
        Tensor in_place = x.to(Device::cuda);
        ops::round_to_bf16(in_place);
        const Tensor hr = in_place.to(Device::cpu);
        EXPECT_EQ(std::memcmp(hr.view().data, back.view().data, back.view().nbytes()), 0);
    }
    expect_cuda_like_cpu({Shape{N, 2 * G}, Shape{N, G}, Shape{N, G}, Shape{N, 3 * G}}, [&](std::vector<TensorView> t) {
        ops::sigmoid_forward(t[0].columns(G, G), t[1]);
        ops::sigmoid_backward(t[2], t[1], t[3].columns(G, G));
    });
    expect_cuda_like_cpu({Shape{N, G}, Shape{N, G * K}, Shape{N, G * K}, Shape{N, G}}, [&](std::vector<TensorView> t) {
        ops::expand_groups(t[0], t[1]);
        ops::sum_groups(t[2], t[3]);
    });
    expect_cuda_like_cpu(
        {Shape{N, G + 2}, Shape{N, G * K}, Shape{N, G}, Shape{N, G * K}, Shape{N, G * K}, Shape{N, G * K}, Shape{N, G}},
        [&](std::vector<TensorView> t) {
            ops::output_gate_forward(t[0].columns(2, G), t[1], t[2], t[3]);
            ops::output_gate_backward(t[4], t[1], t[2], t[5], t[6]);
        });
}

// The embedding's gradient: the tokens sorted by id on the host, each id's row summed in token order, as on the CPU,
// so the same bits: i32 and i64 ids, one id taking half the tokens, ids unused, a gradient accumulated onto.
TEST(CudaOps, EmbeddingBackwardGivesTheCpusBits) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 700, V = 50, D = 300;  // D past a block of threads
    for (DType id_dtype : {DType::i32, DType::i64}) {
        Tensor ids(id_dtype, Shape{N});
        for (int64_t n = 0; n < N; ++n) {
            const int64_t id = n % 2 == 0 ? 7 : (n * 13) % 40;
            if (id_dtype == DType::i32)
                ids.ptr<int32_t>()[n] = int32_t(id);
            else
                ids.ptr<int64_t>()[n] = id;
        }
        const Tensor dy = test::randn(DType::f32, Shape{N, D}, 5);
        Tensor dtable = test::randn(DType::f32, Shape{V, D}, 6);
        Tensor ddtable = dtable.to(Device::cuda);
        ops::embedding_backward(dy, ids, dtable);
        ops::embedding_backward(dy.to(Device::cuda), ids.to(Device::cuda), ddtable);
        const Tensor back = ddtable.to(Device::cpu);
        EXPECT_EQ(std::memcmp(back.view().data, dtable.view().data, dtable.view().nbytes()), 0) << dtype_name(id_dtype);
    }
}

// The image tower's ops (ops/vision.h) on packed images of three sizes (one at the position table's own size), as the
// tower calls them: q and k head views of a fused projection's rows, the rope in place; and the rows the model puts
// at its image tokens.
TEST(CudaOps, VisionOpsMatchTheCpu) {
    SKIP_WITHOUT_GPU();
    const std::vector<ops::PatchGrid> grids{{4, 6}, {2, 4}, {6, 8}};  // 24 + 8 + 48 patches, 6 + 2 + 12 cells
    const int64_t N = 80, M = 20, C = 24, H = 2, D = 12;
    for (DType dtype : {DType::f32, DType::f64}) {
        SCOPED_TRACE(dtype_name(dtype));
        expect_cuda_like_cpu(
            {Shape{N, C}, Shape{N, C}, Shape{N, C}, Shape{N, C}, Shape{N, C}},
            [&](std::vector<TensorView> t) {
                ops::gelu_forward(ops::Gelu::tanh, t[0], t[1]);
                ops::gelu_forward(ops::Gelu::erf, t[0].columns(2, 10), t[2].columns(4, 10));
                ops::gelu_backward(ops::Gelu::tanh, t[3], t[0], t[4]);
                ops::gelu_backward(ops::Gelu::erf, t[3].columns(0, 8), t[0].columns(8, 8), t[4].columns(16, 8));
            },
            1e-5, 1e-6, dtype);
        expect_cuda_like_cpu(
            {Shape{N, 3 * H * D}, Shape{N, H * D}},
            [&](std::vector<TensorView> t) {
                auto heads = [&](TensorView rows, int64_t col) {
                    TensorView v = rows.columns(col, H * D);
                    v.shape = Shape{N, H, D};
                    v.strides = {rows.strides[0], D, 1};
                    return v;
                };
                ops::rope_2d_forward(10000.0, grids, heads(t[0], 0), heads(t[0], 0));  // in place, as the tower
                ops::rope_2d_backward(500.0, grids, heads(t[0], H * D), heads(t[1], 0));
            },
            1e-5, 1e-6, dtype);
        expect_cuda_like_cpu(
            {Shape{4, 6, C}, Shape{N, C}, Shape{N, C}, Shape{4, 6, C}, Shape{N, C}, Shape{M, 4 * C}, Shape{M, 4 * C},
             Shape{N, C}},
            [&](std::vector<TensorView> t) {
                ops::pos_embed_forward(grids, t[0], t[1]);
                ops::pos_embed_backward(grids, t[2], t[3]);
                ops::patch_merge_forward(grids, 2, 2, t[4], t[5]);
                ops::patch_merge_backward(grids, 2, 2, t[6], t[7]);
            },
            1e-5, 1e-6, dtype);
    }
    const std::vector<int64_t> at{3, 17, 4, 40, 41};
    expect_cuda_like_cpu({Shape{5, C}, Shape{N, C + 8}, Shape{N, C}}, [&](std::vector<TensorView> t) {
        ops::scatter_rows(t[0], at, t[1].columns(8, C));
        ops::zero_rows_at(t[2], at);
    });
}

TEST(CudaOps, MatmulHeadsMatchesTheCpuInEveryTransposition) {
    SKIP_WITHOUT_GPU();
    const int64_t H = 4, M = 96, N = 40, K = 72;
    for (ops::Trans ta : {ops::Trans::N, ops::Trans::T}) {
        for (ops::Trans tb : {ops::Trans::N, ops::Trans::T}) {
            const int64_t ar = ta == ops::Trans::N ? M : K, ac = ta == ops::Trans::N ? K : M;
            const int64_t br = tb == ops::Trans::N ? K : N, bc = tb == ops::Trans::N ? N : K;
            expect_cuda_like_cpu(
                {Shape{ar, H * (ac + 3)}, Shape{br, H * bc}, Shape{M, H * (N + 1)}},
                [&](std::vector<TensorView> t) {
                    ops::matmul_heads(ta, tb, 0.5, ops::head_matrices(t[0], 1, H, ac + 3, ac),
                                      ops::head_matrices(t[1], 0, H, bc, bc), 1.0,
                                      ops::head_matrices(t[2], 0, H, N + 1, N));
                },
                1e-5, 1e-5);
        }
    }
}

// GemmPrecision::bf16 (train.precision = bf16): every f32 GEMM form the backend uses rounds its operands to bf16 and
// sums in f32 — one product, strided batches, grouped problems (experts' rows and their weight gradients) — so on
// operands rounded to bf16 the CPU's f32 GEMMs give the same values up to the order of the f32 sums. On the exact
// operands the bf16 products are within bf16's tolerance of f32 and not f32's own.
TEST(CudaOps, Bf16GemmsMatchTheCpuOnOperandsRoundedToBf16) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 96, IN = 320, OUT = 200;
    // linear forward and backward: x, w, dy rounded; y, dx, dw compared
    expect_cuda_like_cpu({Shape{N, IN}, Shape{OUT, IN}, Shape{N, OUT}, Shape{N, OUT}, Shape{N, IN}, Shape{OUT, IN}},
                         [&](std::vector<TensorView> t) {
                             ops::linear_forward({}, t[0], t[1], {}, t[3]);
                             ops::linear_backward(t[2], t[0], t[1], t[4], t[5], {});
                         },
                         1e-5, 1e-4, DType::f32, {}, {0, 1, 2});
    // a strided batch over head views, accumulating into C
    expect_cuda_like_cpu({Shape{N, 4 * 75}, Shape{64, 4 * 40}, Shape{N, 4 * 41}},
                         [&](std::vector<TensorView> t) {
                             ops::matmul_heads(
                                 ops::Trans::N, ops::Trans::N, 0.5, ops::head_matrices(t[0], 1, 4, 75, 64),
                                 ops::head_matrices(t[1], 0, 4, 40, 40), 1.0, ops::head_matrices(t[2], 0, 4, 41, 40));
                         },
                         1e-5, 1e-4, DType::f32, {}, {0, 1});
    // the grouped forms over experts' rows (one expert without rows): C[rows_e] = A[rows_e]·w_eᵀ, dw_e += dyᵀ·x; on
    // the emulator also as on a cuBLAS whose grouped GEMM lacks bf16 inputs with f32 output (one GemmEx per problem)
    const std::vector<int32_t> offsets{0, 30, 30, 75, 96};
    const ops::ExpertRows g{offsets.data(), 4};
    const int64_t F = 48, L = 64;
    auto grouped = [&](std::vector<TensorView> t) {
        const float *x = t[0].ptr<float>(), *w = t[1].ptr<float>(), *dy = t[2].ptr<float>();
        float *y = t[3].ptr<float>(), *dw = t[4].ptr<float>();
        if (t[0].device == Device::cuda) {
            ops::cuda::grouped_rows<float>(ops::Trans::T, g, F, L, 1.f, x, L, w, F * L, L, 0.f, y, F);
            ops::cuda::grouped_wgrad<float>(g, F, L, dy, F, x, L, dw, F * L, L);
        } else {
            ops::grouped_gemm(ops::Trans::T, g, F, L, x, L, w, F * L, L, 0.f, y, F);
            ops::grouped_gemm_wgrad(g, F, L, dy, F, x, L, dw, F * L, L);
        }
    };
    for (const char* grouped_ex : {"1", "0"}) {
        if (cuda_emulated()) setenv("TESSERA_CUDA_EMULATOR_GROUPED_EX", grouped_ex, 1);
        expect_cuda_like_cpu({Shape{N, L}, Shape{4, F, L}, Shape{N, F}, Shape{N, F}, Shape{4, F, L}}, grouped, 1e-5,
                             1e-4, DType::f32, {}, {0, 1, 2});
    }
    unsetenv("TESSERA_CUDA_EMULATOR_GROUPED_EX");
    // on the exact operands: bf16's rounding, not f32's
    const Tensor x = test::randn(DType::f32, Shape{N, IN}, 1), w = test::randn(DType::f32, Shape{OUT, IN}, 2);
    Tensor y(DType::f32, Shape{N, OUT}), yg(DType::f32, Shape{N, OUT}, Device::cuda);
    ops::linear_forward({}, x, w, {}, y);
    {
        const ops::GemmPrecisionScope bf16(ops::GemmPrecision::bf16);
        ops::linear_forward({}, x.to(Device::cuda), w.to(Device::cuda), {}, yg);
    }
    EXPECT_TRUE(test::rel_rms_close(yg.to(Device::cpu), y, 1e-2));
    EXPECT_FALSE(test::rel_rms_close(yg.to(Device::cpu), y, 1e-4));
    EXPECT_EQ(ops::gemm_precision(), ops::GemmPrecision::f32) << "the scope restores f32";
}

// The KDA and MLA blocks' small ops as the blocks call them: column blocks, strided head views, rope in place,
// packed sequences, frozen weights (absent gradients), several decoding steps of the conv window.
TEST(CudaOps, BlockSmallOpsMatchTheCpuAsTheBlocksCallThem) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 200, H = 3, K = 32;
    expect_cuda_like_cpu({Shape{N, 3 * H * K}, Shape{N, H * K}, Shape{N, H * K}, Shape{N, 3 * H * K}},
                         [&](std::vector<TensorView> t) {
                             ops::l2norm_forward({}, t[0].columns(K, K), t[1].columns(2 * K, K));
                             ops::l2norm_backward({}, t[2].columns(0, K), t[0].columns(K, K), t[3].columns(5, K));
                         });
    for (const bool interleaved : {false, true}) {
        const ops::RopeParams rope{.theta = 500.0, .offset = 7, .interleaved = interleaved};
        expect_cuda_like_cpu({Shape{2, 50, H, K + 6}, Shape{2, 50, H, K + 6}}, [&](std::vector<TensorView> t) {
            ops::rope_forward(rope, t[0].narrow(3, 2, K), t[0].narrow(3, 2, K));  // in place, strided
            ops::rope_backward(rope, t[1].narrow(3, 0, K), t[0].narrow(3, 4, K));
        });
    }
    expect_cuda_like_cpu({Shape{N, K + 3}, Shape{N, K}, Shape{K}, Shape{N, K}, Shape{N, K}, Shape{N, K}, Shape{K}},
                         [&](std::vector<TensorView> t) {
                             const ops::GatedRmsNormParams p{.activation = ops::GateActivation::silu};
                             ops::gated_rmsnorm_forward(p, t[0].columns(3, K), t[1], t[2], t[3]);
                             ops::gated_rmsnorm_backward(p, t[4], t[0].columns(3, K), t[1], t[2], t[5], {}, t[6]);
                         });
    expect_cuda_like_cpu(
        {Shape{N, 2 * K}, Shape{K}, Shape{K}, Shape{N, K}, Shape{N}, Shape{N}, Shape{N, K}, Shape{N, 2 * K}},
        [&](std::vector<TensorView> t) {
            ops::layernorm_forward({}, t[0].columns(K, K), t[1], t[2], t[3], t[4], t[5]);
            ops::layernorm_backward({}, t[6], t[0].columns(K, K), t[1], t[4], t[5], t[7].columns(0, K), {},
                                    {});  // frozen weight and bias
        });
    for (const bool frozen : {false, true}) {  // Attention Residuals over 3 stored activations
        const int64_t C = 96, S = 3;
        expect_cuda_like_cpu({Shape{N, C}, Shape{N, C}, Shape{N, C}, Shape{C}, Shape{C}, Shape{N, C}, Shape{N, S},
                              Shape{ops::attn_res_mix_scratch(N, S, C)}, Shape{N, C}, Shape{N, C}, Shape{N, C},
                              Shape{N, C}, Shape{C}, Shape{C}},
                             [&](std::vector<TensorView> t) {
                                 const std::vector<TensorView> src{t[0], t[1], t[2]}, dsrc{t[9], t[10], t[11]};
                                 ops::attn_res_mix_forward({}, src, t[3], t[4], t[5], t[6], t[7]);
                                 ops::attn_res_mix_backward({}, t[8], src, t[3], t[4], t[6], dsrc,
                                                            frozen ? TensorView{} : t[12],
                                                            frozen ? TensorView{} : t[13], t[7]);
                             },
                             1e-10, 1e-10, DType::f64, {7});
    }
    for (const double lower_bound : {0.0, -5.0}) {  // GDN's scalar gate (K = 1) and KDA's safe form
        const int64_t k = lower_bound == 0 ? 1 : K;
        expect_cuda_like_cpu(
            {Shape{N, H, k}, Shape{H}, Shape{H, k}, Shape{N, H, k}, Shape{N, H, k}, Shape{N, H, k}, Shape{H},
             Shape{H, k}},
            [&](std::vector<TensorView> t) {
                const ops::KdaGateParams p{.lower_bound = lower_bound};
                ops::kda_gate_forward(p, t[0], t[1], t[2], t[3]);
                ops::kda_gate_backward(p, t[4], t[0], t[1], t[2], t[5], t[6], t[7]);
            },
            1e-10, 1e-10, DType::f64);
    }
}

// The parameter gradients sum columns over slabs of 256 rows, then the slabs in order: 700 rows are three slabs, the
// last one short; each gradient accumulates into what it holds (random here).
TEST(CudaOps, ParameterGradientsSumOverRowSlabsAsTheCpu) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 700, D = 40;
    for (const DType dtype : {DType::f64, DType::f32}) {
        const double tol = dtype == DType::f64 ? 1e-12 : 1e-4;
        expect_cuda_like_cpu(
            {Shape{N, D}, Shape{D}, Shape{N}, Shape{N, D}, Shape{N, D}, Shape{D}},
            [&](std::vector<TensorView> t) {
                ops::rmsnorm_forward({}, t[0], t[1], t[3], t[2]);
                ops::rmsnorm_backward({}, t[4], t[0], t[1], t[2], {}, t[5]);
            },
            tol, tol, dtype);
        expect_cuda_like_cpu(
            {Shape{N, D}, Shape{D}, Shape{D}, Shape{N, D}, Shape{N}, Shape{N}, Shape{N, D}, Shape{D}, Shape{D}},
            [&](std::vector<TensorView> t) {
                ops::layernorm_forward({}, t[0], t[1], t[2], t[3], t[4], t[5]);
                ops::layernorm_backward({}, t[6], t[0], t[1], t[4], t[5], {}, t[7], t[8]);
            },
            tol, tol, dtype);
        expect_cuda_like_cpu(
            {Shape{N, D}, Shape{N, D}, Shape{D}, Shape{N, D}, Shape{D}},
            [&](std::vector<TensorView> t) { ops::gated_rmsnorm_backward({}, t[3], t[0], t[1], t[2], {}, {}, t[4]); },
            tol, tol, dtype);
        expect_cuda_like_cpu(
            {Shape{N, D}, Shape{N, 24}, Shape{24, D}, Shape{24}},
            [&](std::vector<TensorView> t) { ops::linear_backward(t[1], t[0], t[2], {}, {}, t[3]); }, tol, tol, dtype);
    }
    const int64_t H = 3, K = 8, S = 3;  // the KDA gate's dA_log and ddt_bias; the AttnRes mix's dγ and dw
    expect_cuda_like_cpu(
        {Shape{N, H, K}, Shape{H}, Shape{H, K}, Shape{N, H, K}, Shape{N, H, K}, Shape{N, H, K}, Shape{H}, Shape{H, K}},
        [&](std::vector<TensorView> t) {
            const ops::KdaGateParams p{.lower_bound = -5.0};
            ops::kda_gate_forward(p, t[0], t[1], t[2], t[3]);
            ops::kda_gate_backward(p, t[4], t[0], t[1], t[2], t[5], t[6], t[7]);
        },
        1e-10, 1e-10, DType::f64);
    expect_cuda_like_cpu({Shape{N, D}, Shape{N, D}, Shape{N, D}, Shape{D}, Shape{D}, Shape{N, D}, Shape{N, S},
                          Shape{ops::attn_res_mix_scratch(N, S, D)}, Shape{N, D}, Shape{N, D}, Shape{N, D}, Shape{N, D},
                          Shape{D}, Shape{D}},
                         [&](std::vector<TensorView> t) {
                             const std::vector<TensorView> src{t[0], t[1], t[2]}, dsrc{t[9], t[10], t[11]};
                             ops::attn_res_mix_forward({}, src, t[3], t[4], t[5], t[6], t[7]);
                             ops::attn_res_mix_backward({}, t[8], src, t[3], t[4], t[6], dsrc, t[12], t[13], t[7]);
                         },
                         1e-10, 1e-10, DType::f64, {7});
    // the conv's dw: packed sequences across the slabs' edges (a slab starts inside a sequence), then batch rows
    const std::vector<int64_t> cu{0, 1, 250, 300, 700};
    expect_cuda_like_cpu(
        {Shape{1, N, D}, Shape{D, 4}, Shape{1, N, D}, Shape{1, N, D}, Shape{1, N, D}, Shape{D, 4}},
        [&](std::vector<TensorView> t) {
            ops::causal_conv1d_forward({}, t[0], t[1], t[2], cu);
            ops::causal_conv1d_backward({}, t[3], t[0], t[1], t[4], t[5], cu);
        },
        1e-10, 1e-10, DType::f64);
    expect_cuda_like_cpu(
        {Shape{3, 300, D}, Shape{D, 3}, Shape{3, 300, D}, Shape{D, 3}},
        [&](std::vector<TensorView> t) {
            ops::causal_conv1d_backward({.activation = ops::Activation::none}, t[2], t[0], t[1], {}, t[3]);
        },
        1e-10, 1e-10, DType::f64);
}

TEST(CudaOps, CausalConvMatchesTheCpuOnPackedSequencesAndDecodingSteps) {
    SKIP_WITHOUT_GPU();
    const int64_t T = 90, C = 48, W = 4;
    const std::vector<int64_t> cu{0, 1, 30, 33, 90};  // a one-token sequence, and one shorter than the window
    for (const auto act : {ops::Activation::silu, ops::Activation::none}) {
        expect_cuda_like_cpu(
            {Shape{1, T, C}, Shape{C, W}, Shape{1, T, C}, Shape{1, T, C}, Shape{1, T, C}, Shape{C, W}},
            [&](std::vector<TensorView> t) {
                const ops::CausalConv1dParams p{.activation = act};
                ops::causal_conv1d_forward(p, t[0], t[1], t[2], cu);
                ops::causal_conv1d_backward(p, t[3], t[0], t[1], t[4], t[5], cu);
            },
            1e-5, 1e-5);
    }
    expect_cuda_like_cpu(
        {Shape{3, T, C}, Shape{C, W}, Shape{3, T, C}, Shape{3, T, C}, Shape{C, W}},
        [&](std::vector<TensorView> t) {  // batch rows, dw only
            ops::causal_conv1d_forward({}, t[0], t[1], t[2]);
            ops::causal_conv1d_backward({}, t[3], t[0], t[1], {}, t[4]);
        },
        1e-5, 1e-5);
    expect_cuda_like_cpu(
        {Shape{4, 5, C}, Shape{C, W}, Shape{5, W - 1, C}, Shape{4, 5, C}}, [&](std::vector<TensorView> t) {
            for (int64_t step = 0; step < 4; ++step)  // 5 rows, one token each step; the window moves on each time
                ops::causal_conv1d_step({.activation = ops::Activation::silu},
                                        t[0].slice0(step, step + 1).reshape(Shape{5, C}), t[1], t[2],
                                        t[3].slice0(step, step + 1).reshape(Shape{5, C}));
        });
}

// Attention as the blocks call it: q, k, v head views of one fused projection row (strided over T and H), GQA,
// packed sequences (one of a single token, one that ends a query tile early) and batch rows, causal and not, a head
// dim that is not a multiple of the chunk; backward accumulates into gradients that hold values already.
TEST(CudaOps, AttentionMatchesTheCpuOnPackedSequencesAndHeadViews) {
    SKIP_WITHOUT_GPU();
    const int64_t H = 4, HKV = 2, D = 40, W = (H + 2 * HKV) * D;
    auto heads = [&](TensorView fused, int64_t B, int64_t T, int64_t col, int64_t n) {
        TensorView v(static_cast<float*>(fused.data) + col, DType::f32, Shape{B, T, n, D}, fused.device);
        v.strides = {T * W, W, D, 1};
        return v;
    };
    struct Case {
        int64_t B, T;
        std::vector<int64_t> cu;
        bool causal;
    };
    for (const Case& c : {Case{1, 150, {0, 1, 64, 65, 150}, true}, Case{1, 150, {0, 1, 64, 65, 150}, false},
                          Case{2, 70, {}, true}, Case{2, 70, {}, false}}) {
        const int64_t B = c.B, T = c.T;
        expect_cuda_like_cpu(
            {Shape{B, T, W}, Shape{B, T, H, D}, Shape{B, H, T}, Shape{B, T, H, D}, Shape{B, T, W}},
            [&](std::vector<TensorView> t) {
                const ops::AttentionParams p{.scale = 0.3, .causal = c.causal};
                std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f32, T, D, omp_get_max_threads()));
                TensorView q = heads(t[0], B, T, 0, H), k = heads(t[0], B, T, H * D, HKV),
                           v = heads(t[0], B, T, (H + HKV) * D, HKV);
                ops::attention_forward(p, q, k, v, t[1], t[2], ws, c.cu);
                ops::attention_backward(p, t[3], q, k, v, t[1], t[2], heads(t[4], B, T, 0, H),
                                        heads(t[4], B, T, H * D, HKV), heads(t[4], B, T, (H + HKV) * D, HKV), ws, c.cu);
            },
            1e-5, 1e-5);
    }
}

// Attention on tensor cores (train.precision = bf16, f32 data: q, k, v, dO, P and dS rounded to bf16, f32 sums)
// against the CPU's f32, with the shapes of the f32 test (head views, GQA, packed sequences whose tiles end off the
// warps' 16 rows, D = 40 padded to 48) and MLA's absorbed 576 dims (blocks of 2 and 1 warps, chunks of 32 and 16).
// Every output within bf16's precision of the CPU, not f32's bits, and bitwise run to run. With q = 0 every visible
// key scores the same, so each output row is the mean of the value rows it sees: exact in bf16's P = 1, and so the
// forward's masking is checked at f32 precision.
TEST(CudaOps, AttentionOnTensorCoresMatchesTheCpuWithinBf16) {
    SKIP_WITHOUT_GPU();
    struct Case {
        int64_t B, T, H, HKV, D;
        std::vector<int64_t> cu;
        bool causal;
    };
    for (const Case& c :
         {Case{1, 150, 4, 2, 40, {0, 1, 64, 65, 150}, true}, Case{1, 150, 4, 2, 40, {0, 1, 64, 65, 150}, false},
          Case{2, 70, 4, 2, 40, {}, true}, Case{1, 40, 2, 1, 576, {0, 17, 40}, true}}) {
        const int64_t B = c.B, T = c.T, H = c.H, HKV = c.HKV, D = c.D;
        const ops::AttentionParams p{.scale = 0.3, .causal = c.causal};
        for (const bool zero_q : {false, true}) {
            std::vector<Tensor> host;
            host.push_back(zero_q ? Tensor(DType::f32, Shape{B, T, H, D})
                                  : test::randn(DType::f32, Shape{B, T, H, D}, 1));
            host.push_back(test::randn(DType::f32, Shape{B, T, HKV, D}, 2));  // k
            host.push_back(test::randn(DType::f32, Shape{B, T, HKV, D}, 3));  // v
            if (zero_q)  // values exact in bf16: the mean of a row's visible values is the same sum on both sides
                ops::round_to_bf16(host.back());
            host.push_back(Tensor(DType::f32, Shape{B, T, H, D}));                 // o
            host.push_back(Tensor(DType::f32, Shape{B, H, T}));                    // lse
            host.push_back(test::randn(DType::f32, Shape{B, T, H, D}, 4));         // do
            host.push_back(test::randn(DType::f32, Shape{B, T, H, D}, 5, 0.1));    // dq
            host.push_back(test::randn(DType::f32, Shape{B, T, HKV, D}, 6, 0.1));  // dk
            host.push_back(test::randn(DType::f32, Shape{B, T, HKV, D}, 7, 0.1));  // dv
            std::vector<Tensor> dev, again;
            for (const Tensor& t : host) {
                dev.push_back(t.to(Device::cuda));
                again.push_back(t.to(Device::cuda));
            }
            std::vector<std::byte> ws(ops::attention_workspace_bytes(DType::f32, T, D, omp_get_max_threads()));
            for (std::vector<Tensor>* x : {&host, &dev, &again}) {
                std::optional<ops::GemmPrecisionScope> precision;
                if (x != &host) precision.emplace(ops::GemmPrecision::bf16);
                auto& t = *x;
                ops::attention_forward(p, t[0], t[1], t[2], t[3], t[4], ws, c.cu);
                ops::attention_backward(p, t[5], t[0], t[1], t[2], t[3], t[4], t[6], t[7], t[8], ws, c.cu);
            }
            double worst = 0;
            for (size_t i = 3; i < host.size(); ++i) {
                const Tensor got = dev[i].to(Device::cpu);
                EXPECT_TRUE(test::bitwise_equal(again[i].to(Device::cpu), got)) << "tensor " << i;
                if (i == 5) continue;  // dO, an input
                const double diff = largest_difference(got, host[i]);
                EXPECT_LT(diff, 1.5e-2) << "tensor " << i << ", D " << D << (c.causal ? " causal" : "");
                if (zero_q && i <= 4) {
                    EXPECT_TRUE(test::all_close(got, host[i], 1e-5, 1e-5)) << "tensor " << i << ", q = 0, D " << D;
                } else {
                    worst = std::max(worst, diff);
                }
            }
            std::printf("[ attention ] D %lld%s%s: largest difference %.1e of the largest value\n", (long long)D,
                        c.causal ? " causal" : "", zero_q ? " q = 0" : "", worst);
            EXPECT_GT(worst, 1e-4) << "bf16 operands must show";
        }
    }
}

// A head dim whose blocks do not fit the device's shared memory is a one-line error before any launch: f64's scalar
// kernels at 512 dims, and at train.precision = bf16 the tensor-core kernels at 2048 (one warp and 16 keys a step
// would need 330 KB; MLA's 576 dims fit).
TEST(CudaOps, AttentionWithAHeadDimBeyondSharedMemoryIsAClearError) {
    SKIP_WITHOUT_GPU();
    for (const auto& [dtype, D, bf16, message] :
         {std::tuple{DType::f64, int64_t(512), false, "attention (CUDA): head dim 512 needs"},
          std::tuple{DType::f32, int64_t(2048), true, "attention (CUDA, bf16): head dim 2048 needs"}}) {
        std::optional<ops::GemmPrecisionScope> precision;
        if (bf16) precision.emplace(ops::GemmPrecision::bf16);
        const Tensor q = test::randn(dtype, Shape{1, 4, 1, D}, 1).to(Device::cuda);
        Tensor o(dtype, Shape{1, 4, 1, D}, Device::cuda), lse(dtype, Shape{1, 1, 4}, Device::cuda);
        test::expect_error([&] { ops::attention_forward({}, q, q, q, o, lse, {}); }, message);
    }
}

// KDA on the GPU against the CPU, forward and backward (accumulating), with GVA, packed sequences (one of a single
// token, one not a whole number of chunks), h0 and dht: the fused token recurrence against the CPU's (mode
// recurrent, f32 tolerance), and the chunked kernels against the CPU's chunked mode with the forward's saved states
// and without them (the backward's own forward pass). The last case holds one chunk of slots at a time (a scratch
// budget of 1 MiB), so every sequence crosses windows, under strong decay (gates down to −6: a chunk's cumulative
// gate passes exp's underflow). Each GPU case runs twice: bitwise the same. At train.precision = bf16 (the last two
// cases) the chunked kernels' block products run on tensor cores with operands rounded to bf16, against the CPU's f32:
// within a bf16 tolerance, and visibly not f32's bits.
TEST(CudaOps, KdaMatchesTheCpuWithGvaPackedSequencesAndSavedStates) {
    SKIP_WITHOUT_GPU();
    struct Case {
        ops::KdaMode mode;
        bool save;
        int64_t T, K, V, C;
        std::vector<int64_t> cu;
        double g_min, tol;
        const char* scratch_mb;
        bool bf16 = false;
    };
    for (const Case& c : {Case{ops::KdaMode::recurrent, false, 100, 32, 48, 32, {0, 1, 40, 100}, -0.4, 1e-5, nullptr},
                          Case{ops::KdaMode::chunk, true, 100, 32, 48, 32, {0, 1, 40, 100}, -0.4, 1e-5, nullptr},
                          Case{ops::KdaMode::chunk, false, 100, 32, 48, 32, {0, 1, 40, 100}, -0.4, 1e-5, nullptr},
                          Case{ops::KdaMode::chunk, false, 150, 64, 64, 64, {0, 70, 150}, -6.0, 1e-5, "1"},
                          Case{ops::KdaMode::chunk, true, 100, 32, 48, 32, {0, 1, 40, 100}, -0.4, 3e-2, nullptr, true},
                          Case{ops::KdaMode::chunk, false, 150, 64, 64, 64, {0, 70, 150}, -6.0, 3e-2, "1", true}}) {
        std::optional<ops::GemmPrecisionScope> precision;
        if (c.bf16) precision.emplace(ops::GemmPrecision::bf16);
        const int64_t T = c.T, H = 2, HV = 4, K = c.K, V = c.V, N = int64_t(c.cu.size()) - 1;
        const ops::KdaParams p{.chunk_size = c.C, .mode = c.mode};
        std::vector<Tensor> host;
        host.push_back(test::randn(DType::f32, Shape{1, T, H, K}, 1, 0.3));   // q
        host.push_back(test::randn(DType::f32, Shape{1, T, H, K}, 2, 0.15));  // k: β·|k|² < 1, a stable delta rule
        host.push_back(test::randn(DType::f32, Shape{1, T, HV, V}, 3));       // v
        host.push_back(test::uniform(DType::f32, Shape{1, T, HV, K}, 4, c.g_min, -0.01));                      // g
        host.push_back(test::uniform(DType::f32, Shape{1, T, HV}, 5, 0.1, 0.9));                               // beta
        host.push_back(test::randn(DType::f32, Shape{N, HV, K, V}, 6, 0.1));                                   // h0
        host.push_back(Tensor(DType::f32, Shape{1, T, HV, V}));                                                // o
        host.push_back(Tensor(DType::f32, Shape{N, HV, K, V}));                                                // ht
        host.push_back(test::randn(DType::f32, Shape{1, T, HV, V}, 7));                                        // do
        host.push_back(test::randn(DType::f32, Shape{N, HV, K, V}, 8, 0.1));                                   // dht
        for (size_t i = 0; i < 6; ++i) host.push_back(test::randn(DType::f32, host[i].shape(), 20 + i, 0.1));  // grads
        const ops::KdaInputs shapes{host[0], host[1], host[2], host[3], host[4], host[5], c.cu};
        if (c.save) host.emplace_back(DType::f32, ops::kda_saved_states_shape(p, shapes));
        std::vector<Tensor> dev, again;  // the GPU twice: bitwise the same
        for (const Tensor& t : host) {
            dev.push_back(t.to(Device::cuda));
            again.push_back(t.to(Device::cuda));
        }
        std::vector<std::byte> ws(ops::kda_workspace_bytes(p, shapes, true, omp_get_max_threads(), c.save));
        if (c.scratch_mb) setenv("TESSERA_KDA_CHUNK_SCRATCH_MB", c.scratch_mb, 1);
        for (std::vector<Tensor>* t : {&host, &dev, &again}) {
            auto& x = *t;
            const ops::KdaInputs in{x[0], x[1], x[2], x[3], x[4], x[5], c.cu};
            const TensorView saved = c.save ? TensorView(x[16]) : TensorView();
            ops::kda_forward(p, in, x[6], x[7], ws, saved);
            ops::kda_backward(p, in, x[8], x[9], {x[10], x[11], x[12], x[13], x[14], x[15]}, ws, saved);
        }
        unsetenv("TESSERA_KDA_CHUNK_SCRATCH_MB");
        if (c.mode == ops::KdaMode::chunk && !c.save) {  // a budget that is not a positive number of MiB
            setenv("TESSERA_KDA_CHUNK_SCRATCH_MB", "0.5", 1);
            const ops::KdaInputs in{dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], c.cu};
            try {
                ops::kda_forward(p, in, dev[6], dev[7], ws);
                ADD_FAILURE() << "a scratch budget of 0.5 MiB must be refused";
            } catch (const Error& e) {
                EXPECT_STREQ(e.what(), "TESSERA_KDA_CHUNK_SCRATCH_MB: '0.5' is not a positive whole number of MiB");
            }
            unsetenv("TESSERA_KDA_CHUNK_SCRATCH_MB");
        }
        double worst = 0;  // the largest difference from the CPU, relative to the tensor's largest value
        for (size_t i = 6; i < host.size(); ++i) {
            const Tensor got = dev[i].to(Device::cpu);
            EXPECT_TRUE(test::all_close(got, host[i], c.tol, c.tol))
                << "tensor " << i << ", case T " << T << (c.save ? " with saved states" : "")
                << (c.bf16 ? " bf16" : "");
            EXPECT_TRUE(test::bitwise_equal(again[i].to(Device::cpu), got)) << "tensor " << i;
            worst = std::max(worst, largest_difference(got, host[i]));
        }
        std::printf("[ kda ] %s%s T %lld: largest difference %.1e of the largest value\n",
                    c.mode == ops::KdaMode::chunk ? "chunk" : "recurrent", c.bf16 ? " bf16" : "", (long long)T, worst);
        if (c.bf16) {  // 3.0e-3 and 4.7e-3 on the emulator
            EXPECT_LT(worst, 1.5e-2);
            EXPECT_GT(worst, 1e-4) << "bf16 operands must show";  // 6.1e-3 sparse, 3.2e-3 dense on the emulator
        }
    }
}

// Decoding's ops on the GPU against the CPU: GQA heads read from a fused projection row over a cache of 3 sequences
// (all 1100 rows: three splits of the entries, then the first 17), MQA over an entry cache whose values are each
// entry's first dims, with selected rows (−1 padded: with 600 of 17, a split of padding only) and a strided output;
// the indexer's selection over the cache (more rows than topk, and fewer), which must be the CPU's exactly.
TEST(CudaOps, CachedAttentionAndIndexSelectionMatchTheCpu) {
    SKIP_WITHOUT_GPU();
    const int64_t B = 3, L = 1100, H = 4, HKV = 2, D = 16, W = (H + 2 * HKV) * D, DK = 24, DV = 16, HI = 2, DI = 8;
    std::vector<Tensor> host;  // the GQA row, its key and value caches; MLA's q̂ and entries; the indexer's q, w, keys
    for (const Shape& shape : {Shape{B, W}, Shape{B, L, HKV * D}, Shape{B, L, HKV * D}, Shape{B, H, DK},
                               Shape{B, L, DK}, Shape{B, HI, DI}, Shape{B, HI}, Shape{B, L, DI}})
        host.push_back(test::randn(DType::f32, shape, 1 + host.size()));
    std::vector<Tensor> dev;
    for (const Tensor& t : host) dev.push_back(t.to(Device::cuda));
    auto with_strides = [](TensorView v, Shape shape, std::vector<int64_t> strides) {
        v.shape = shape;
        for (size_t i = 0; i < strides.size(); ++i) v.strides[i] = strides[i];
        return v;
    };
    for (const int64_t len : {L, int64_t(17)}) {
        for (const int64_t topk : {int64_t(8), int64_t(600)}) {
            Tensor gqa[2], mqa[2], rows[2];  // CPU, GPU
            for (int side = 0; side < 2; ++side) {
                const std::vector<Tensor>& t = side == 0 ? host : dev;
                const Device d = side == 0 ? Device::cpu : Device::cuda;
                Tensor o(DType::f32, Shape{B, H, D}, d), oc(DType::f32, Shape{B, H, 2 * DV}, d),
                    r(DType::i32, Shape{B, topk}, d);
                const Shape kv{B, L, HKV, D};
                ops::cached_attention(0.25, with_strides(t[0], Shape{B, H, D}, {W, D, 1}), t[1].view().reshape(kv),
                                      t[2].view().reshape(kv), {}, len, o);
                ops::cached_index_topk(t[5], t[6], t[7], len, r);
                ops::cached_attention(0.2, t[3], t[4].view().reshape(Shape{B, L, 1, DK}),
                                      with_strides(t[4], Shape{B, L, 1, DV}, {L * DK, DK, DK, 1}), r, len,
                                      with_strides(oc, Shape{B, H, DV}, {H * 2 * DV, 2 * DV, 1}));
                gqa[side] = o.to(Device::cpu);
                mqa[side] = oc.to(Device::cpu);
                rows[side] = r.to(Device::cpu);
            }
            EXPECT_TRUE(test::all_close(gqa[1], gqa[0], 1e-6, 1e-6)) << "GQA, len " << len;
            EXPECT_TRUE(test::all_close(mqa[1], mqa[0], 1e-6, 1e-6)) << "MQA, len " << len << ", topk " << topk;
            EXPECT_TRUE(test::bitwise_equal(rows[1], rows[0])) << "len " << len << ", topk " << topk;
            const int32_t* r = rows[0].ptr<int32_t>();
            EXPECT_GE(r[std::min(topk, len) - 1], 0);
            if (topk > len) {
                EXPECT_EQ(r[len], -1);
            }
        }
    }
}

// Index rows [B, T, K] for the sparse attention tests: entries s <= t repeating positions, every third entry past
// the row's middle −1, one out of range every fifth query, each row's first entry its own token, but query 1 of the
// first batch row selects nothing (all −1: lse +inf, o and dq 0). Rows longer than the sequence (K > T) hold −1 in
// their first 1024 entries (the window the dkv kernels pick their keys from), so a block of another key range than the
// own token's meets a query's entries in its second window only. `sorted`: every other row sorted as the indexer writes
// it (its entries ascending with repeats, the −1 and out-of-range ones after), which the dkv blocks binary-search for
// their key range.
Tensor sparse_rows(int64_t B, int64_t T, int64_t K, bool sorted) {
    Tensor idx(DType::i32, Shape{B, T, K});
    int32_t* ix = idx.ptr<int32_t>();
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t t = bt % T;
        for (int64_t i = 0; i < K; ++i) {
            const int64_t sel = K > T    ? (i < 1024 ? -1 : (t * 7 + i * 5) % (t + 1))
                                : i <= t ? (t * 7 + i * 5) % (t + 1)
                                         : -1;
            ix[bt * K + i] = int32_t(i == 3 && t % 5 == 0 ? T + 2 : i % 3 == 2 && i > t / 2 ? -1 : sel);
        }
        ix[bt * K] = int32_t(t);
        if (bt == 1) std::fill_n(ix + bt * K, K, -1);
        if (sorted && t % 2 == 0) {
            int32_t* row = ix + bt * K;
            auto kept = [T](int32_t sel) { return sel >= 0 && sel < T; };
            std::sort(row, std::stable_partition(row, row + K, kept));
        }
    }
    return idx;
}

// DSA's sparse attention on the GPU against the CPU: forward, the indexer's teacher probabilities and backward with
// its slabbed dkv scatter, over rows with −1 padding, out-of-range entries, and entries shared by many queries;
// MQA with values the first DV dims of each entry. The shapes walk the kernels' tiling: fewer heads than a block's
// group and two groups (the second partial), rows of one chunk and of several with a partial last, entries of more
// than 256 dims, dkv blocks over one key range per slab, two (T 300 and 260) and four (T 256, whose rows of 1100
// entries also cross the 1024-entry windows the blocks pick their keys from), with rows as the indexer sorts them
// between the others in the `sorted` cases. At train.precision = bf16 (the bf16 cases: two head groups, the second
// partial; entries not a whole number of 16 dims; one head group over rows of two dkv steps; four key ranges and two
// windows) every kernel runs on tensor cores with bf16 operands: every output within bf16's precision of the CPU's
// f32, not f32's bits.
TEST(CudaOps, SparseAttentionMatchesTheCpuWithPaddingAndSharedEntries) {
    SKIP_WITHOUT_GPU();
    struct Case {
        int64_t B, T, H, DK, DV, K;
        bool bf16 = false, sorted = false;
    };
    for (const Case c : {Case{2, 40, 3, 24, 16, 12}, Case{2, 300, 20, 72, 64, 40}, Case{2, 260, 17, 300, 260, 20},
                         Case{1, 60, 5, 300, 260, 20}, Case{1, 256, 3, 40, 32, 1100},
                         Case{2, 300, 20, 72, 64, 40, false, true}, Case{1, 256, 3, 40, 32, 1100, false, true},
                         Case{2, 300, 20, 72, 64, 40, true}, Case{1, 60, 5, 300, 260, 20, true},
                         Case{2, 120, 5, 72, 64, 40, true}, Case{1, 256, 3, 40, 32, 1100, true, true}}) {
        const auto [B, T, H, DK, DV, K, bf16, sorted] = c;
        std::optional<ops::GemmPrecisionScope> precision;
        if (bf16) precision.emplace(ops::GemmPrecision::bf16);
        const Tensor idx = sparse_rows(B, T, K, sorted);
        const ops::SparseAttentionParams p{.dv = DV, .dkv_slabs = 3};  // scale DK^-0.5
        std::vector<Tensor> host;
        host.push_back(test::randn(DType::f32, Shape{B, T, H, DK}, 1));       // q
        host.push_back(test::randn(DType::f32, Shape{B, T, DK}, 2));          // kv
        host.push_back(Tensor(DType::f32, Shape{B, T, H, DV}));               // o
        host.push_back(Tensor(DType::f32, Shape{B, T, H}));                   // lse
        host.push_back(test::randn(DType::f32, Shape{B, T, K}, 6));           // probs (each element written)
        host.push_back(test::randn(DType::f32, Shape{B, T, H, DV}, 3));       // do
        host.push_back(test::randn(DType::f32, Shape{B, T, H, DK}, 4, 0.1));  // dq
        host.push_back(test::randn(DType::f32, Shape{B, T, DK}, 5, 0.1));     // dkv
        std::vector<Tensor> dev;
        for (const Tensor& t : host) dev.push_back(t.to(Device::cuda));
        const Tensor dev_idx = idx.to(Device::cuda);
        std::vector<std::byte> ws(
            ops::sparse_attention_workspace_bytes(DType::f32, p, B, T, H, DK, K, omp_get_max_threads()));
        for (auto [x, ind] : {std::pair{&host, TensorView(idx)}, std::pair{&dev, TensorView(dev_idx)}}) {
            auto& t = *x;
            ops::sparse_attention_forward(p, t[0], t[1], ind, t[2], t[3], ws);
            ops::sparse_attention_probs(p, t[0], t[1], ind, t[3], t[4], ws);
            ops::sparse_attention_backward(p, t[5], t[0], t[1], ind, t[2], t[3], t[6], t[7], ws);
        }
        double worst = 0;
        for (size_t i = 2; i < host.size(); ++i) {
            const Tensor got = dev[i].to(Device::cpu);
            const double diff = largest_difference(got, host[i]);
            if (bf16) {  // against the largest value: dkv's sums cancel, so its small elements carry more error
                EXPECT_LT(diff, 1.5e-2) << "tensor " << i << ", H " << H << " DK " << DK << " bf16";
            } else {
                EXPECT_TRUE(test::all_close(got, host[i], 1e-5, 1e-5))
                    << "tensor " << i << ", H " << H << " DK " << DK << " T " << T;
            }
            worst = std::max(worst, diff);
        }
        std::printf("[ sparse ] H %lld DK %lld%s: largest difference %.1e of the largest value\n", (long long)H,
                    (long long)DK, bf16 ? " bf16" : "", worst);
        if (bf16) {
            EXPECT_GT(worst, 1e-4) << "bf16 operands must show";  // 3.8e-3 and 4.4e-3 on the emulator
        }
    }
}

// The dkv scatter's bits do not depend on how many key ranges split its slabs: every key's row takes its queries
// ascending and their entries in row order, whichever block owns it. A batch of two rows (two key ranges per slab)
// and its first row alone (four; the slab count is the same) give the same dq and dkv bits for that row, on the
// scalar and the tensor-core kernels, over sorted rows (binary-searched) and unsorted ones (picked) — so a block that
// took entries outside its range, even with the right sum, shows.
TEST(CudaOps, SparseAttentionDkvBitsDoNotDependOnTheKeyRanges) {
    SKIP_WITHOUT_GPU();
    const int64_t T = 300, H = 3, DK = 40, DV = 32, K = 40;
    const ops::SparseAttentionParams p{.dv = DV, .dkv_slabs = 3};
    for (const bool bf16 : {false, true}) {
        std::optional<ops::GemmPrecisionScope> precision;
        if (bf16) precision.emplace(ops::GemmPrecision::bf16);
        Tensor dq[2], dkv[2];  // the batch's first row, then the row alone
        for (const int64_t B : {int64_t(2), int64_t(1)}) {
            auto first_rows = [B](const Tensor& t) { return Tensor::copy_of(t.view().slice0(0, B)).to(Device::cuda); };
            const Tensor idx = first_rows(sparse_rows(2, T, K, true)),
                         q = first_rows(test::randn(DType::f32, Shape{2, T, H, DK}, 1)),
                         kv = first_rows(test::randn(DType::f32, Shape{2, T, DK}, 2)),
                         dout = first_rows(test::randn(DType::f32, Shape{2, T, H, DV}, 3));
            Tensor o(DType::f32, Shape{B, T, H, DV}, Device::cuda), lse(DType::f32, Shape{B, T, H}, Device::cuda),
                gq(DType::f32, Shape{B, T, H, DK}, Device::cuda), gkv(DType::f32, Shape{B, T, DK}, Device::cuda);
            ops::sparse_attention_forward(p, q, kv, idx, o, lse, {});
            ops::sparse_attention_backward(p, dout, q, kv, idx, o, lse, gq, gkv, {});
            const int side = B == 2 ? 0 : 1;
            dq[side] = Tensor::copy_of(gq.to(Device::cpu).view().slice0(0, 1));
            dkv[side] = Tensor::copy_of(gkv.to(Device::cpu).view().slice0(0, 1));
        }
        EXPECT_TRUE(test::bitwise_equal(dq[0], dq[1])) << (bf16 ? "bf16" : "f32");
        EXPECT_TRUE(test::bitwise_equal(dkv[0], dkv[1])) << (bf16 ? "bf16" : "f32");
        const float* g = dkv[0].ptr<float>();
        EXPECT_GT(std::abs(*std::max_element(g, g + dkv[0].numel(),
                                             [](float x, float y) { return std::abs(x) < std::abs(y); })),
                  0.1f);
    }
}

// More heads than the kernels' shared memory holds (the dkv step's p and dz for every head of 16 entries, in f64) are
// a one-line error before any launch, not a failed launch.
TEST(CudaOps, SparseAttentionWithTooManyHeadsForSharedMemoryIsAClearError) {
    SKIP_WITHOUT_GPU();
    const int64_t B = 1, T = 2, H = 1024, DK = 8, K = 2;
    const Tensor q = test::randn(DType::f64, Shape{B, T, H, DK}, 1).to(Device::cuda),
                 kv = test::randn(DType::f64, Shape{B, T, DK}, 2).to(Device::cuda);
    Tensor idx(DType::i32, Shape{B, T, K});
    for (int64_t i = 0; i < idx.numel(); ++i) idx.ptr<int32_t>()[i] = 0;
    const Tensor dev_idx = idx.to(Device::cuda);
    Tensor o(DType::f64, Shape{B, T, H, DK}, Device::cuda), lse(DType::f64, Shape{B, T, H}, Device::cuda);
    test::expect_error([&] { ops::sparse_attention_forward({}, q, kv, dev_idx, o, lse, {}); },
                       "1024 heads of 8 dims need more shared memory than the device allows");
}

// The lightning indexer's selection on the GPU is the CPU's, entry for entry: packed sequences, a topk larger than
// the early queries' candidates (−1 padding), ties at I = 0 (every head's dot negative) broken to the later token,
// and enough candidates that the running list is cut back several times. f64, so that no near-tie rounds
// differently on the two devices.
TEST(CudaOps, DsaIndexerSelectsTheCpusTokens) {
    SKIP_WITHOUT_GPU();
    const int64_t T = 700, HI = 3, DI = 16;
    const std::vector<int64_t> cu{0, 5, 90, 700};
    for (const int64_t topk : {int64_t(8), int64_t(40)}) {
        Tensor q = test::randn(DType::f64, Shape{1, T, HI, DI}, 1), k = test::randn(DType::f64, Shape{1, T, DI}, 2),
               w = test::randn(DType::f64, Shape{1, T, HI}, 3);
        Tensor idx(DType::i32, Shape{1, T, topk}), sc(DType::f64, Shape{1, T, topk});
        Tensor didx(DType::i32, Shape{1, T, topk}, Device::cuda), dsc(DType::f64, Shape{1, T, topk}, Device::cuda);
        std::vector<std::byte> ws(
            ops::dsa_indexer_workspace_bytes(DType::f64, 1, T, HI, DI, topk, omp_get_max_threads()));
        ops::dsa_indexer_forward({.topk = topk}, q, k, w, idx, sc, ws, cu);
        const Tensor dq = q.to(Device::cuda), dk = k.to(Device::cuda), dw = w.to(Device::cuda);
        ops::dsa_indexer_forward({.topk = topk}, dq, dk, dw, didx, dsc, ws, cu);
        EXPECT_TRUE(test::all_close(didx.to(Device::cpu), idx, 0, 0)) << "topk " << topk;
        EXPECT_TRUE(test::all_close(dsc.to(Device::cpu), sc, 1e-12, 1e-12)) << "topk " << topk;
    }
}

// At train.precision = bf16 the GPU scores on tensor cores (WMMA) with q and k rounded to bf16; the CPU rounds them
// too. The inputs make every sum exact in f32, so both devices give the same bits whatever their order of sums: keys
// of small integers, queries n·1.0058 (n = ±1…±4, rounded to bf16 as round-to-nearest-even rounds them, not as
// truncation would), head weights in quarters. Integer-valued scores tie often, so the tie order is checked too.
// Shapes: heads and dims that pad to whole tiles of 16 and that do not; a batch of two rows and packed sequences;
// topk below, at and above a round of 256 candidates; rows whose last round of keys reads past the last key.
TEST(CudaOps, DsaIndexerOnTensorCoresSelectsTheCpusBf16Tokens) {
    SKIP_WITHOUT_GPU();
    struct Case {
        int64_t B, T, HI, DI, topk;
        std::vector<int64_t> cu;
    };
    for (const Case& c :
         {Case{1, 700, 20, 40, 40, {0, 5, 90, 700}}, Case{2, 300, 16, 32, 8, {}}, Case{1, 600, 3, 16, 300, {0, 600}}}) {
        Tensor q(DType::f32, Shape{c.B, c.T, c.HI, c.DI}), k(DType::f32, Shape{c.B, c.T, c.DI}),
            w(DType::f32, Shape{c.B, c.T, c.HI});
        for (int64_t i = 0; i < q.numel(); ++i) {
            const int64_t n = int64_t((i * 2654435761u) >> 7) % 8;
            q.ptr<float>()[i] = float(n < 4 ? n + 1 : 3 - n) * 1.0058f;
        }
        for (int64_t i = 0; i < k.numel(); ++i) k.ptr<float>()[i] = float(int64_t((i * 40503u) >> 5) % 9 - 4);
        for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = 0.25f * float(int64_t((i * 7919u) >> 3) % 9 - 4);
        const ops::GemmPrecisionScope bf16(ops::GemmPrecision::bf16);
        Tensor idx(DType::i32, Shape{c.B, c.T, c.topk}), sc(DType::f32, Shape{c.B, c.T, c.topk});
        Tensor didx(DType::i32, Shape{c.B, c.T, c.topk}, Device::cuda),
            dsc(DType::f32, Shape{c.B, c.T, c.topk}, Device::cuda);
        std::vector<std::byte> ws(
            ops::dsa_indexer_workspace_bytes(DType::f32, c.B, c.T, c.HI, c.DI, c.topk, omp_get_max_threads()));
        ops::dsa_indexer_forward({.topk = c.topk}, q, k, w, idx, sc, ws, c.cu);
        ops::dsa_indexer_forward({.topk = c.topk}, q.to(Device::cuda), k.to(Device::cuda), w.to(Device::cuda), didx,
                                 dsc, ws, c.cu);
        EXPECT_TRUE(test::bitwise_equal(didx.to(Device::cpu), idx)) << "HI " << c.HI << " topk " << c.topk;
        EXPECT_TRUE(test::bitwise_equal(dsc.to(Device::cpu), sc)) << "HI " << c.HI << " topk " << c.topk;
        // the selection is not the f32 one: rounding q moved scores
        Tensor fidx(DType::i32, Shape{c.B, c.T, c.topk}), fsc(DType::f32, Shape{c.B, c.T, c.topk});
        {
            const ops::GemmPrecisionScope f32(ops::GemmPrecision::f32);
            ops::dsa_indexer_forward({.topk = c.topk}, q, k, w, fidx, fsc, ws, c.cu);
        }
        EXPECT_FALSE(test::bitwise_equal(fsc, sc)) << "HI " << c.HI << " topk " << c.topk;
    }
}

// The indexer's KL loss on the GPU against the CPU: over the selected entries (with padding) and dense over every
// candidate of packed sequences; the loss, the rows with support, and the accumulated dq, dk, dw. At train.precision
// = bf16 the head dots and dq's and dk's products run on tensor cores with bf16 operands: on inputs that are bf16
// values already, the loss and dw (from the dots alone) within the f32 tolerance (two tiles of heads, padded dims),
// dq and dk (DA rounded too) within bf16's precision; on other inputs every output within bf16's precision, and not
// f32's bits.
TEST(CudaOps, IndexerKlMatchesTheCpuSparseAndDense) {
    SKIP_WITHOUT_GPU();
    const int64_t T = 50, K = 8;
    const std::vector<int64_t> cu{0, 7, 50};
    Tensor idx(DType::i32, Shape{1, T, K});
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < K; ++i)
            idx.ptr<int32_t>()[t * K + i] = int32_t(i <= t ? (t * 3 + i * 7) % (t + 1) : -1);
    struct Case {
        bool sparse, bf16;
        int64_t HI, DI;  // the second shape: two tiles of 16 heads (the second partial), 24 dims padded to 32
        bool rounded;    // q and k bf16 values already: the tensor cores' dots then differ by their sums' order only
    };
    for (const Case& c :
         {Case{true, false, 3, 16, false}, Case{false, false, 3, 16, false}, Case{true, true, 3, 16, false},
          Case{false, true, 3, 16, false}, Case{true, true, 20, 24, true}, Case{false, true, 20, 24, true}}) {
        const auto [sparse, bf16, HI, DI, rounded] = c;
        const bool exact = !bf16 || rounded;
        std::optional<ops::GemmPrecisionScope> precision;
        if (bf16) precision.emplace(ops::GemmPrecision::bf16);
        const Shape ps = sparse ? Shape{1, T, K} : Shape{1, T, T};
        std::vector<Tensor> host;
        host.push_back(test::randn(DType::f32, Shape{1, T, HI, DI}, 1, 0.3));  // q
        host.push_back(test::randn(DType::f32, Shape{1, T, DI}, 2, 0.3));      // k
        host.push_back(test::randn(DType::f32, Shape{1, T, HI}, 3));           // w
        host.push_back(test::uniform(DType::f32, ps, 4, 0.0, 0.2));            // p
        host.push_back(test::randn(DType::f32, Shape{1, T, HI, DI}, 5, 0.1));  // dq
        host.push_back(test::randn(DType::f32, Shape{1, T, DI}, 6, 0.1));      // dk
        host.push_back(test::randn(DType::f32, Shape{1, T, HI}, 7, 0.1));      // dw
        for (int i = 0; rounded && i < 2; ++i)
            for (int64_t e = 0; e < host[size_t(i)].numel(); ++e) {
                float& v = host[size_t(i)].ptr<float>()[e];
                v = bf16_to_float(float_to_bf16(v));
            }
        std::vector<Tensor> dev, before;  // before: the gradients the ops accumulate into
        for (const Tensor& t : host) dev.push_back(t.to(Device::cuda));
        for (size_t i = 4; i < host.size(); ++i) before.push_back(host[i].to(Device::cpu));
        const Tensor dev_idx = idx.to(Device::cuda);
        std::vector<std::byte> ws(
            ops::indexer_kl_workspace_bytes(DType::f32, 1, T, HI, DI, sparse ? K : T, 3, omp_get_max_threads()));
        const std::vector<int64_t> none;
        std::vector<ops::IndexerKlResult> r;
        for (auto [x, ind] : {std::pair{&host, TensorView(idx)}, std::pair{&dev, TensorView(dev_idx)}}) {
            auto& t = *x;
            r.push_back(ops::indexer_kl(t[0], t[1], t[2], t[3], sparse ? ind : TensorView(), sparse ? none : cu, 0.7,
                                        t[4], t[5], t[6], ws, 3));
        }
        EXPECT_EQ(r[1].rows, r[0].rows);
        const double loss_diff = std::abs(r[1].loss - r[0].loss) / std::abs(r[0].loss);
        // at bf16 the KL, a small difference of larger sums, moves by more than its scores: 1.4e-2 measured, sparse
        EXPECT_LT(loss_diff, exact ? 1e-5 : 5e-2) << "sparse " << sparse << " HI " << HI;
        double worst = 0;  // the gradients' increments: largest difference over largest value
        for (size_t i = 4; i < host.size(); ++i) {
            const Tensor got = dev[i].to(Device::cpu);
            if (!bf16 || (rounded && i == 6)) {
                EXPECT_TRUE(test::all_close(got, host[i], 1e-4, 1e-5))
                    << "tensor " << i << " sparse " << sparse << " HI " << HI;
                continue;
            }
            Tensor dg = got.to(Device::cpu), dh = host[i].to(Device::cpu);
            for (int64_t e = 0; e < dg.numel(); ++e) {
                dg.ptr<float>()[e] -= before[i - 4].ptr<float>()[e];
                dh.ptr<float>()[e] -= before[i - 4].ptr<float>()[e];
            }
            const double diff = largest_difference(dg, dh);
            EXPECT_LT(diff, 2e-2) << "tensor " << i << " sparse " << sparse << " bf16";
            worst = std::max(worst, diff);
        }
        if (bf16) {  // a relu gate flipped by rounding moves a gradient term whole
            std::printf("[ indexer_kl ] %s bf16%s: loss %.1e apart, gradients %.1e of their largest value\n",
                        sparse ? "sparse" : "dense", rounded ? " (rounded inputs)" : "", loss_diff, worst);
            EXPECT_GT(worst, 1e-4) << "bf16 operands must show";
        }
    }
}

// More heads than the KL kernels' shared memory holds (a chunk's dots for every head, in f64) are a one-line error
// before any launch, not a failed launch.
TEST(CudaOps, IndexerKlWithTooManyHeadsForSharedMemoryIsAClearError) {
    SKIP_WITHOUT_GPU();
    const int64_t T = 4, HI = 1024, DI = 8, K = 2;
    const Tensor q = test::randn(DType::f64, Shape{1, T, HI, DI}, 1).to(Device::cuda),
                 k = test::randn(DType::f64, Shape{1, T, DI}, 2).to(Device::cuda),
                 w = test::randn(DType::f64, Shape{1, T, HI}, 3).to(Device::cuda),
                 p = test::uniform(DType::f64, Shape{1, T, K}, 4, 0.0, 0.5).to(Device::cuda);
    Tensor idx(DType::i32, Shape{1, T, K});
    for (int64_t i = 0; i < idx.numel(); ++i) idx.ptr<int32_t>()[i] = 0;
    const Tensor dev_idx = idx.to(Device::cuda);
    test::expect_error([&] { ops::indexer_kl(q, k, w, p, dev_idx, {}, 1.0, {}, {}, {}, {}); },
                       "indexer_kl (CUDA): 1024 heads of 8 dims need");
}

// LoRA on a fused projection's column blocks, with the counter-based dropout (the same mask bits on both devices),
// and the merged-weight form MLA's absorbed kv_b_proj uses.
TEST(CudaOps, LoraMatchesTheCpuWithDropoutOnColumnBlocksAndOnExperts) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 150, IN = 64, OUT = 48, R = 8;
    const ops::LoraParams p{.scale = 0.5, .dropout = 0.25, .seed = 99, .stream = 3};
    expect_cuda_like_cpu(
        {Shape{N, IN + 16}, Shape{R, IN}, Shape{OUT, R}, Shape{N, R}, Shape{N, 2 * OUT}, Shape{N, IN}, Shape{N, OUT},
         Shape{N, R}, Shape{N, IN + 16}, Shape{R, IN}, Shape{OUT, R}},
        [&](std::vector<TensorView> t) {
            const TensorView x = t[0].columns(16, IN);
            ops::lora_forward(p, x, t[1], t[2], t[3], t[4].columns(OUT, OUT), t[5]);
            ops::lora_backward(p, x, t[6], t[1], t[2], t[3], t[7], t[8].columns(0, IN), t[9], t[10], t[5]);
        },
        1e-10, 1e-10, DType::f64);
    expect_cuda_like_cpu(
        {Shape{OUT, IN}, Shape{R, IN}, Shape{OUT, R}, Shape{OUT, IN}, Shape{OUT, IN}, Shape{R, IN}, Shape{OUT, R}},
        [&](std::vector<TensorView> t) {
            ops::lora_merge(p, t[0], t[1], t[2], t[3]);
            ops::lora_weight_backward(p, t[4], t[1], t[2], t[5], t[6]);
        },
        1e-10, 1e-10, DType::f64);
    // the routed experts' form: one grouped GEMM per product over experts of uneven sizes, empty ones among them,
    // rows of a wider buffer
    const std::vector<int32_t> offsets{0, 0, 37, 38, 38, 150};
    const ops::ExpertRows g{offsets.data(), 5};
    expect_cuda_like_cpu(
        {Shape{N, IN + 16}, Shape{5, R, IN}, Shape{5, OUT, R}, Shape{N, R}, Shape{N, OUT}, Shape{N, OUT}, Shape{N, R},
         Shape{N, IN}, Shape{5, R, IN}, Shape{5, OUT, R}},
        [&](std::vector<TensorView> t) {
            const TensorView x = t[0].columns(16, IN);
            ops::lora_grouped_forward({.scale = 0.5}, g, x, t[1], t[2], t[3], t[4]);
            ops::lora_grouped_backward({.scale = 0.5}, g, x, t[5], t[1], t[2], t[3], t[6], t[7], t[8], t[9]);
        },
        1e-10, 1e-10, DType::f64);
}

// Group-limited routing with a selection bias: the same experts in the same slots, the same counts, close weights,
// and the backward through the normalised gate weights and the softmax.
TEST(CudaOps, RouterPicksTheCpusExpertsWithGroupsAndBias) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 257, E = 64, K = 6;
    const ops::RouterParams p{
        .topk = K, .score = ops::RouterScore::softmax, .scaling = 2.5, .groups = 8, .topk_groups = 3};
    Tensor logits = test::randn(DType::f32, Shape{N, E}, 7), bias = test::randn(DType::f32, Shape{E}, 8, 0.01);
    Tensor dweights = test::randn(DType::f32, Shape{N, K}, 9);
    std::vector<Tensor> out[2];
    for (const Device dev : {Device::cpu, Device::cuda}) {
        Tensor u = logits.to(dev), b = bias.to(dev), dg = dweights.to(dev);
        Tensor s(DType::f32, Shape{N, E}, dev), idx(DType::i32, Shape{N, K}, dev), w(DType::f32, Shape{N, K}, dev),
            counts(DType::i32, Shape{E}, dev), ds(DType::f32, Shape{N, E}, dev), du(DType::f32, Shape{N, E}, dev);
        ops::router_score_function(p, u, s);
        ops::router_select(p, s, b, idx, w, counts);
        ops::router_weights_backward(p, dg, s, idx, ds);
        ops::router_score_backward(p, s, ds, du);
        for (Tensor* t : {&s, &idx, &w, &counts, &du}) out[dev == Device::cuda].push_back(t->to(Device::cpu));
    }
    for (const size_t i : {size_t(1), size_t(3)})  // indices and counts: exact
        EXPECT_EQ(std::memcmp(out[0][i].view().data, out[1][i].view().data, out[0][i].view().nbytes()), 0) << i;
    for (const size_t i : {size_t(0), size_t(2), size_t(4)})
        EXPECT_TRUE(test::all_close(out[1][i], out[0][i], 1e-5, 1e-6)) << "tensor " << i;
}

// The router's aux losses on the GPU against the CPU: the sequence-wise balance loss over three sequences, the
// global balance statistics accumulated onto sums that hold values already and their backward, the z-loss; the
// losses' values and the gradients.
TEST(CudaOps, RouterAuxLossesMatchTheCpu) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 64, E = 10, K = 3;
    Tensor scores = test::uniform(DType::f32, Shape{N, E}, 1, 0.01, 1.0),
           logits = test::randn(DType::f32, Shape{N, E}, 2);
    Tensor idx(DType::i32, Shape{N, K});
    for (int64_t i = 0; i < N * K; ++i) idx.ptr<int32_t>()[i] = int32_t(i % 7 == 3 ? -1 : (i * 5) % E);
    const std::vector<int64_t> starts{0, 1, 30, 64};
    Tensor ds = test::randn(DType::f32, Shape{N, E}, 3, 0.1), du = test::randn(DType::f32, Shape{N, E}, 4, 0.1);
    const Tensor d_scores = scores.to(Device::cuda), d_logits = logits.to(Device::cuda), d_idx = idx.to(Device::cuda);
    Tensor d_ds = ds.to(Device::cuda), d_du = du.to(Device::cuda);
    std::vector<double> scratch(size_t(2 * E));
    const double seq = ops::router_seq_aux_loss(0.01, scores, idx, starts, ds, scratch);
    const double d_seq = ops::router_seq_aux_loss(0.01, d_scores, d_idx, starts, d_ds, scratch);
    EXPECT_NEAR(d_seq, seq, 1e-12 * std::abs(seq));
    std::vector<double> c(size_t(E), 2.0), p(size_t(E), 0.5), dc = c, dp = p;
    ops::router_balance_stats(scores, idx, c, p);
    ops::router_balance_stats(d_scores, d_idx, dc, dp);
    for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ(dc[size_t(e)], c[size_t(e)]) << e;
        EXPECT_NEAR(dp[size_t(e)], p[size_t(e)], 1e-12) << e;
    }
    std::vector<double> grad(static_cast<size_t>(E));
    ops::router_global_aux_loss(0.02, c, p, double(N), grad);
    ops::router_balance_backward(grad, scores, ds);
    ops::router_balance_backward(grad, d_scores, d_ds);
    EXPECT_TRUE(test::all_close(d_ds.to(Device::cpu), ds, 1e-5, 1e-7));
    const double z = ops::router_z_loss(0.001, logits, du), d_z = ops::router_z_loss(0.001, d_logits, d_du);
    EXPECT_NEAR(d_z, z, 1e-12 * std::abs(z));
    EXPECT_TRUE(test::all_close(d_du.to(Device::cpu), du, 1e-5, 1e-7));
}

// The MoE layer on both devices from the same f64 tensors: capacity with re-routing, group-limited sigmoid routing
// with a bias, the latent projections with their norm, SiTU experts, a gated shared expert and the router losses in one
// variant; dropless softmax routing, SwiGLU experts without latent and adapters on every routed expert in the other.
// The routing (final experts, loads) is the same, every output and gradient within f64 rounding.
// One MoE layer's forward and backward on `device`: the weights and inputs (x, dy) copied there from `host`, the
// gradients named in `grads` (zeroed, in their dtype; absent ones are not computed: frozen weights), the layer's saved
// and scratch buffers in `dtype` from one arena. The gradients come back in `g`, the output as g["y"].
struct MoeSide {
    std::map<std::string, Tensor> t, g;
    ops::MoeBuffers buffers;
    ops::MoeStats stats;
    uint64_t waits = 0;  // how often the host waited for the device in forward and backward
};
MoeSide run_moe(const ops::MoeParams& p,
                const std::map<std::string, Tensor>& host,
                const std::map<std::string, Tensor>& grads,
                DType dtype,
                std::span<const int64_t> starts,
                Device device,
                int32_t* offsets_host = nullptr) {
    MoeSide side;
    for (const auto& [name, t] : host) side.t.emplace(name, t.to(device));
    for (const auto& [name, t] : grads) side.g.emplace(name, t.to(device));
    auto view = [](std::map<std::string, Tensor>& m, const std::string& name) {
        auto it = m.find(name);
        return it == m.end() ? TensorView() : it->second.view();
    };
    auto weights = [&](std::map<std::string, Tensor>& m) {
        ops::MoeWeights w{view(m, "router_w"),  view(m, "router_bias"), view(m, "w_gate"),
                          view(m, "w_up"),      view(m, "w_down"),      view(m, "latent_down"),
                          view(m, "latent_up"), view(m, "latent_norm"), view(m, "shared_gate"),
                          view(m, "shared_up"), view(m, "shared_down"), view(m, "shared_scale")};
        w.lora.w_gate = {view(m, "w_gate.a"), view(m, "w_gate.b")};
        w.lora.w_up = {view(m, "w_up.a"), view(m, "w_up.b")};
        w.lora.w_down = {view(m, "w_down.a"), view(m, "w_down.b")};
        return w;
    };
    const ops::MoeWeights w = weights(side.t);
    ops::MoeWeights g = weights(side.g);
    g.router_bias = {};
    const Shape xs = side.t.at("x").shape();
    const int64_t N = xs.dims[0];
    side.buffers = ops::moe_buffers(ops::moe_dims(p, w, N), dtype, device);
    ops::MoeSaved sv = side.buffers.saved;
    sv.offsets_host = offsets_host;
    const ops::MoeScratch& sc = side.buffers.scratch;
    Tensor y(dtype, xs, device);
    const uint64_t waits = device_waits();
    side.stats = ops::moe_forward(p, w, side.t.at("x"), y, false, sv, sc, starts);
    ops::moe_backward(p, w, side.t.at("x"), side.t.at("dy"), side.g.at("x"), g, sv, sc, starts);
    side.waits = device_waits() - waits;
    side.g.emplace("y", std::move(y));
    return side;
}

TEST(CudaOps, MoeMatchesTheCpuWithCapacityLatentSharedExpertsAndExpertLora) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 96, D = 24, E = 8, F = 16, FS = 20, r = 4;
    const std::vector<int64_t> starts{0, 40, 96};
    for (const bool plain : {false, true}) {
        const int64_t L = plain ? D : 12;
        ops::MoeParams p{.router = {.topk = 3,
                                    .score = plain ? ops::RouterScore::softmax : ops::RouterScore::sigmoid,
                                    .normalize = true,
                                    .scaling = 1.5,
                                    .groups = plain ? 1 : 4,
                                    .topk_groups = plain ? 1 : 2},
                         .capacity_factor = plain ? 0.0 : 0.9,
                         .activation = plain ? ops::ExpertActivation::swiglu : ops::ExpertActivation::situ,
                         .seq_aux_coeff = plain ? 0.0 : 0.01,
                         .z_loss_coeff = plain ? 0.0 : 0.001};
        p.lora.scale = 0.5;
        const std::vector<double> balance_grad(size_t(E), 0.003);
        if (!plain) p.balance_grad = balance_grad;
        std::map<std::string, Shape> shapes{
            {"x", Shape{N, D}},         {"dy", Shape{N, D}},      {"router_w", Shape{E, D}}, {"router_bias", Shape{E}},
            {"w_gate", Shape{E, F, L}}, {"w_up", Shape{E, F, L}}, {"w_down", Shape{E, L, F}}};
        if (plain) {
            for (const char* m : {"w_gate", "w_up"}) {
                shapes[std::string(m) + ".a"] = Shape{E, r, L};
                shapes[std::string(m) + ".b"] = Shape{E, F, r};
            }
            shapes["w_down.a"] = Shape{E, r, F};
            shapes["w_down.b"] = Shape{E, L, r};
        } else {
            for (auto [name, shape] :
                 std::initializer_list<std::pair<const char*, Shape>>{{"latent_down", Shape{L, D}},
                                                                      {"latent_up", Shape{D, L}},
                                                                      {"latent_norm", Shape{L}},
                                                                      {"shared_gate", Shape{FS, D}},
                                                                      {"shared_up", Shape{FS, D}},
                                                                      {"shared_down", Shape{D, FS}},
                                                                      {"shared_scale", Shape{1, D}}})
                shapes[name] = shape;
        }
        std::map<std::string, Tensor> host, grads_host;
        uint64_t seed = 200;
        for (const auto& [name, shape] : shapes) {
            host.emplace(name, name == "router_bias" ? test::uniform(DType::f64, shape, seed++, -0.05, 0.05)
                                                     : test::randn(DType::f64, shape, seed++, 0.3));
            if (name != "x" && name != "dy" && name != "router_bias")
                grads_host.emplace(name, Tensor(DType::f64, shape));
        }
        grads_host.emplace("x", Tensor(DType::f64, Shape{N, D}));
        const MoeSide cpu = run_moe(p, host, grads_host, DType::f64, starts, Device::cpu),
                      gpu = run_moe(p, host, grads_host, DType::f64, starts, Device::cuda);
        EXPECT_EQ(gpu.stats.rerouted, cpu.stats.rerouted);
        EXPECT_EQ(gpu.stats.dropped, cpu.stats.dropped);
        EXPECT_NEAR(gpu.stats.seq_aux_loss, cpu.stats.seq_aux_loss, 1e-12);
        EXPECT_NEAR(gpu.stats.z_loss, cpu.stats.z_loss, 1e-12);
        if (!plain) {
            EXPECT_GT(cpu.stats.rerouted + cpu.stats.dropped, 0) << "the capacity must bind";
        }
        for (const char* name : {"expert", "counts", "demand", "row", "offsets"}) {
            const TensorView a = gpu.buffers.group.view(name), b = cpu.buffers.group.view(name);
            EXPECT_TRUE(test::bitwise_equal(Tensor::copy_of(a).to(Device::cpu), b))
                << name << (plain ? " (plain)" : "");
        }
        for (auto& [name, t] : cpu.g)
            EXPECT_TRUE(test::all_close(gpu.g.at(name).to(Device::cpu), t, 1e-10, 1e-12))
                << "d" << name << (plain ? " (plain)" : "");
        // with the layout's host copy of the offsets (as the layer keeps it) the expert passes read nothing back: two
        // waits fewer, the same bits
        std::vector<int32_t> offsets(size_t(E + 1), -1);
        const MoeSide kept = run_moe(p, host, grads_host, DType::f64, starts, Device::cuda, offsets.data());
        EXPECT_EQ(kept.waits + 2, gpu.waits) << (plain ? "plain" : "");
        EXPECT_TRUE(test::bitwise_equal(TensorView(offsets.data(), DType::i32, Shape{E + 1}),
                                        cpu.buffers.group.view("offsets")));
        for (auto& [name, t] : gpu.g)
            EXPECT_TRUE(test::bitwise_equal(kept.g.at(name).to(Device::cpu), t.to(Device::cpu))) << "d" << name;
    }
}

// Frozen routed experts held narrow (bf16: model.lora.base_dtype; MXFP4: model.lora.expert_dtype, Kimi K3's release)
// in an f32 layer with adapters on the experts: the GPU widens windows of experts into its scratch (160 experts of
// 128 × 1024: two windows of 64 MiB) and gives the CPU's output and gradients (the CPU widens per GEMM tile). At
// train.precision = bf16 it reads bf16 experts in place and dequantizes MXFP4 ones to bf16 in the same windows: the
// results of the same layer with the experts' values held in f32 on the GPU at f32 tolerance (the emulator: the same
// bits), and the CPU's within 1e-3 (the devices' f32 roundings before a bf16 rounding flip some operands by an ulp:
// 3e-4 apart on the emulator).
TEST(CudaOps, MoeWithFrozenExpertsHeldNarrowMatchesTheCpu) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 160, D = 64, E = 160, F = 128, L = 1024, r = 4;
    const std::vector<int64_t> starts{0, 100, 160};
    ops::MoeParams p{.router = {.topk = 4, .score = ops::RouterScore::sigmoid, .normalize = true, .scaling = 2.0}};
    p.lora.scale = 0.5;
    for (const auto& [at_bf16, dt] : {std::pair{false, DType::bf16}, std::pair{false, DType::mxfp4},
                                      std::pair{true, DType::bf16}, std::pair{true, DType::mxfp4}}) {
        std::optional<ops::GemmPrecisionScope> precision;
        if (at_bf16) precision.emplace(ops::GemmPrecision::bf16);
        std::map<std::string, Tensor> host, grads;
        uint64_t seed = 300;
        for (auto [name, shape] : std::initializer_list<std::pair<const char*, Shape>>{{"x", Shape{N, D}},
                                                                                       {"dy", Shape{N, D}},
                                                                                       {"router_w", Shape{E, D}},
                                                                                       {"latent_down", Shape{L, D}},
                                                                                       {"latent_up", Shape{D, L}},
                                                                                       {"w_gate.a", Shape{E, r, L}},
                                                                                       {"w_gate.b", Shape{E, F, r}},
                                                                                       {"w_down.a", Shape{E, r, F}},
                                                                                       {"w_down.b", Shape{E, L, r}}}) {
            host.emplace(name, test::randn(DType::f32, shape, seed++, 0.1));
            if (name != std::string("dy")) grads.emplace(name, Tensor(DType::f32, shape));
        }
        for (auto [name, shape] : std::initializer_list<std::pair<const char*, Shape>>{
                 {"w_gate", Shape{E, F, L}}, {"w_up", Shape{E, F, L}}, {"w_down", Shape{E, L, F}}}) {
            const Tensor wf = test::randn(DType::f32, shape, seed++, 0.05);
            Tensor w(dt, shape);
            if (dt == DType::bf16) {
                for (int64_t i = 0; i < w.numel(); ++i) w.ptr<bf16>()[i] = float_to_bf16(wf.ptr<float>()[i]);
            } else {
                f32_to_mxfp4(wf.ptr<float>(), wf.numel(), static_cast<uint8_t*>(w.view().data));
            }
            host.emplace(name, std::move(w));  // frozen: no gradient
        }
        const MoeSide cpu = run_moe(p, host, grads, DType::f32, starts, Device::cpu),
                      gpu = run_moe(p, host, grads, DType::f32, starts, Device::cuda);
        if (at_bf16) {  // the experts' values widened to f32 on the host
            std::map<std::string, Tensor> wide;
            for (const auto& [name, t] : host) {
                Tensor w(DType::f32, t.shape());
                if (t.dtype() == DType::bf16) {
                    for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = bf16_to_float(t.ptr<bf16>()[i]);
                } else if (t.dtype() == DType::mxfp4) {
                    mxfp4_to_f32(Mxfp4{static_cast<const uint8_t*>(t.view().data)}, w.numel(), w.ptr<float>());
                } else {
                    w = Tensor::copy_of(t);
                }
                wide.emplace(name, std::move(w));
            }
            const MoeSide held = run_moe(p, wide, grads, DType::f32, starts, Device::cuda);
            for (auto& [name, t] : held.g)
                EXPECT_TRUE(test::rel_rms_close(gpu.g.at(name).to(Device::cpu), t.to(Device::cpu), 1e-5))
                    << "d" << name << ", " << dtype_name(dt) << " experts against their f32 values";
        }
        const TensorView offsets = cpu.buffers.group.view("offsets");
        EXPECT_GT(offsets.ptr<int32_t>()[E] - offsets.ptr<int32_t>()[128], 0) << "the second window must have rows";
        for (const char* name : {"offsets", "row"})
            EXPECT_TRUE(test::bitwise_equal(Tensor::copy_of(gpu.buffers.group.view(name)).to(Device::cpu),
                                            cpu.buffers.group.view(name)))
                << name;
        for (auto& [name, t] : cpu.g)
            EXPECT_TRUE(test::rel_rms_close(gpu.g.at(name).to(Device::cpu), t, at_bf16 ? 1e-3 : 1e-5))
                << "d" << name << ", " << dtype_name(dt) << " experts" << (at_bf16 ? ", bf16 precision" : "");
    }
}

// The routed experts' products alone at train.precision = bf16, the rows dispatched alike on both devices (so nothing
// upstream differs): the GPU rounds the dispatched rows, the output's gradient and the gate/up gradient once each for
// the grouped GEMMs that read them (two, two and four), the CPU per product; the same operands, so the outputs and
// every gradient agree to f32 rounding of the sums' order, and the products are not the f32 ones.
TEST(CudaOps, MoeExpertProductsAtBf16MatchTheCpu) {
    SKIP_WITHOUT_GPU();
    const int64_t N = 48, E = 6, K = 2, F = 24, L = 40, R = N * K;
    ops::MoeParams p;
    p.router.topk = K;
    std::vector<int32_t> expert(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) expert[size_t(i)] = int32_t((i / K * 5 + i % K) % E);  // a token's k apart
    const std::vector<float> gates(size_t(R), 1.0f / float(K));
    const Tensor x = test::randn(DType::f32, Shape{N, L}, 61), dye = test::randn(DType::f32, Shape{R, L}, 62),
                 wg = test::randn(DType::f32, Shape{E, F, L}, 63, 0.1),
                 wu = test::randn(DType::f32, Shape{E, F, L}, 64, 0.1),
                 wd = test::randn(DType::f32, Shape{E, L, F}, 65, 0.1);
    // ye (the output rows), dxe and the three weight gradients
    auto run = [&](Device device, ops::GemmPrecision precision) {
        const ops::GemmPrecisionScope scope(precision);
        const Tensor rw(DType::f32, Shape{E, L}, device), g = wg.to(device), u = wu.to(device), dw = wd.to(device),
                                                          xs = x.to(device);
        Tensor dg(DType::f32, wg.shape(), device), du(DType::f32, wu.shape(), device),
            dd(DType::f32, wd.shape(), device), drw(DType::f32, Shape{E, L}, device);
        const ops::MoeWeights w{.router_w = rw, .w_gate = g, .w_up = u, .w_down = dw};
        const ops::MoeWeights gr{.router_w = drw, .w_gate = dg, .w_up = du, .w_down = dd};
        const ops::MoeBuffers buffers = ops::moe_buffers(ops::moe_dims(p, w, N), DType::f32, device);
        const ops::MoeSaved& sv = buffers.saved;
        const ops::MoeScratch& sc = buffers.scratch;
        copy_bytes(sv.expert.data, device, expert.data(), Device::cpu, expert.size() * sizeof(int32_t));
        copy_bytes(sv.gates.data, device, gates.data(), Device::cpu, gates.size() * sizeof(float));
        ops::moe_build_layout(sv, N);
        ops::moe_dispatch(sv, xs, sv.xe);
        ops::moe_experts_forward(p, w, sv, sc);
        std::vector<Tensor> out;
        out.push_back(Tensor::copy_of(sc.ye.slice0(0, R)).to(Device::cpu));
        copy_bytes(sc.ye.data, device, dye.view().data, Device::cpu, dye.view().nbytes());
        ops::moe_experts_backward(p, w, gr, sv, sc);
        for (const TensorView& t : {sc.dxe.slice0(0, R), dg.view(), du.view(), dd.view()})
            out.push_back(Tensor::copy_of(t).to(Device::cpu));
        return out;
    };
    const std::vector<Tensor> gpu = run(Device::cuda, ops::GemmPrecision::bf16),
                              cpu = run(Device::cpu, ops::GemmPrecision::bf16),
                              f32 = run(Device::cpu, ops::GemmPrecision::f32);
    const char* names[] = {"ye", "dxe", "dw_gate", "dw_up", "dw_down"};
    for (size_t i = 0; i < gpu.size(); ++i) {
        EXPECT_TRUE(test::rel_rms_close(gpu[i], cpu[i], 1e-5)) << names[i];
        EXPECT_FALSE(test::rel_rms_close(gpu[i], f32[i], 1e-4)) << names[i] << " must be a product of bf16 operands";
    }
}

TEST(CudaOps, DsaAllCandidatesMatchTheCpuOnPackedSequences) {
    SKIP_WITHOUT_GPU();
    const std::vector<int64_t> cu{0, 1, 17, 40};
    Tensor cpu(DType::i32, Shape{1, 40, 24}), gpu(DType::i32, Shape{1, 40, 24}, Device::cuda);
    ops::dsa_all_candidates(cpu, cu);
    ops::dsa_all_candidates(gpu, cu);
    EXPECT_TRUE(test::bitwise_equal(gpu.to(Device::cpu), cpu));
    Tensor cpu2(DType::i32, Shape{2, 9, 9}), gpu2(DType::i32, Shape{2, 9, 9}, Device::cuda);
    ops::dsa_all_candidates(cpu2);
    ops::dsa_all_candidates(gpu2);
    EXPECT_TRUE(test::bitwise_equal(gpu2.to(Device::cpu), cpu2));
}

TEST(CudaOps, TheDeviceArenaHandsOutDeviceViewsAndReusesFreedBlocks) {
    SKIP_WITHOUT_GPU();
    Arena arena(64 << 20, 256, Device::cuda);
    const TensorView a = arena.allocate_tensor(DType::f32, Shape{1024, 1024});
    EXPECT_EQ(a.device, Device::cuda);
    Tensor host = test::randn(DType::f32, a.shape, 5);
    copy_bytes(a.data, Device::cuda, host.view().data, Device::cpu, a.nbytes());
    Tensor back(DType::f32, a.shape);
    copy_bytes(back.view().data, Device::cpu, a.data, Device::cuda, a.nbytes());
    EXPECT_TRUE(test::all_close(back, host, 0, 0));
    const size_t peak = arena.stats().peak_bytes_in_use;
    arena.free(a.data);
    const TensorView b = arena.allocate_tensor(DType::f32, Shape{1024, 1024});
    EXPECT_EQ(b.data, a.data);
    EXPECT_EQ(arena.stats().peak_bytes_in_use, peak);
}

}  // namespace
}  // namespace tessera
