#include "train/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

namespace ndt {

namespace {
constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <typename T>
void put_le(std::string& out, T v) {  // fixed-width little endian (x86-64 and every target we build for)
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
// A length-delimited field (wire type 2).
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = kCrcTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t mask_crc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    v.push_back(static_cast<char>(2 << 3 | 5));  // simple_value: fixed32
    put_le(v, value);
    put_bytes(summary, 1, v);
  }
  std::string ev;
  ev.push_back(static_cast<char>(1 << 3 | 1));  // wall_time: fixed64
  put_le(ev, wall_time);
  ev.push_back(static_cast<char>(2 << 3 | 0));  // step: varint (two's complement for negatives)
  put_varint(ev, static_cast<uint64_t>(step));
  put_bytes(ev, 5, summary);
  return ev;
}

std::string frame_record(const std::string& payload) {
  std::string rec;
  put_le(rec, static_cast<uint64_t>(payload.size()));
  put_le(rec, mask_crc(crc32c(rec.data(), 8)));
  rec += payload;
  put_le(rec, mask_crc(crc32c(payload.data(), payload.size())));
  return rec;
}

Result<TensorBoardWriter> TensorBoardWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return Status::error(fmt::format("cannot create TensorBoard directory '{}': {}", dir, ec.message()));
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = unix_seconds();
  TensorBoardWriter w;
  w.path_ = (std::filesystem::path(dir) /
             fmt::format("events.out.tfevents.{}.{}.ndtrain", static_cast<int64_t>(now), host))
                .string();
  w.out_.open(w.path_, std::ios::binary | std::ios::trunc);
  if (!w.out_) return Status::error(fmt::format("cannot open '{}' for writing", w.path_));
  std::string ev;
  ev.push_back(static_cast<char>(1 << 3 | 1));
  put_le(ev, now);
  put_bytes(ev, 3, "brain.Event:2");  // file_version
  Status s = w.put(ev);
  if (!s.is_ok()) return s;
  return w;
}

Status TensorBoardWriter::add(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  if (scalars.empty()) return Status::ok();
  return put(encode_scalars_event(unix_seconds(), step, scalars));
}

Status TensorBoardWriter::put(const std::string& payload) {
  const std::string rec = frame_record(payload);
  out_.write(rec.data(), static_cast<std::streamsize>(rec.size()));
  out_.flush();
  if (!out_) return Status::error(fmt::format("write to '{}' failed (disk full?)", path_));
  return Status::ok();
}

}  // namespace ndt
