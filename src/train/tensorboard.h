#pragma once
// TensorBoard event files written natively (no TensorFlow, no protobuf library): the TFRecord framing and
// the few protobuf fields a scalar summary needs, encoded by hand.
//
// A file is a sequence of records: uint64 length (little endian), uint32 masked CRC-32C of those 8 bytes,
// `length` bytes of a serialized tensorflow.Event, uint32 masked CRC-32C of the data. The first event holds
// file_version "brain.Event:2"; each later one wall_time, step and a Summary of (tag, simple_value) pairs.
// Masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ndt {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of n bytes, and the TFRecord mask of a CRC.
uint32_t crc32c(const void* data, size_t n);
uint32_t mask_crc(uint32_t crc);

// The serialized tensorflow.Event of one step's scalars (fields: 1 wall_time double, 2 step int64,
// 5 summary { repeated 1 value { 1 tag string, 2 simple_value float } }).
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars);
// One TFRecord around a payload.
std::string frame_record(const std::string& payload);

// Writes dir/events.out.tfevents.<unix seconds>.<host>.ndtrain (dir created). Every add() is flushed, so
// the file is valid up to the last record if the run dies. Not thread-safe; rank 0's business.
class TensorBoardWriter {
 public:
  static Result<TensorBoardWriter> open(const std::string& dir);
  Status add(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::string& path() const { return path_; }

 private:
  Status put(const std::string& payload);
  std::string path_;
  std::ofstream out_;
};

}  // namespace ndt
