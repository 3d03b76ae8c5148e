// A shared library opened at run time (dlopen) and its functions bound by name: the CUDA libraries a process loads
// only when it first needs them (cuBLAS at the first GEMM, NCCL at the first link), so CPU runs of a CUDA build never
// map them. Opened once and never closed (the bound functions live as long as the process).
#pragma once

#include <dlfcn.h>

#include <string>

#include "core/check.h"

namespace tessera {

class DynamicLibrary {
  public:
    // `soname` through the loader's search (the executable's run path, the cache), else `fallback` (a path; may be
    // null); `what` names the library in errors.
    DynamicLibrary(const std::string& soname, const char* fallback, const char* what) : name_(soname), what_(what) {
        handle_ = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!handle_ && fallback) handle_ = dlopen(fallback, RTLD_NOW | RTLD_LOCAL);
        TESSERA_CHECK(handle_, "{}: cannot load {} ({})", what_, soname, dlerror());
    }
    // f = the library's function `symbol` (a one-line error when it has none)
    template <class F>
    void bind(F& f, const char* symbol) const {
        f = reinterpret_cast<F>(dlsym(handle_, symbol));
        TESSERA_CHECK(f, "{}: {} has no {}", what_, name_, symbol);
    }

  private:
    std::string name_;
    const char* what_;
    void* handle_ = nullptr;
};

}  // namespace tessera
