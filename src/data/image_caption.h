#pragma once
// Embedded synthetic image-caption task for a vision-language model (encoder + LLM, LLaVA style; no files,
// no downloads). An image shows data.caption_digits decimal digits drawn with a 3x5 bitmap font (scaled 2x
// when the slot allows), one per horizontal slot of width image_size / caption_digits, each at a uniformly
// random position inside its slot, with a random stroke intensity in [0.6, 1.0] per digit and channel,
// plus N(0, data.image_noise) noise on every pixel. The caption is the digits left to right ("37").
//
// Sample tokens: [BOS] + [image token] * encoder.patches() + "=" + caption + [EOS], the placeholders one
// contiguous run (their embeddings are replaced by the encoder's projected patches); loss_mask = 1 exactly
// on the caption and EOS. Sample::image is (channels, image_size, image_size) row-major f32.
//
// Sample `index` is a pure function of (data seed, split, index) through Philox (DESIGN.md §1): any rank
// rebuilds the same sample, bit for bit. Held-out split: a problem (digits and their positions) is an eval
// problem iff is_held_out_text of its description holds; each split redraws problems of the other, so no
// image of one split can appear in the other. The tasks keep a reference to their tokenizer: it must
// outlive them.
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "train/config.h"

namespace ndt {

// The placeholder token id of image patches: cfg.image_token, or tok.vocab_size() when it is -1.
int32_t image_token_id(const EncoderConfig& cfg, const Tokenizer& tok);

// One problem: the digits drawn and the image.
struct ImageCaptionProblem {
  std::string caption;       // the digits left to right, e.g. "37"
  std::vector<float> image;  // (channels, image_size, image_size) row-major
};

// Draws problem `index` of the chosen split for d.seed. Throws (naming the config keys) when the image
// cannot hold the digits: slot width image_size / caption_digits < 3 or image_size < 5. render = false: the
// caption only (the image left empty).
ImageCaptionProblem draw_image_caption(const DataConfig& d, const EncoderConfig& e, bool eval_split,
                                       int64_t index, bool render = true);

class ImageCaptionTask final : public Dataset {
 public:
  // eval_split = false: training problems only; true: held-out problems only, sample i being the problem
  // of image_caption_eval_problems(..)[i]. Throws when a sample cannot fit data.seq_len + 1 tokens.
  ImageCaptionTask(const DataConfig& d, const EncoderConfig& e, const Tokenizer& tok,
                   bool eval_split = false);
  int64_t size() const override { return -1; }
  Sample get(int64_t index) const override;
  Sample get_tokens(int64_t index) const override;  // no pixels rendered

 private:
  DataConfig data_;
  EncoderConfig enc_;
  const Tokenizer& tok_;
  bool eval_;
  std::vector<int32_t> prompt_;  // [BOS] + placeholders + "=": the same for every sample
};

// Held-out problems for exact match: prompt tokens (everything before the caption), image, caption.
struct ImageEvalProblem {
  std::vector<int32_t> prompt;
  std::vector<float> image;
  std::string answer;
};

// The first n eval-split problems (the samples of ImageCaptionTask(d, e, tok, true)).
std::vector<ImageEvalProblem> image_caption_eval_problems(const DataConfig& d, const EncoderConfig& e,
                                                          const Tokenizer& tok, int64_t n);

}  // namespace ndt
