// The op target (see fuzz_targets.h): the input picks a registered op, then for each of its inputs whether it is
// given, its dtype, rank, small dimensions and values, and for each parameter a value from a table of edge cases;
// run_op must check everything it reads (a wrong-sized input was read out of bounds: moe's daux_loss of [0]).
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "fuzz/fuzz_targets.h"
#include "ops/registry.h"

namespace tessera::fuzz {

namespace {
class Bytes {
  public:
    explicit Bytes(Input d) : d_(d) {}
    uint8_t next() { return i_ < d_.size() ? d_[i_++] : 0; }

  private:
    Input d_;
    size_t i_ = 0;
};

constexpr DType kDtypes[] = {DType::f32, DType::f32, DType::f32,  DType::f64,
                             DType::i64, DType::i32, DType::bf16, DType::u8};
const char* const kValues[] = {"0",  "1",   "2",   "3",     "4",     "8",    "-1",           "-5",
                               "64", "0.5", "1e9", "1e-30", "-1e30", "1.5x", "1099511627776"};

// Dimensions come from a pool of four sizes drawn first, so that tensors agree on shapes often enough to get past
// the shape checks into the kernels; 0 now and then (empty inputs are refused up front).
Tensor random_tensor(Bytes& b, const int64_t (&pool)[4]) {
    const uint8_t ctl = b.next();
    const DType dt = kDtypes[ctl & 7];
    const int rank = (ctl >> 3) % 5;
    Shape s;
    s.ndim = rank;
    for (int i = 0; i < rank; ++i) s.dims[i] = pool[b.next() % 4];
    Tensor t(dt, s);
    for (int64_t i = 0; i < t.numel(); ++i) {
        const int v = int(b.next() % 16) - 3;  // -3 .. 12: small values, negative and out-of-range indices
        switch (dt) {
            case DType::f32:
                t.ptr<float>()[i] = float(v) / 4;
                break;
            case DType::f64:
                t.ptr<double>()[i] = double(v) / 4;
                break;
            case DType::i32:
                t.ptr<int32_t>()[i] = v;
                break;
            case DType::i64:
                t.ptr<int64_t>()[i] = v;
                break;
            case DType::bf16:
                t.ptr<bf16>()[i] = float_to_bf16(float(v) / 4);
                break;
            default:
                static_cast<uint8_t*>(t.view().data)[i] = uint8_t(v);
                break;
        }
    }
    return t;
}
}  // namespace

void op(Input data) {
    Bytes b(data);
    const auto& all = ops::op_registry().all();
    const ops::OpDef& op = all[b.next() % all.size()];
    int64_t pool[4];
    for (auto& d : pool) d = b.next() % 7;
    std::map<std::string, Tensor> inputs;
    for (const auto& spec : op.inputs) {
        if (spec.optional && (b.next() & 1) == 0) continue;
        inputs.emplace(spec.name, random_tensor(b, pool));
    }
    std::map<std::string, std::string> params;
    for (const auto& p : op.params) {
        const uint8_t c = b.next();
        if ((c & 1) == 0) continue;
        if (p.kind == ops::ParamKind::choice) {
            params[p.name] = (c >> 1) < p.choices.size() ? p.choices[c >> 1] : "bad";
        } else {
            params[p.name] = kValues[(c >> 1) % std::size(kValues)];
        }
    }
    try {
        ops::run_op(op, std::move(inputs), params);
    } catch (const Error&) {
    }
}

}  // namespace tessera::fuzz
