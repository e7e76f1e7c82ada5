// TensorBoard event files (train/tensorboard.h) read back by an independent parser: TFRecord framing, both
// masked CRC-32C (computed here bit by bit, not with the writer's table), the protobuf fields of every Event
// (file_version first, then wall_time, step and the summary's tag / simple_value pairs), and the values
// against the metrics.jsonl record they mirror. Also the CRC-32C check value of "123456789" (0xE3069283)
// and a corrupted byte being detected by the CRC.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "temp_dir.h"
#include "train/metrics.h"
#include "train/tensorboard.h"

namespace ndt {
namespace {

uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
uint32_t masked(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

template <typename T>
T le(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

// Splits a TFRecord file into payloads, checking both CRCs of each record.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  size_t at = 0;
  while (at < all.size()) {
    EXPECT_LE(at + 12, all.size()) << "truncated header";
    const auto len = le<uint64_t>(all, at);
    EXPECT_EQ(le<uint32_t>(all, at + 8), masked(crc32c_bitwise(all.substr(at, 8)))) << "length CRC";
    const std::string payload = all.substr(at + 12, len);
    EXPECT_EQ(le<uint32_t>(all, at + 12 + len), masked(crc32c_bitwise(payload))) << "data CRC";
    out.push_back(payload);
    at += 12 + len + 4;
  }
  EXPECT_EQ(at, all.size());
  return out;
}

struct Field {
  int number, wire;
  uint64_t varint = 0;
  std::string bytes;  // length-delimited, fixed32 and fixed64 raw bytes
};
std::vector<Field> parse_message(const std::string& m) {
  std::vector<Field> out;
  size_t at = 0;
  auto varint = [&] {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(m.at(at++));
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (at < m.size()) {
    const uint64_t key = varint();
    Field f{static_cast<int>(key >> 3), static_cast<int>(key & 7)};
    if (f.wire == 0) {
      f.varint = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      f.bytes = m.substr(at, n);
      at += n;
    } else if (f.wire == 2) {
      const size_t n = varint();
      f.bytes = m.substr(at, n);
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      break;
    }
    out.push_back(f);
  }
  return out;
}

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);
}

TEST(TensorBoard, EventsMirrorTheMetricsRecords) {
  testing::TempDir dir;
  const std::string out = (dir.path() / "run").string();
  std::vector<nlohmann::json> records = {
      {{"step", 0}, {"type", "train"}, {"loss", 5.25}, {"lr", 1e-3}, {"moe", {{"load", {1.5, 0.5}}}}},
      // "time" (the step's Unix time) is the event's wall time, not a scalar
      {{"step", 1},
       {"type", "train"},
       {"loss", 4.75},
       {"lr", 1e-3},
       {"note", "text is skipped"},
       {"time", 1.8e9}},
      {{"step", 1}, {"type", "eval"}, {"exact_match", 0.875}},
      {{"type", "summary"}, {"tokens", 12}},  // no step: JSON only
  };
  std::string tb_path;
  {
    MetricsWriter w = MetricsWriter::open(out, false, /*tensorboard=*/true).value();
    for (const auto& r : records) ASSERT_TRUE(w.write(r).is_ok());
    tb_path = w.tensorboard_path();
  }
  ASSERT_FALSE(tb_path.empty());
  EXPECT_EQ(std::filesystem::path(tb_path).parent_path().filename(), "tensorboard");
  EXPECT_NE(std::filesystem::path(tb_path).filename().string().find("events.out.tfevents."),
            std::string::npos);
  const std::vector<std::string> events = read_records(tb_path);
  ASSERT_EQ(events.size(), 4u);  // file_version + 3 stepped records

  const auto first = parse_message(events[0]);
  bool version = false;
  for (const Field& f : first) version |= f.number == 3 && f.bytes == "brain.Event:2";
  EXPECT_TRUE(version);

  std::vector<std::pair<int64_t, std::map<std::string, float>>> got;
  for (size_t e = 1; e < events.size(); ++e) {
    int64_t step = -1;
    std::map<std::string, float> values;
    bool wall = false;
    for (const Field& f : parse_message(events[e])) {
      if (f.number == 1 && f.wire == 1) wall = le<double>(f.bytes, 0) > 1.6e9;  // a plausible Unix time
      if (f.number == 2 && f.wire == 0) step = static_cast<int64_t>(f.varint);
      if (f.number == 5 && f.wire == 2)
        for (const Field& v : parse_message(f.bytes)) {
          ASSERT_EQ(v.number, 1);
          std::string tag;
          float x = NAN;
          for (const Field& g : parse_message(v.bytes)) {
            if (g.number == 1) tag = g.bytes;
            if (g.number == 2 && g.wire == 5) x = le<float>(g.bytes, 0);
          }
          values[tag] = x;
        }
    }
    EXPECT_TRUE(wall);
    got.emplace_back(step, values);
  }
  using M = std::map<std::string, float>;
  EXPECT_EQ(got[0].first, 0);
  EXPECT_EQ(got[0].second, (M{{"train/loss", 5.25f},
                              {"train/lr", 1e-3f},
                              {"train/moe/load/0", 1.5f},
                              {"train/moe/load/1", 0.5f}}));
  EXPECT_EQ(got[1].first, 1);
  EXPECT_EQ(got[1].second, (M{{"train/loss", 4.75f}, {"train/lr", 1e-3f}}));
  EXPECT_EQ(got[2].first, 1);
  EXPECT_EQ(got[2].second, (M{{"eval/exact_match", 0.875f}}));
  // The JSON lines are unchanged by the mirror.
  const auto back = read_metrics_jsonl(out + "/metrics.jsonl").value();
  ASSERT_EQ(back.size(), records.size());
  EXPECT_EQ(back[0]["loss"].get<double>(), 5.25);
}

TEST(TensorBoard, CorruptionIsCaughtByTheCrc) {
  const std::string rec = frame_record(encode_scalars_event(1.7e9, 3, {{"train/loss", 1.0f}}));
  std::string bad = rec;
  bad[14] ^= 0x01;  // one bit inside the payload
  const auto payload_len = le<uint64_t>(rec, 0);
  EXPECT_EQ(le<uint32_t>(rec, 12 + payload_len), masked(crc32c_bitwise(rec.substr(12, payload_len))));
  EXPECT_NE(le<uint32_t>(bad, 12 + payload_len), masked(crc32c_bitwise(bad.substr(12, payload_len))));
}

TEST(TensorBoard, OffByDefault) {
  testing::TempDir dir;
  MetricsWriter w = MetricsWriter::open((dir.path() / "run").string()).value();
  ASSERT_TRUE(w.write({{"step", 0}, {"loss", 1.0}}).is_ok());
  EXPECT_EQ(w.tensorboard_path(), "");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "run" / "tensorboard"));
}

}  // namespace
}  // namespace ndt
