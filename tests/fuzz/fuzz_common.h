#pragma once
// Shared helpers of the libFuzzer targets (tests/fuzz/CMakeLists.txt, docs/reliability.md).
//
// Contract of every target: a parser may reject its input with a Status or an ndt::Error (caught here);
// anything else — a sanitizer report, another exception escaping, an abort, a hang or an allocation beyond
// libFuzzer's -rss_limit_mb / -malloc_limit_mb — is a bug. Parsers that only take a path read the input
// from a file in this process's temporary directory.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/check.h"

namespace ndt::fuzz {

// A fresh directory of this process under $TMPDIR (or /tmp), removed at a normal exit.
inline const std::string& temp_dir() {
  static const std::string* dir = [] {
    auto* d = new std::string((std::filesystem::temp_directory_path() / "ndt_fuzz_XXXXXX").string());
    if (!mkdtemp(d->data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return d;
  }();
  return *dir;
}

// temp_dir()/name (sub-directories are created).
inline std::string path(const std::string& name) {
  const std::filesystem::path p = std::filesystem::path(temp_dir()) / name;
  std::error_code ec;
  std::filesystem::create_directories(p.parent_path(), ec);
  return p.string();
}

// Writes bytes to temp_dir()/name; returns the path.
inline std::string write_file(const std::string& name, std::string_view bytes) {
  const std::string p = path(name);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", p.c_str());
    std::abort();
  }
  return p;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Runs f; a parser's rejection (ndt::Error) is an accepted outcome.
template <typename F>
void guarded(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

// A broken property (not a parser error): report and abort, so that libFuzzer keeps the input.
[[noreturn]] inline void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz property failed: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace ndt::fuzz
