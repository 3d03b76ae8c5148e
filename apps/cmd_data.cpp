// tessera data: tokenize text files into a token shard for training (data.path).
#include <iostream>

#include "apps/commands.h"
#include "train/data/token_source.h"

namespace tessera::apps {

void add_data_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("data", "Tokenize text files (byte tokenizer) into a token shard");
    auto inputs = std::make_shared<std::vector<std::string>>();
    auto out = std::make_shared<std::string>();
    cmd->add_option("inputs", *inputs, "Text files, or directories of .txt files (one document per file)")->required();
    cmd->add_option("--out", *out, "Output shard (.safetensors)")->required();
    cmd->callback([inputs, out] {
        if (!out->ends_with(".safetensors"))
            throw Error(fmt::format("--out {}: a shard must end in .safetensors", *out));
        train::ShardInfo info = train::write_token_shard(*inputs, *out);
        std::cout << fmt::format("{}: {} tokens from {} documents (byte tokenizer, vocab {})\n", *out, info.num_tokens,
                                 info.num_documents, info.vocab_size);
    });
}

}  // namespace tessera::apps
