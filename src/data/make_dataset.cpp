#include "data/make_dataset.h"

#include <fmt/format.h>

#include "data/image_caption.h"
#include "data/sft.h"
#include "data/shards.h"
#include "data/synthetic.h"

namespace ndt {

Result<std::unique_ptr<Dataset>> make_dataset(const DataConfig& cfg, const Tokenizer& tok, bool validation,
                                              const EncoderConfig& encoder) {
  if (cfg.task == "addition") {
    if (cfg.addition_digits < 1 || cfg.addition_digits > 18)
      return Status::error(
          fmt::format("data.addition_digits must be in 1..18 (got {})", cfg.addition_digits));
    return std::unique_ptr<Dataset>(std::make_unique<AdditionTask>(cfg.addition_digits, cfg.seed, tok,
                                                                   validation, cfg.addition_label_noise));
  }
  if (cfg.task == "sort") {
    if (cfg.addition_digits < 1 || cfg.addition_digits > 18)
      return Status::error(
          fmt::format("data.addition_digits (the sort task's length knob) must be in 1..18 (got {})",
                      cfg.addition_digits));
    return std::unique_ptr<Dataset>(
        std::make_unique<SortTask>(sort_max_len(cfg.addition_digits), cfg.seed, tok, validation));
  }
  if (cfg.task == "lm") {
    if (cfg.seq_len < 1) return Status::error(fmt::format("data.seq_len must be >= 1 (got {})", cfg.seq_len));
    return std::unique_ptr<Dataset>(
        std::make_unique<LmTask>(cfg.seq_len, cfg.seed, tok, validation ? "val" : "train", cfg.min_seq_len));
  }
  if (cfg.task == "image_caption") {
    if (!encoder.enabled())
      return Status::error(
          "data.task image_caption needs an image encoder: set encoder.image_size (e.g. 16)");
    // The task checks its shapes (image vs digits, patches, seq_len) on construction; a boundary returns
    // them.
    try {
      return std::unique_ptr<Dataset>(std::make_unique<ImageCaptionTask>(cfg, encoder, tok, validation));
    } catch (const Error& e) {
      return Status::error(e.what());
    }
  }
  if (cfg.task != "shards" && cfg.task != "sft")
    return Status::error(fmt::format(
        "data.task is '{}'; expected \"addition\", \"sort\", \"lm\", \"image_caption\", \"shards\" or "
        "\"sft\"",
        cfg.task));
  const std::string& path = validation ? cfg.val_path : cfg.path;
  if (path.empty())
    return Status::error(
        fmt::format("data.task '{}' needs data.{}", cfg.task, validation ? "val_path" : "path"));
  if (cfg.task == "shards") {
    auto d = ShardDataset::open(path, cfg.seq_len);
    if (!d) return d.status();
    if (d.value()->vocab_size() > tok.vocab_size())
      return Status::error(
          fmt::format("shards '{}' were written for a vocabulary of {} tokens but tokenizer {} has {}", path,
                      d.value()->vocab_size(), tok.name(), tok.vocab_size()));
    return std::unique_ptr<Dataset>(std::move(d).value());
  }
  auto tmpl = ChatTemplate::named(cfg.chat_template);
  if (!tmpl) return tmpl.status();
  auto d = SftDataset::load(path, tok, cfg.seq_len, tmpl.value());
  if (!d) return d.status();
  return std::unique_ptr<Dataset>(std::move(d).value());
}

}  // namespace ndt
