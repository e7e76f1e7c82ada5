#include "data/image_caption.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "core/rng.h"
#include "data/synthetic.h"

namespace ndt {

namespace {

// 3x5 glyphs of 0..9, one row per entry, bit 2 = leftmost column. Every glyph touches all four sides of
// its 3x5 box, so a glyph's position in the image is unambiguous (the tests recover captions by template
// matching against an independent copy of this font).
constexpr std::array<std::array<uint8_t, 5>, 10> kFont = {{
    {0b111, 0b101, 0b101, 0b101, 0b111},  // 0
    {0b010, 0b110, 0b010, 0b010, 0b111},  // 1
    {0b111, 0b001, 0b111, 0b100, 0b111},  // 2
    {0b111, 0b001, 0b111, 0b001, 0b111},  // 3
    {0b101, 0b101, 0b111, 0b001, 0b001},  // 4
    {0b111, 0b100, 0b111, 0b001, 0b111},  // 5
    {0b111, 0b100, 0b111, 0b101, 0b111},  // 6
    {0b111, 0b001, 0b001, 0b001, 0b001},  // 7
    {0b111, 0b101, 0b111, 0b101, 0b111},  // 8
    {0b111, 0b101, 0b111, 0b001, 0b111},  // 9
}};
constexpr int64_t kGlyphW = 3, kGlyphH = 5;

// Same construction as the synthetic tasks: distinct per (tag, index), injective in index.
uint64_t sample_stream(uint64_t tag, int64_t index) {
  return tag + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull;
}

struct Layout {
  int64_t size = 0, slot = 0, scale = 1;
  int64_t glyph_w() const { return kGlyphW * scale; }
  int64_t glyph_h() const { return kGlyphH * scale; }
};

Layout layout_of(const DataConfig& d, const EncoderConfig& e) {
  NDT_CHECK(d.caption_digits >= 1, "image_caption: data.caption_digits must be >= 1 (got {})",
            d.caption_digits);
  NDT_CHECK(e.channels >= 1, "image_caption: encoder.channels must be >= 1 (got {})", e.channels);
  NDT_CHECK(std::isfinite(d.image_noise) && d.image_noise >= 0,
            "image_caption: data.image_noise must be finite and >= 0 (got {})", d.image_noise);
  Layout l;
  l.size = e.image_size;
  l.slot = e.image_size > 0 ? e.image_size / d.caption_digits : 0;
  NDT_CHECK(l.size >= kGlyphH && l.slot >= kGlyphW,
            "image_caption: encoder.image_size = {} cannot hold data.caption_digits = {}: each digit needs a "
            "slot of at least {}x{} pixels (image_size / caption_digits >= {} and image_size >= {})",
            e.image_size, d.caption_digits, kGlyphW, kGlyphH, kGlyphW, kGlyphH);
  // 2x glyphs are easier to see through 4x4 patches and noise; fall back to 1x in small images.
  if (l.slot >= 2 * kGlyphW && l.size >= 2 * kGlyphH) l.scale = 2;
  return l;
}

struct Glyph {
  int digit = 0;
  int64_t x = 0, y = 0;  // top-left corner in the image
};

// The full description of a problem: digits and their positions (the held-out key).
std::string describe(const std::vector<Glyph>& gs) {
  std::string s;
  for (const Glyph& g : gs) s += fmt::format("{}@{},{};", g.digit, g.x, g.y);
  return s;
}

// Placeholders run contiguously up to "=", so the image token must differ from every text id the task
// writes (and from padding, which the batch appends after a sample).
void check_image_token(int32_t image_token, const Tokenizer& tok) {
  std::vector<int32_t> text = tok.encode("=0123456789");
  text.push_back(tok.bos_id());
  text.push_back(tok.eos_id());
  text.push_back(tok.pad_id());
  NDT_CHECK(
      std::find(text.begin(), text.end(), image_token) == text.end(),
      "image_caption: the image placeholder id {} (encoder.image_token) is also a text token of tokenizer "
      "{} ('=', a digit, BOS, EOS or PAD); use -1 (the first id past the vocabulary)",
      image_token, tok.name());
}

// [BOS] + placeholders + "=".
std::vector<int32_t> prompt_tokens(const EncoderConfig& e, const Tokenizer& tok) {
  NDT_CHECK(e.patch_size >= 1 && e.image_size % e.patch_size == 0,
            "image_caption: encoder.image_size ({}) must be divisible by encoder.patch_size ({})",
            e.image_size, e.patch_size);
  const int32_t image_token = image_token_id(e, tok);
  check_image_token(image_token, tok);
  std::vector<int32_t> p;
  p.push_back(tok.bos_id());
  p.insert(p.end(), static_cast<size_t>(e.patches()), image_token);
  for (int32_t t : tok.encode("=")) p.push_back(t);
  return p;
}

// make_microbatch cuts samples at seq_len + 1 tokens, which would silently drop the caption's end.
void check_fits(int64_t tokens, const DataConfig& d, const EncoderConfig& e) {
  NDT_CHECK(tokens <= d.seq_len + 1,
            "image_caption: a sample has {} tokens ([BOS], {} image placeholders, '=', {} caption digit(s), "
            "[EOS]) but data.seq_len = {} holds at most seq_len + 1 = {}; raise data.seq_len to >= {}",
            tokens, e.patches(), d.caption_digits, d.seq_len, d.seq_len + 1, tokens - 1);
}

}  // namespace

int32_t image_token_id(const EncoderConfig& cfg, const Tokenizer& tok) {
  NDT_CHECK(cfg.image_token >= -1, "encoder.image_token must be -1 or a token id >= 0 (got {})",
            cfg.image_token);
  const int64_t id = cfg.image_token == -1 ? tok.vocab_size() : cfg.image_token;
  NDT_CHECK(id <= std::numeric_limits<int32_t>::max(), "image token id {} does not fit in int32", id);
  return static_cast<int32_t>(id);
}

ImageCaptionProblem draw_image_caption(const DataConfig& d, const EncoderConfig& e, bool eval_split,
                                       int64_t index, bool render) {
  const Layout l = layout_of(d, e);
  NDT_CHECK(index >= 0, "negative sample index {}", index);
  static const uint64_t kTrain = stable_hash("image_caption/train"),
                        kEval = stable_hash("image_caption/eval");
  static const uint64_t kTrainNoise = stable_hash("image_caption/train/noise"),
                        kEvalNoise = stable_hash("image_caption/eval/noise");
  const auto seed = static_cast<uint64_t>(d.seed);
  CounterRng rng(seed, sample_stream(eval_split ? kEval : kTrain, index));

  // Rejection sampling as draw_addition_problem: ~1.1 draws per training problem, ~10 per eval one. The cap
  // trips only when a split is empty, e.g. one digit in a 3x5 image (10 problems in all).
  std::vector<Glyph> glyphs(static_cast<size_t>(d.caption_digits));
  bool found = false;
  for (int attempt = 0; attempt < 100000 && !found; ++attempt) {
    for (int64_t i = 0; i < d.caption_digits; ++i) {
      Glyph& g = glyphs[static_cast<size_t>(i)];
      g.digit = static_cast<int>(rng.uniform_int(0, 9));
      g.x = i * l.slot + rng.uniform_int(0, l.slot - l.glyph_w());
      g.y = rng.uniform_int(0, l.size - l.glyph_h());
    }
    found = is_held_out_text(describe(glyphs)) == eval_split;
  }
  if (!found)
    NDT_FAIL(
        "image_caption: no {} problem exists for encoder.image_size = {} and data.caption_digits = {} "
        "(too few distinct images); use a larger image",
        eval_split ? "eval" : "train", e.image_size, d.caption_digits);

  ImageCaptionProblem p;
  for (const Glyph& g : glyphs) p.caption += static_cast<char>('0' + g.digit);
  if (!render) return p;
  const int64_t plane = l.size * l.size;
  p.image.assign(static_cast<size_t>(e.channels * plane), 0.0f);
  for (int64_t c = 0; c < e.channels; ++c) {
    float* img = p.image.data() + c * plane;
    for (const Glyph& g : glyphs) {
      const float intensity = 0.6f + 0.4f * rng.uniform();
      for (int64_t r = 0; r < kGlyphH; ++r)
        for (int64_t col = 0; col < kGlyphW; ++col) {
          if (!((kFont[static_cast<size_t>(g.digit)][static_cast<size_t>(r)] >> (kGlyphW - 1 - col)) & 1))
            continue;
          for (int64_t dy = 0; dy < l.scale; ++dy)
            for (int64_t dx = 0; dx < l.scale; ++dx)
              img[(g.y + r * l.scale + dy) * l.size + g.x + col * l.scale + dx] = intensity;
        }
    }
  }
  // Noise is keyed by pixel index on its own stream, independent of how many draws the rejection took.
  if (d.image_noise > 0) {
    const uint64_t noise_stream = sample_stream(eval_split ? kEvalNoise : kTrainNoise, index);
    const auto sigma = static_cast<float>(d.image_noise);
    // Four normals per Philox call (two Box-Muller pairs): pixel i takes normal i % 4 of counter i / 4.
    constexpr double kTwoPi = 6.283185307179586;
    for (size_t k = 0; 4 * k < p.image.size(); ++k) {
      const auto r = philox4x32(seed, noise_stream, k);
      float z[4];
      for (int h = 0; h < 2; ++h) {
        const double u1 = (static_cast<double>(r[2 * h]) + 1.0) / 4294967297.0;  // (0, 1]
        const double rad = std::sqrt(-2.0 * std::log(u1)),
                     th = kTwoPi * static_cast<double>(r[2 * h + 1]) / 4294967296.0;
        z[2 * h] = static_cast<float>(rad * std::cos(th));
        z[2 * h + 1] = static_cast<float>(rad * std::sin(th));
      }
      for (size_t j = 0; j < 4 && 4 * k + j < p.image.size(); ++j) p.image[4 * k + j] += sigma * z[j];
    }
  }
  return p;
}

ImageCaptionTask::ImageCaptionTask(const DataConfig& d, const EncoderConfig& e, const Tokenizer& tok,
                                   bool eval_split)
    : data_(d), enc_(e), tok_(tok), eval_(eval_split) {
  layout_of(d, e);
  prompt_ = prompt_tokens(e, tok);
  // Fail at construction rather than at the first sample: an all-zero caption stands for any (get() still
  // checks each sample's real length, for tokenizers that merge digits).
  const auto caption_tokens =
      static_cast<int64_t>(tok.encode(std::string(static_cast<size_t>(d.caption_digits), '0')).size());
  check_fits(static_cast<int64_t>(prompt_.size()) + caption_tokens + 1, d, e);
}

Sample ImageCaptionTask::get_tokens(int64_t index) const {
  ImageCaptionProblem p = draw_image_caption(data_, enc_, eval_, index, /*render=*/false);
  Sample s;
  s.tokens = prompt_;
  s.loss_mask.assign(s.tokens.size(), 0);
  for (int32_t t : tok_.encode(p.caption)) s.tokens.push_back(t);
  s.tokens.push_back(tok_.eos_id());
  s.loss_mask.resize(s.tokens.size(), 1);
  check_fits(static_cast<int64_t>(s.tokens.size()), data_, enc_);
  return s;
}

Sample ImageCaptionTask::get(int64_t index) const {
  Sample s = get_tokens(index);
  s.image = draw_image_caption(data_, enc_, eval_, index).image;
  return s;
}

std::vector<ImageEvalProblem> image_caption_eval_problems(const DataConfig& d, const EncoderConfig& e,
                                                          const Tokenizer& tok, int64_t n) {
  const ImageCaptionTask checked(d, e, tok, true);  // the same shape and length checks as training
  (void)checked;
  const std::vector<int32_t> prompt = prompt_tokens(e, tok);
  std::vector<ImageEvalProblem> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) {
    ImageCaptionProblem p = draw_image_caption(d, e, true, i);
    out.push_back({prompt, std::move(p.image), std::move(p.caption)});
  }
  return out;
}

}  // namespace ndt
