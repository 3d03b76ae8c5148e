// tessera data: tokenize text and JSON Lines files into a token shard for training (data.path).
#include <iostream>

#include "apps/commands.h"
#include "train/data/token_source.h"

namespace tessera::apps {

void add_data_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "data", "Tokenize .txt / .jsonl files (byte tokenizer, or a checkpoint's with --tokenizer) into a token shard");
    auto inputs = std::make_shared<std::vector<std::string>>();
    auto out = std::make_shared<std::string>();
    auto opts = std::make_shared<train::ShardOptions>();
    cmd->add_option(
           "inputs", *inputs,
           "Files, or directories of .txt and .jsonl files: a .txt file is one document; a .jsonl line is "
           "{\"text\": ...} or {\"prompt\": ..., \"completion\": ...} (loss on the completion only), either with "
           "\"images\": [files of Kimi's processor: pixel_values, image_grid_hws], one per image token in "
           "the text (a --tokenizer checkpoint with an image tower, Kimi K3)")
        ->required();
    cmd->add_option("--out", *out, "Output shard (.safetensors)")->required();
    cmd->add_option("--tokenizer", opts->tokenizer,
                    "A Hugging Face checkpoint directory: its tokenizer.json, or tiktoken.model + "
                    "tokenizer_config.json (default: the byte tokenizer)");
    cmd->add_option("--eos", opts->eos,
                    "The token that ends each document (default: tokenizer_config.json's eos_token)");
    cmd->callback([inputs, out, opts] {
        if (!out->ends_with(".safetensors"))
            throw Error(fmt::format("--out {}: a shard must end in .safetensors", *out));
        const train::ShardInfo info = train::write_token_shard(*inputs, *out, *opts);
        std::cout << fmt::format("{}: {} tokens from {} documents ({} tokenizer, vocab {}){}{}\n", *out,
                                 info.num_tokens, info.num_documents, info.tokenizer, info.vocab_size,
                                 info.num_targets < info.num_tokens
                                     ? fmt::format("; {} of them training targets (prompts{} masked)", info.num_targets,
                                                   info.num_images > 0 ? " and image tokens" : "")
                                     : "",
                                 info.num_images > 0 ? fmt::format("; {} images", info.num_images) : "");
    });
}

}  // namespace tessera::apps
