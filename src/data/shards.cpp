#include "data/shards.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace ndt {

// Shards are read and written with memcpy of native integers: the format is little-endian.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

namespace fs = std::filesystem;

uint32_t shard_token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2u : 4u; }

namespace {

template <typename T>
void put(std::vector<uint8_t>& buf, size_t off, T v) {
  std::memcpy(buf.data() + off, &v, sizeof(T));
}
template <typename T>
T get_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

Status write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size > (int64_t{1} << 31))
    return Status::error(fmt::format("token shard '{}': invalid vocab_size {}", path, vocab_size));
  const uint32_t tb = shard_token_bytes(vocab_size);
  std::vector<uint8_t> buf(static_cast<size_t>(kShardHeaderBytes) + tokens.size() * tb, 0);
  std::memcpy(buf.data(), kShardMagic, 8);
  put<uint32_t>(buf, 8, kShardVersion);
  put<uint32_t>(buf, 12, tb);
  put<uint64_t>(buf, 16, tokens.size());
  put<uint64_t>(buf, 24, static_cast<uint64_t>(vocab_size));
  uint8_t* p = buf.data() + kShardHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= vocab_size)
      return Status::error(fmt::format("token shard '{}': token {} at position {} is outside [0, {})", path,
                                       t, i, vocab_size));
    if (tb == 2) {
      const uint16_t v = static_cast<uint16_t>(t);
      std::memcpy(p + i * 2, &v, 2);
    } else {
      const uint32_t v = static_cast<uint32_t>(t);
      std::memcpy(p + i * 4, &v, 4);
    }
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f)
    return Status::error(
        fmt::format("token shard '{}': cannot open for writing: {}", path, std::strerror(errno)));
  f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  f.close();
  if (!f) return Status::error(fmt::format("token shard '{}': write failed", path));
  return Status::ok();
}

TokenShard::~TokenShard() {
  if (map_) munmap(const_cast<uint8_t*>(map_), map_bytes_);
}

Result<std::unique_ptr<TokenShard>> TokenShard::open(const std::string& path) {
  auto err = [&](const std::string& what) {
    return Status::error(fmt::format("token shard '{}': {}", path, what));
  };
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return err(fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat stbuf;
  if (fstat(fd, &stbuf) != 0) {
    ::close(fd);
    return err(fmt::format("cannot stat: {}", std::strerror(errno)));
  }
  const uint64_t size = static_cast<uint64_t>(stbuf.st_size);
  if (size < static_cast<uint64_t>(kShardHeaderBytes)) {
    ::close(fd);
    return err(fmt::format("truncated: {} bytes, smaller than the {}-byte header", size, kShardHeaderBytes));
  }
  void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) return err(fmt::format("mmap failed: {}", std::strerror(errno)));
  std::unique_ptr<TokenShard> s(new TokenShard());
  s->path_ = path;
  s->map_ = static_cast<const uint8_t*>(m);
  s->map_bytes_ = size;

  const uint8_t* h = s->map_;
  if (std::memcmp(h, kShardMagic, 8) != 0) return err("wrong magic (not an NDTSHARD token shard)");
  s->header_.version = get_le<uint32_t>(h + 8);
  s->header_.token_bytes = get_le<uint32_t>(h + 12);
  s->header_.num_tokens = get_le<uint64_t>(h + 16);
  s->header_.vocab_size = get_le<uint64_t>(h + 24);
  const ShardHeader& hd = s->header_;
  if (hd.version != kShardVersion)
    return err(fmt::format("unknown version {} (this build reads version {})", hd.version, kShardVersion));
  if (hd.token_bytes != 2 && hd.token_bytes != 4)
    return err(fmt::format("token_bytes is {}, expected 2 or 4", hd.token_bytes));
  if (hd.vocab_size == 0 || hd.vocab_size > (uint64_t{1} << 31))
    return err(fmt::format("invalid vocab_size {}", hd.vocab_size));
  const uint64_t payload = size - static_cast<uint64_t>(kShardHeaderBytes);
  if (hd.num_tokens > payload / hd.token_bytes || payload != hd.num_tokens * hd.token_bytes)
    return err(
        fmt::format("file size {} does not match the header ({} tokens of {} bytes = {} bytes + {} header); "
                    "truncated or corrupt",
                    size, hd.num_tokens, hd.token_bytes, static_cast<double>(hd.num_tokens) * hd.token_bytes,
                    kShardHeaderBytes));
  // One linear scan at open so that a bad id is reported with its file, not as an embedding out of range.
  const uint8_t* p = s->map_ + kShardHeaderBytes;
  for (uint64_t i = 0; i < hd.num_tokens; ++i) {
    const uint64_t t = hd.token_bytes == 2 ? get_le<uint16_t>(p + i * 2) : get_le<uint32_t>(p + i * 4);
    if (t >= hd.vocab_size)
      return err(fmt::format("token id {} at position {} is >= vocab_size {}", t, i, hd.vocab_size));
  }
  return s;
}

