// Fuzz targets: each feeds one input through a parser's real entry point. Success and tessera::Error (a clean
// one-line error) are fine; any other exception escapes (a raw library message is a bug too), and a crash is a
// crash. libFuzzer calls them from fuzz_main.cpp (scripts/fuzz.sh builds one binary per target with
// AddressSanitizer and UBSan); the ordinary build replays tests/fuzz/corpus/<target>/ through them
// (test_fuzz_corpus.cpp), so every input a fuzzer once found stays a regression test.
#pragma once

#include <cstdint>
#include <span>

namespace tessera::fuzz {

using Input = std::span<const uint8_t>;

// The whole input as a safetensors file (header length, JSON header, data): parse_safetensors.
void safetensors(Input data);
// A run config: the text up to the first NUL byte is the config file, each further NUL-separated piece a
// --set assignment; then load as `tessera train --config FILE --set ...` does (parse, overrides, validation).
void config(Input data);
// model.safetensors.index.json: parse_hf_index.
void hf_index(Input data);
// A token shard file (`tessera data` output): TokenSource, then a data loader over it when it has the tokens.
void token_shard(Input data);
// One registered op on tensors and parameters drawn from the input (fuzz_op.cpp): `tessera op`'s run_op.
void op(Input data);

}  // namespace tessera::fuzz
