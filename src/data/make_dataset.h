#pragma once
// Builds the dataset a config asks for.
#include <memory>

#include "core/status.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

// task "addition" | "sort" | "lm": embedded synthetic generators; validation = true gives an independent
//   stream (addition, sort: the held-out eval split; lm: another Philox stream of the same seed).
// task "image_caption": the embedded image-caption generator (data/image_caption.h) shaped by `encoder`,
//   which must be enabled (encoder.image_size > 0); validation = true gives the held-out eval split.
// task "shards": cfg.path (validation: cfg.val_path), a .bin file or a directory of them.
// task "sft": cfg.path (validation: cfg.val_path), a JSONL file.
// For shards/sft with validation = true an empty val_path is an error. The tokenizer must outlive the
// returned dataset (synthetic tasks keep a reference).
// `encoder` matters to image_caption only.
Result<std::unique_ptr<Dataset>> make_dataset(const DataConfig& cfg, const Tokenizer& tok, bool validation,
                                              const EncoderConfig& encoder = {});

}  // namespace ndt
