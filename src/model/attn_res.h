// Attention Residuals (Kimi K3's block AttnRes; spec/kimi_k3.md §2.2, concept: arXiv 2603.15031). Instead of
// one residual stream the trunk carries P, the running sum of the current depth block's sublayer outputs,
// and R, the finished block sums (R_0 = the token embedding). Every sublayer (attention, feed-forward) and
// the final norm read a softmax mix over R ∪ {P} (ops/attn_res.h) scored by a learned per-sublayer
// pseudo-query; the attention sublayer of every layer l with l mod B = 0 first moves P into R. Layer 0's
// attention reads the embedding as is (one source), so its mix parameters exist but get no gradient.
//
// Storage: the model keeps every P state where it keeps the residual states of a plain model, x[0] = the
// embedding and x[j+1] = P after sublayer j (the blocks run without their own residual, write f, and P is
// added); R entries are earlier x[k] and a mix reads them in place. Mix outputs are not stored: backward
// recomputes them (O(S·C) per token). Gradients: dres holds dL/dP; each R entry has its own accumulator.
#pragma once

#include <span>
#include <vector>

#include "core/buffer_spec.h"
#include "model/layers/block.h"

namespace tessera::model {

class AttnRes {
  public:
    AttnRes(int64_t n_layers, int64_t block_size, int64_t d_model, double eps, double init_std);

    // Per layer L: model.layers.L.{self_attention,mlp}_res_{norm,proj}.weight ([C], [1, C]); then
    // model.output_attn_res_{norm,proj}.weight. Norms start at 1, projections at N(0, init_std²).
    void declare_params(std::vector<BufferSpec>& specs, std::vector<ParamInit>& inits) const;
    // the mix output and its gradient, probabilities, one gradient accumulator per R entry
    void declare_acts(std::vector<BufferSpec>& specs, StepShape max) const;
    // x: the model's P states x[0..2·n_layers] ([N, C] each)
    void bind(const BufferGroup& params, const BufferGroup* grads, const BufferGroup& acts, std::vector<TensorView> x);

    // Forward. input(j): sublayer j's input (the mix, or x[0] for layer 0's attention); combine(j) after the
    // block wrote f into x[j+1]: P ← P + f unless sublayer j started a new depth block; output(): the
    // final norm's input.
    TensorView input(size_t j, int64_t N);
    void combine(size_t j, int64_t N);
    TensorView output(int64_t N);

    // Backward (each mix's backward follows its input() / output() call). dmix(): the mix-gradient buffer
    // ([N, C] rows of it). output_backward: dmix holds dL/dh;
    // sets dres = dL/dP of the last P and the R accumulators. For sublayer j (reverse order):
    // begin_backward copies dres (dL/dx[j+1]) into dmix, the block's backward turns it into dL/d input(j),
    // end_backward moves dres to the P before sublayer j and adds the mix's source gradients.
    TensorView dmix(int64_t N) const { return dmix_.slice0(0, N); }
    void output_backward(TensorView dres, int64_t N);
    void begin_backward(TensorView dres, int64_t N);
    void end_backward(size_t j, TensorView dres, int64_t N);

    // sources of sublayer j's mix (x indices; the last is the current P) and whether P restarts at j
    const std::vector<int>& sources(size_t j) const { return wiring_[j].sources; }
    bool restarts(size_t j) const { return wiring_[j].base < 0; }

  private:
    struct Wiring {
        std::vector<int> sources;  // x indices: R entries, then P
        int base = -1;             // x index of P before the sublayer; -1 = P restarts (empty)
        std::string param;         // "model.layers.L.self_attention" / ".mlp" / "model.output_attn"
    };
    struct Mix {
        TensorView gamma, w, dgamma, dw;
    };
    // the first N rows of x[idx...], in `out` (capacity max_sources_: filled without allocating)
    std::span<const TensorView> views(const std::vector<int>& idx, int64_t N, std::vector<TensorView>& out) const;
    TensorView mix_forward(const Wiring& wr, const Mix& m, int64_t N);
    void mix_backward(const Wiring& wr, const Mix& m, TensorView dres, int64_t N);

    int64_t C_;
    double eps_, init_std_;
    std::vector<Wiring> wiring_;  // per sublayer, then the output mix
    std::vector<int> r_entries_;  // x indices that ever sit in R (each has a gradient accumulator)
    size_t max_sources_ = 1;
    std::vector<Mix> mixes_;
    std::vector<TensorView> x_, dr_;
    std::vector<TensorView> src_, dsrc_;  // a mix's source views and their gradients, reserved at construction
    TensorView mix_, dmix_, probs_, scratch_;
};

}  // namespace tessera::model