int32_t TokenShard::token(int64_t i) const {
  NDT_CHECK(i >= 0 && i < num_tokens(), "token index {} outside [0, {}) in '{}'", i, num_tokens(), path_);
  const uint8_t* p = map_ + kShardHeaderBytes;
  return header_.token_bytes == 2 ? static_cast<int32_t>(get_le<uint16_t>(p + i * 2))
                                  : static_cast<int32_t>(get_le<uint32_t>(p + i * 4));
}

void TokenShard::read(int64_t begin, int64_t n, int32_t* out) const {
  NDT_CHECK(begin >= 0 && n >= 0 && begin + n <= num_tokens(), "token range [{}, {}) outside [0, {}) in '{}'",
            begin, begin + n, num_tokens(), path_);
  const uint8_t* p = map_ + kShardHeaderBytes;
  if (header_.token_bytes == 2) {
    for (int64_t i = 0; i < n; ++i) out[i] = get_le<uint16_t>(p + (begin + i) * 2);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(get_le<uint32_t>(p + (begin + i) * 4));
  }
}

Result<std::vector<int32_t>> read_token_shard(const std::string& path, ShardHeader* header) {
  auto s = TokenShard::open(path);
  if (!s) return s.status();
  const TokenShard& sh = *s.value();
  std::vector<int32_t> out(static_cast<size_t>(sh.num_tokens()));
  sh.read(0, sh.num_tokens(), out.data());
  if (header) *header = sh.header();
  return out;
}

// ---- ShardDataset ---------------------------------------------------------------------------------

Result<std::unique_ptr<ShardDataset>> ShardDataset::open(const std::string& path, int64_t seq_len) {
  if (seq_len < 1)
    return Status::error(fmt::format("shards '{}': seq_len must be >= 1 (got {})", path, seq_len));
  std::error_code ec;
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.is_regular_file() && e.path().extension() == ".bin") files.push_back(e.path().string());
    if (ec) return Status::error(fmt::format("shards '{}': cannot list directory: {}", path, ec.message()));
    std::sort(files.begin(), files.end());
    if (files.empty()) return Status::error(fmt::format("shards '{}': directory holds no .bin files", path));
  } else if (fs::exists(path, ec)) {
    files.push_back(path);
  } else {
    return Status::error(fmt::format("shards '{}': no such file or directory", path));
  }
  std::unique_ptr<ShardDataset> d(new ShardDataset());
  d->seq_len_ = seq_len;
  for (const std::string& f : files) {
    auto s = TokenShard::open(f);
    if (!s) return s.status();
    d->starts_.push_back(d->total_);
    d->total_ += s.value()->num_tokens();
    d->vocab_ = std::max(d->vocab_, s.value()->vocab_size());
    d->shards_.push_back(std::move(s).value());
  }
  d->starts_.push_back(d->total_);
  if (d->total_ < seq_len + 1)
    return Status::error(fmt::format("shards '{}': {} token(s) in {} file(s), fewer than seq_len + 1 = {}",
                                     path, d->total_, files.size(), seq_len + 1));
  d->size_ = (d->total_ - 1) / seq_len;
  return d;
}

