#include "train/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

namespace ndt {

namespace fs = std::filesystem;

// Tensor bytes are copied as-is; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors IO assumes a little-endian host");

namespace {
// Same cap as the reference implementation: a larger header is corruption, not a real file.
constexpr uint64_t kMaxHeader = 100'000'000;
}  // namespace

const char* safetensors_dtype_name(DType dt) {
  switch (dt) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::F64:
      return "F64";
  }
  return "?";
}

bool safetensors_dtype_from_name(const std::string& s, DType* out) {
  for (DType dt : {DType::F32, DType::BF16, DType::I32, DType::I64, DType::F64})
    if (s == safetensors_dtype_name(dt)) {
      *out = dt;
      return true;
    }
  return false;
}

Status save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the header in the order given (readable with `head -c`).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) return Status::error(fmt::format("save_safetensors '{}': empty tensor name", path));
    if (name == "__metadata__")
      return Status::error(
          fmt::format("save_safetensors '{}': '__metadata__' is reserved, not a tensor name", path));
    if (!seen.insert(name).second)
      return Status::error(fmt::format("save_safetensors '{}': duplicate tensor name '{}'", path, name));
    if (!t.defined())
      return Status::error(fmt::format("save_safetensors '{}': tensor '{}' is undefined", path, name));
    if (t.device() != Device::CPU)
      return Status::error(
          fmt::format("save_safetensors '{}': tensor '{}' is on {}; copy it to the CPU first", path, name,
                      device_name(t.device())));
    const uint64_t n = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string hjson = header.dump();
  hjson.append((8 - hjson.size() % 8) % 8, ' ');  // data buffer starts 8-aligned

  std::error_code ec;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return Status::error(fmt::format("cannot open '{}' for writing: {}", tmp, std::strerror(errno)));
  uint8_t len[8];
  const uint64_t hn = hjson.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(hn >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(hjson.data(), 1, hn, f) == hn;
  for (const auto& [name, t] : tensors) {
    if (!ok) break;
    if (t.nbytes()) ok = std::fwrite(t.data_ptr(), 1, t.nbytes(), f) == t.nbytes();
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    fs::remove(tmp, ec);
    return Status::error(fmt::format("write to '{}' failed (disk full?)", path));
  }
  fs::rename(tmp, path, ec);
  if (ec) return Status::error(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
  return Status::ok();
}

Result<SafetensorsFile> open_safetensors(const std::string& path) {
  auto fail = [&](const std::string& what) {
    return Status::error(fmt::format("safetensors file '{}': {}", path, what));
  };
  std::FILE* raw = std::fopen(path.c_str(), "rb");
  if (!raw) return Status::error(fmt::format("safetensors file '{}' not found or unreadable", path));
  std::shared_ptr<std::FILE> file(raw, [](std::FILE* fp) { std::fclose(fp); });

  if (fseeko(raw, 0, SEEK_END) != 0) return fail("cannot seek");
  const uint64_t file_size = static_cast<uint64_t>(ftello(raw));
  std::rewind(raw);
  if (file_size < 8)
    return fail(fmt::format("file too short ({} bytes; needs at least the 8-byte header length)", file_size));
  uint8_t len[8];
  if (std::fread(len, 1, 8, raw) != 8) return fail("cannot read header length");
  uint64_t hn = 0;
  for (int i = 0; i < 8; ++i) hn |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (hn > file_size - 8)
    return fail(fmt::format("header length {} is larger than the file allows ({} bytes after the length)", hn,
                            file_size - 8));
  if (hn > kMaxHeader) return fail(fmt::format("header length {} exceeds the {} byte limit", hn, kMaxHeader));
  std::string hjson(hn, '\0');
  if (hn && std::fread(hjson.data(), 1, hn, raw) != hn) return fail("cannot read header");

  nlohmann::json header = nlohmann::json::parse(hjson, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return fail("header is not valid JSON");
  if (!header.is_object()) return fail("header must be a JSON object");

  SafetensorsFile out;
  out.path_ = path;
  out.data_start_ = 8 + hn;
  out.file_ = file;
  const uint64_t buffer_size = file_size - out.data_start_;

  auto as_u64 = [](const nlohmann::json& j, uint64_t* v) {
    if (!j.is_number_integer() || (j.is_number_integer() && !j.is_number_unsigned() && j.get<int64_t>() < 0))
      return false;
    *v = j.get<uint64_t>();
    return true;
  };
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) return fail("__metadata__ must be an object of strings");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string())
          return fail(fmt::format("__metadata__ value for '{}' is not a string", m.key()));
        out.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) { return fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!e.is_object()) return bad("entry must be an object with dtype, shape, data_offsets");
    auto dt = e.find("dtype"), sh = e.find("shape"), of = e.find("data_offsets");
    if (dt == e.end() || sh == e.end() || of == e.end())
      return bad("entry needs dtype, shape and data_offsets");
    SafetensorInfo info;
    if (!dt->is_string()) return bad("dtype must be a string");
    if (!safetensors_dtype_from_name(dt->get<std::string>(), &info.dtype))
      return bad(fmt::format("unknown or unsupported dtype '{}' (supported: F32, BF16, I32, I64, F64)",
                             dt->get<std::string>()));
    if (!sh->is_array()) return bad("shape must be an array of non-negative integers");
    // Every dim and the byte count (numel * element size) stay below 2^62: no overflow below, and a dim is
    // never cast to a negative int64 (a zero dim elsewhere would otherwise let any other dim through).
    const uint64_t max_numel = (uint64_t{1} << 62) / dtype_size(info.dtype);
    if (sh->size() > 64) return bad(fmt::format("shape has {} dims", sh->size()));
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      uint64_t v;
      if (!as_u64(d, &v)) return bad("shape must be an array of non-negative integers");
      if (v > max_numel || (v && numel > max_numel / v))
        return bad(fmt::format("shape {} is absurdly large", sh->dump()));
      numel *= v;
      info.shape.push_back(static_cast<int64_t>(v));
    }
    if (!of->is_array() || of->size() != 2 || !as_u64((*of)[0], &info.begin) || !as_u64((*of)[1], &info.end))
      return bad("data_offsets must be [begin, end] (non-negative integers)");
    if (info.end < info.begin)
      return bad(fmt::format("data_offsets [{}, {}] end before begin", info.begin, info.end));
    if (info.end > buffer_size)
      return bad(fmt::format("data_offsets [{}, {}] out of bounds (data buffer is {} bytes)", info.begin,
                             info.end, buffer_size));
    const uint64_t want = numel * dtype_size(info.dtype);
    if (info.end - info.begin != want)
      return bad(fmt::format("data_offsets [{}, {}] hold {} bytes but {} {} needs {}", info.begin, info.end,
                             info.end - info.begin, dt->get<std::string>(), shape_str(info.shape), want));
    out.names_.push_back(name);
    out.info_.emplace(name, std::move(info));
  }

  // Tensors must tile the buffer exactly: no overlap, no gap, nothing after the last one.
  std::stable_sort(out.names_.begin(), out.names_.end(), [&](const std::string& a, const std::string& b) {
    const auto &ia = out.info_.at(a), &ib = out.info_.at(b);
    return ia.begin != ib.begin ? ia.begin < ib.begin : ia.end < ib.end;
  });
  uint64_t pos = 0;
  const std::string* prev = nullptr;
  for (const auto& name : out.names_) {
    const auto& i = out.info_.at(name);
    if (i.begin < pos)
      return fail(fmt::format("tensor '{}' data_offsets [{}, {}] overlap tensor '{}' (ends at {})", name,
                              i.begin, i.end, prev ? *prev : std::string("?"), pos));
    if (i.begin > pos)
      return fail(fmt::format("gap in the data buffer: bytes [{}, {}) before tensor '{}' belong to no tensor",
                              pos, i.begin, name));
    pos = i.end;
    prev = &name;
  }
  if (pos != buffer_size)
    return fail(
        fmt::format("data buffer is {} bytes but the tensors cover {} (size mismatch, truncated or trailing "
                    "bytes)",
                    buffer_size, pos));
  return out;
}

const SafetensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = info_.find(name);
  if (it == info_.end()) NDT_FAIL("safetensors file '{}' has no tensor '{}'", path_, name);
  return it->second;
}

Status SafetensorsFile::read_into(const std::string& name, Tensor& dst) const {
  auto it = info_.find(name);
  if (it == info_.end())
    return Status::error(fmt::format("safetensors file '{}' has no tensor '{}'", path_, name));
  const SafetensorInfo& i = it->second;
  if (dst.dtype() != i.dtype || dst.shape() != i.shape)
    return Status::error(fmt::format("safetensors file '{}' tensor '{}' is {} {}, destination is {} {}",
                                     path_, name, safetensors_dtype_name(i.dtype), shape_str(i.shape),
                                     safetensors_dtype_name(dst.dtype()), shape_str(dst.shape())));
  if (dst.device() != Device::CPU)
    return Status::error(
        fmt::format("safetensors '{}' tensor '{}': destination must be a CPU tensor", path_, name));
  const uint64_t n = i.end - i.begin;
  if (n == 0) return Status::ok();
  std::FILE* f = file_.get();
  if (fseeko(f, static_cast<off_t>(data_start_ + i.begin), SEEK_SET) != 0 ||
      std::fread(dst.data_ptr(), 1, n, f) != n)
    return Status::error(
        fmt::format("safetensors file '{}': reading tensor '{}' failed (file changed?)", path_, name));
  return Status::ok();
}

Tensor SafetensorsFile::read(const std::string& name) const {
  Tensor t = Tensor::empty(info(name).shape, info(name).dtype);
  read_into(name, t).throw_if_error();
  return t;
}

}  // namespace ndt
