// libFuzzer entry point for one target, chosen at compile time (TESSERA_FUZZ_TARGET; scripts/fuzz.sh).
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    tessera::fuzz::TESSERA_FUZZ_TARGET(std::span<const uint8_t>(data, size));
    return 0;
}
