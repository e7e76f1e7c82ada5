// Fuzz target: the safetensors reader (train/safetensors.h). The input is a whole .safetensors file: the
// header is validated, every tensor is read, and a file that opens is saved again and must reopen to the
// same names, metadata, dtypes, shapes and bytes.
#include <cstring>

#include "fuzz_common.h"
#include "train/safetensors.h"

using namespace ndt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in = fuzz::write_file("in.safetensors", fuzz::as_text(data, size));
  try {
    auto f = open_safetensors(in);
    if (!f) return 0;
    const SafetensorsFile& file = f.value();
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : file.names()) tensors.emplace_back(name, file.read(name));

    const std::string out = fuzz::path("out.safetensors");
    if (!save_safetensors(out, tensors, file.metadata())) return 0;  // e.g. a tensor named ""
    auto g = open_safetensors(out);
    if (!g) fuzz::property_failed("saved file does not reopen", g.status().message());
    if (g.value().names() != file.names() || g.value().metadata() != file.metadata())
      fuzz::property_failed("round trip", "names or metadata differ");
    for (const auto& [name, t] : tensors) {
      const Tensor u = g.value().read(name);
      if (u.dtype() != t.dtype() || u.shape() != t.shape() ||
          (t.nbytes() && std::memcmp(u.data_ptr(), t.data_ptr(), t.nbytes()) != 0))
        fuzz::property_failed("round trip", "tensor " + name + " differs");
    }
  } catch (const Error&) {
  }
  return 0;
}
