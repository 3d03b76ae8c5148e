// Which instruction set the CPU kernels run with: the one tessera's own kernels were compiled for
// (TESSERA_ARCH, fixed at build time) and the one oneDNN dispatches to at run time (the CPU's best,
// or DNNL_MAX_CPU_ISA). Benchmarks and the training progress name both: speed depends on them.
#pragma once

#include <string>

namespace tessera::ops {

const char* kernel_isa();   // "avx512", "avx2" or "x86-64" (the compile-time target of ops/cpu)
std::string onednn_isa();   // e.g. "avx512_core_bf16", "avx2"
std::string cpu_model();    // /proc/cpuinfo's model name, or "unknown"
std::string isa_summary();  // "kernels avx2, oneDNN avx2 (AMD EPYC ...)"

}  // namespace tessera::ops
