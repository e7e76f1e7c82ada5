#pragma once
// Typed dlsym for the libraries loaded at run time (cuDNN, CUPTI): so a binary runs where they are absent.
#include <dlfcn.h>

namespace ndt::cuda {

// f = the symbol `name` of `lib` cast to f's function-pointer type; whether it was found.
template <typename F>
bool load_symbol(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  return f != nullptr;
}

}  // namespace ndt::cuda
