// tessera op: run one registered op on named tensors from a safetensors file (forward, plus
// backward when the file holds output gradients) and write the named outputs.
#include <iostream>

#include "apps/commands.h"
#include "core/device.h"
#include "core/safetensors.h"
#include "ops/registry.h"

namespace tessera::apps {

void add_op_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("op", "Run one op on tensors from a safetensors file (kernel debugging)");
    struct Args {
        std::string name, in, out;
        std::vector<std::string> sets;
        std::string device = "cpu";
        bool list = false;
    };
    auto a = std::make_shared<Args>();
    cmd->add_option("name", a->name, "Op name (see --list)");
    cmd->add_option("--in", a->in, "Input safetensors file with the op's input tensors (and d<output> for backward)");
    cmd->add_option("--out", a->out, "Output safetensors file");
    cmd->add_option("--set", a->sets, "Op parameter: key=value (repeatable)");
    cmd->add_option("--device", a->device, "Where the op runs: cpu, or cuda (inputs copied to the GPU, outputs back)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    cmd->add_flag("--list", a->list, "List every op with its inputs, parameters, outputs and devices");
    cmd->callback([a] {
        const ops::OpRegistry& reg = ops::op_registry();
        if (a->list) {
            if (!a->name.empty() || !a->in.empty() || !a->out.empty() || !a->sets.empty())
                throw CLI::ValidationError("op", "--list takes no op name, --in, --out or --set");
            for (const auto& op : reg.all()) std::cout << ops::describe_op(op) << "\n";
            return;
        }
        if (a->name.empty()) throw CLI::ValidationError("op", "an op name is required (or --list)");
        const ops::OpDef* op = reg.find(a->name);
        if (!op) {
            std::string names;
            for (const auto& o : reg.all()) names += (names.empty() ? "" : ", ") + o.name;
            throw Error(fmt::format("unknown op \"{}\" (ops: {})", a->name, names));
        }
        if (a->in.empty() || a->out.empty()) throw CLI::ValidationError("op", "--in and --out are required");
        std::map<std::string, std::string> params;
        for (const auto& s : a->sets) {
            auto eq = s.find('=');
            if (eq == std::string::npos || eq == 0) throw Error(fmt::format("--set {}: expected key=value", s));
            params[s.substr(0, eq)] = s.substr(eq + 1);
        }
        SafetensorsFile f(a->in);
        std::map<std::string, Tensor> inputs;
        for (const auto& e : f.entries()) inputs.emplace(e.name, f.load(e.name));
        const Device device = a->device == "cuda" ? Device::cuda : Device::cpu;
        if (device == Device::cuda)
            TESSERA_CHECK(cuda_available(), "--device cuda: {}",
                          cuda_built() ? "no CUDA device is visible on this machine"
                                       : "this build has no CUDA backend (configure with -DTESSERA_CUDA=ON)");
        auto outputs = ops::run_op(*op, std::move(inputs), params, device);
        std::vector<NamedTensor> named;
        for (auto& [k, v] : outputs) named.push_back({k, v.view()});
        write_safetensors(a->out, named, {{"op", op->name}});
        std::cout << fmt::format("{} ({}): wrote {} tensors to {}\n", op->name, a->device, named.size(), a->out);
    });
}

}  // namespace tessera::apps