Sample ShardDataset::get(int64_t index) const {
  NDT_CHECK(index >= 0 && index < size_, "shard sample {} outside [0, {})", index, size_);
  const int64_t n = seq_len_ + 1;
  int64_t pos = index * seq_len_;
  Sample s;
  s.tokens.resize(static_cast<size_t>(n));
  // First shard holding pos: the last start <= pos (zero-token shards are skipped by the loop below).
  size_t k =
      static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end() - 1, pos) - starts_.begin()) - 1;
  int64_t filled = 0;
  while (filled < n) {
    NDT_CHECK(k < shards_.size(), "shard window ran past the end of the stream");
    const int64_t local = pos - starts_[k];
    const int64_t take = std::min(n - filled, shards_[k]->num_tokens() - local);
    if (take > 0) {
      shards_[k]->read(local, take, s.tokens.data() + filled);
      filled += take;
      pos += take;
    }
    ++k;
  }
  s.loss_mask.assign(static_cast<size_t>(n), 1);
  s.loss_mask[0] = 0;
  return s;
}

// ---- tokenize_text_files --------------------------------------------------------------------------

namespace {

// Buffers tokens and writes full shards as they fill.
class ShardWriter {
 public:
  ShardWriter(std::string prefix, int64_t per_shard, int64_t vocab)
      : prefix_(std::move(prefix)), per_shard_(per_shard), vocab_(vocab) {}
  Status add(const std::vector<int32_t>& ids) {
    for (int32_t t : ids) {
      buf_.push_back(t);
      if (static_cast<int64_t>(buf_.size()) == per_shard_) {
        Status st = flush();
        if (!st) return st;
      }
    }
    return Status::ok();
  }
  Status flush() {
    if (buf_.empty()) return Status::ok();
    Status st = write_token_shard(fmt::format("{}_{:06d}.bin", prefix_, next_++), buf_, vocab_);
    total_ += static_cast<int64_t>(buf_.size());
    buf_.clear();
    return st;
  }
  int64_t total() const { return total_; }

 private:
  std::string prefix_;
  int64_t per_shard_, vocab_, total_ = 0;
  int next_ = 0;
  std::vector<int32_t> buf_;
};

}  // namespace

Status tokenize_text_files(const std::vector<std::string>& inputs, const Tokenizer& tok,
                           const std::string& out_prefix, int64_t tokens_per_shard, int64_t* total_tokens) {
  if (tokens_per_shard < 1)
    return Status::error(fmt::format("tokens_per_shard must be >= 1 (got {})", tokens_per_shard));
  if (inputs.empty()) return Status::error("tokenize: no input files");
  ShardWriter w(out_prefix, tokens_per_shard, tok.vocab_size());
  auto add_doc = [&](const std::string& text) {
    std::vector<int32_t> ids = tok.encode(text);
    ids.push_back(tok.eos_id());
    return w.add(ids);
  };
  for (const std::string& in : inputs) {
    std::ifstream f(in, std::ios::binary);
    if (!f) return Status::error(fmt::format("tokenize: cannot open '{}': {}", in, std::strerror(errno)));
    const bool jsonl = fs::path(in).extension() == ".jsonl";
    if (!jsonl) {
      std::ostringstream ss;
      ss << f.rdbuf();
      Status st = add_doc(ss.str());
      if (!st) return st;
      continue;
    }
    std::string line;
    int64_t lineno = 0;
    while (std::getline(f, line)) {
      ++lineno;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) return Status::error(fmt::format("{}:{}: invalid JSON", in, lineno));
      if (!j.is_object() || !j.contains("text"))
        return Status::error(fmt::format("{}:{}: expected an object with a \"text\" field", in, lineno));
      if (!j["text"].is_string())
        return Status::error(fmt::format("{}:{}: \"text\" must be a string", in, lineno));
      Status st = add_doc(j["text"].get<std::string>());
      if (!st) return st;
    }
  }
  Status st = w.flush();
  if (!st) return st;
  if (total_tokens) *total_tokens = w.total();
  return Status::ok();
}

}  // namespace ndt
