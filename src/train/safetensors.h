#pragma once
// The Hugging Face safetensors format (https://github.com/huggingface/safetensors):
//   8 bytes   N, little-endian uint64: header length
//   N bytes   JSON header {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//             optional "__metadata__": {str: str}}, padded with spaces to a multiple of 8
//   rest      data buffer; offsets are relative to its start, tensors are row-major little-endian
// Our dtypes map to F32, BF16 (raw 16-bit words), I32, I64 and F64.
// Files are read lazily: open_safetensors() reads and validates the header only, read() fetches one
// tensor, so a multi-GB checkpoint is never held in memory twice.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ndt {

// Writes `tensors` (CPU, any of our dtypes) in the order given, to path + ".tmp" then renames onto
// `path`, so a crash never leaves a half-written file under the real name. Creates parent directories.
// Fails on duplicate or empty names, undefined or non-CPU tensors.
Status save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

struct SafetensorInfo {
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer
};

// A validated, open safetensors file. Copies share the underlying file handle; not thread-safe.
class SafetensorsFile {
 public:
  const std::string& path() const { return path_; }
  // Tensor names in data-buffer order.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return info_.count(name) != 0; }
  // Throws ndt::Error naming the file if `name` is not in it.
  const SafetensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Reads one tensor into a new CPU tensor. Throws ndt::Error (naming file and tensor) on an unknown
  // name or a read failure (the file changed after open).
  Tensor read(const std::string& name) const;
  // Reads into existing CPU storage (e.g. a parameter); dtype and shape must match exactly.
  Status read_into(const std::string& name, Tensor& dst) const;

 private:
  friend Result<SafetensorsFile> open_safetensors(const std::string& path);
  std::string path_;
  uint64_t data_start_ = 0;  // 8 + N
  std::vector<std::string> names_;
  std::map<std::string, SafetensorInfo> info_;
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<std::FILE> file_;
};

// Opens and validates the header: file too short, header length beyond the file, invalid JSON, bad
// entries, unknown dtype, offsets out of bounds / overlapping / leaving gaps / not matching
// dtype*shape, data buffer size mismatch. Every error names the file (and the tensor).
Result<SafetensorsFile> open_safetensors(const std::string& path);

// "F32" <-> DType. Returns false for dtypes we do not support (F16, U8, ...).
const char* safetensors_dtype_name(DType dt);
bool safetensors_dtype_from_name(const std::string& s, DType* out);

}  // namespace ndt
