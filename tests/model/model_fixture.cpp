// Golden-model fixture (see model_fixture.h).
#include "model/model_fixture.h"

#include <cstring>

#include "util/test_util.h"

namespace tessera::test {

GoldenModel::GoldenModel(const std::string& case_name,
                         const model::Recompute& recompute,
                         const std::function<void(Json&)>& edit)
    : file(golden_path("model/" + case_name + ".safetensors")) {
    Json doc = Json::parse(file.metadata().at("config"));
    doc["train"]["recompute"] = recompute.to_json();
    const Json golden_model = doc["model"];
    if (edit) edit(doc);
    cfg = train::parse_run_config(doc, "golden " + case_name);
    shape = {cfg.train.micro_batch(1), cfg.train.seq_len};
    model = std::make_unique<model::Model>(cfg.model);
    model->set_activation_dtype(cfg.train.activation_dtype);
    // (offloaded in windows of 1,024 elements: the tiny models' moments stream through many, pieces cut at their edges)
    opt = std::make_unique<train::AdamW>(model->trained_specs(), nullptr, 0, std::vector<size_t>{}, false,
                                         cfg.memory.optimizer_offload ? 1024 : 0);
    if (opt->offloaded()) opt->offload_to(::testing::TempDir());
    grads = std::make_unique<train::GradientSum>(*opt, cfg.train.accumulation(1));
    std::vector<BufferGroup*> extra{&opt->m(), &opt->v()};
    for (BufferGroup* g : grads->groups()) extra.push_back(g);
    rt = std::make_unique<model::ModelRuntime>(*model, shape, true, cfg.train.recompute, extra);
    if (doc["model"] != golden_model) {  // the golden's parameters do not fit an edited model
        model->init_params(rt->params(), 1);
        return;
    }
    for (const auto& spec : model->param_specs()) file.load_into("param." + spec.name, rt->params().view(spec.name));
}

std::span<const int32_t> GoldenModel::ids(const std::string& name, int64_t index) const {
    TensorView t = file.view(name);
    const int64_t n = shape.tokens();
    return {t.ptr<int32_t>() + index * n, size_t(n)};
}

std::vector<double> GoldenModel::run_trajectory(std::vector<train::StepResult>* steps) {
    std::vector<int32_t> ids_buf(size_t(shape.tokens())), tgt_buf(size_t(shape.tokens()));
    std::vector<double> losses;
    for (int64_t step = 0; step < cfg.train.steps; ++step) {
        auto batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
            auto si = ids("traj.ids", step), st = ids("traj.targets", step);
            std::copy(si.begin(), si.end(), i.begin());
            std::copy(st.begin(), st.end(), t.begin());
            return shape;
        };
        train::StepResult r = train::train_step(*model, *rt, *opt, *grads, cfg.train, step, batch, ids_buf, tgt_buf);
        losses.push_back(r.loss);
        if (steps) steps->push_back(std::move(r));
    }
    return losses;
}

GoldenModel::Decoder GoldenModel::decoder() const {
    Decoder d;
    d.model = std::make_unique<model::Model>(cfg.model);
    d.cache = std::make_unique<BufferGroup>("cache", d.model->cache_specs(shape.batch, shape.seq));
    d.rt = std::make_unique<model::ModelRuntime>(*d.model, model::StepShape{shape.batch, 1}, false, model::Recompute{},
                                                 std::vector<BufferGroup*>{d.cache.get()});
    d.model->bind_cache(*d.cache);
    for (const auto& spec : d.model->param_specs()) {
        const TensorView from = rt->params().view(spec.name);
        std::memcpy(d.rt->params().view(spec.name).data, from.data, from.nbytes());
    }
    return d;
}

void GoldenModel::expect_decoding_matches_forward(Decoder& d, double tol) const {
    const int64_t B = shape.batch, T = shape.seq, V = cfg.model.vocab_size;
    Tensor full(DType::f32, Shape{B * T, V});
    model->forward_logits(shape, ids("ids"), full);
    const auto tokens = ids("ids");
    Tensor step(DType::f32, Shape{B, V}), want(DType::f32, Shape{B, V});
    for (int64_t pos = 0; pos < T; ++pos) {
        std::vector<int32_t> tok;
        for (int64_t b = 0; b < B; ++b) {
            tok.push_back(tokens[size_t(b * T + pos)]);
            std::copy(full.ptr<float>() + (b * T + pos) * V, full.ptr<float>() + (b * T + pos + 1) * V,
                      want.ptr<float>() + b * V);
        }
        d.model->decode_step(pos, tok, step);
        EXPECT_TRUE(rel_rms_close(step, want, tol)) << "position " << pos;
    }
}

}  // namespace tessera::test
