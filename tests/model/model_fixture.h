// A tiny model loaded from a golden file of tools/ref/make_model_golden.py, bound to memory and
// ready for forward/backward and training steps.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/safetensors.h"
#include "model/runtime.h"
#include "train/config.h"
#include "train/optimizer.h"
#include "train/trainer.h"

namespace tessera::test {

struct GoldenModel {
    // `edit` may change the golden's run config (JSON) before the model is built; when it changes the
    // model, the parameters start from Model::init_params (seed 1) instead of the golden's.
    explicit GoldenModel(const std::string& case_name,
                         const model::Recompute& recompute = {},
                         const std::function<void(Json&)>& edit = {});

    SafetensorsFile file;
    train::RunConfig cfg;
    model::StepShape shape;
    std::unique_ptr<model::Model> model;
    std::unique_ptr<train::AdamW> opt;
    std::unique_ptr<train::GradientSum> grads;
    std::unique_ptr<model::ModelRuntime> rt;

    std::span<const int32_t> ids(const std::string& name, int64_t index = 0) const;  // one [B·T] batch
    // Runs the golden 10-step trajectory; returns the losses (and each step's result, when asked).
    std::vector<double> run_trajectory(std::vector<train::StepResult>* steps = nullptr);

    // A model of this config decoding one token at a time: caches for the batch's sequences, the parameters this
    // model holds now.
    struct Decoder {
        std::unique_ptr<model::Model> model;
        std::unique_ptr<BufferGroup> cache;
        std::unique_ptr<model::ModelRuntime> rt;
    };
    Decoder decoder() const;
    // gtest expectations: the decoder's logits at every position of the batch equal this model's full forward's
    // within tol (relative RMS).
    void expect_decoding_matches_forward(Decoder& d, double tol) const;
};

}  // namespace tessera::test
