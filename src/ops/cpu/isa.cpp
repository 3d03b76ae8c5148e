// ISA names (see ops/isa.h).
#include "ops/isa.h"

#include <dnnl.h>

#include <fstream>

namespace tessera::ops {

const char* kernel_isa() {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "x86-64";
#endif
}

std::string onednn_isa() {
    switch (dnnl_get_effective_cpu_isa()) {
        case dnnl_cpu_isa_sse41:
            return "sse41";
        case dnnl_cpu_isa_avx:
            return "avx";
        case dnnl_cpu_isa_avx2:
            return "avx2";
        case dnnl_cpu_isa_avx2_vnni:
            return "avx2_vnni";
        case dnnl_cpu_isa_avx512_core:
            return "avx512_core";
        case dnnl_cpu_isa_avx512_core_vnni:
            return "avx512_core_vnni";
        case dnnl_cpu_isa_avx512_core_bf16:
            return "avx512_core_bf16";
        case dnnl_cpu_isa_avx512_core_amx:
            return "avx512_core_amx";
        default:
            return "other";
    }
}

std::string cpu_model() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const size_t colon = line.find(':');
            if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
        }
    }
    return "unknown";
}

std::string isa_summary() {
    return std::string("kernels ") + kernel_isa() + ", oneDNN " + onednn_isa() + " (" + cpu_model() + ")";
}

}  // namespace tessera::ops
