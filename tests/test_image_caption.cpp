// Tests of the synthetic image-caption task: determinism, token layout, that the image really shows the
// caption (template matching against an independent copy of the font), held-out split and shape errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "data/image_caption.h"
#include "data/make_dataset.h"

using namespace ndt;

namespace {

// The task's defaults: 16x16 images, 4x4 patches (16 placeholders), two digits.
struct Shapes {
  DataConfig d;
  EncoderConfig e;
};

Shapes default_shapes() {
  Shapes s;
  s.d.task = "image_caption";
  s.d.seq_len = 32;
  s.e.image_size = 16;
  s.e.patch_size = 4;
  return s;
}

// 8x8, 3 channels, one digit (glyph at scale 1): 4 placeholders.
Shapes small_shapes() {
  Shapes s = default_shapes();
  s.d.caption_digits = 1;
  s.e.image_size = 8;
  s.e.channels = 3;
  return s;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Independent copy of a 3x5 digit font, written as strings.
const std::array<std::array<const char*, 5>, 10> kGlyphs = {{
    {"###", "#.#", "#.#", "#.#", "###"},
    {".#.", "##.", ".#.", ".#.", "###"},
    {"###", "..#", "###", "#..", "###"},
    {"###", "..#", "###", "..#", "###"},
    {"#.#", "#.#", "###", "..#", "..#"},
    {"###", "#..", "###", "..#", "###"},
    {"###", "#..", "###", "#.#", "###"},
    {"###", "..#", "..#", "..#", "..#"},
    {"###", "#.#", "###", "#.#", "###"},
    {"###", "#.#", "###", "..#", "###"},
}};

struct Match {
  int digit = -1;
  int64_t x = 0, y = 0;
  bool operator<(const Match& o) const { return std::tie(digit, x, y) < std::tie(o.digit, o.x, o.y); }
};

// Finds every (digit, position) whose rendering equals the binarized slot exactly (noise-free images:
// background 0, strokes >= 0.6). Returns the matches; a readable image has exactly one per slot.
std::vector<Match> match_slot(const float* plane, int64_t size, int64_t slot_w, int64_t slot, int64_t scale) {
  const int64_t x0 = slot * slot_w, gw = 3 * scale, gh = 5 * scale;
  std::vector<Match> out;
  for (int digit = 0; digit < 10; ++digit)
    for (int64_t x = x0; x + gw <= x0 + slot_w; ++x)
      for (int64_t y = 0; y + gh <= size; ++y) {
        bool same = true;
        for (int64_t r = 0; r < size && same; ++r)
          for (int64_t c = x0; c < x0 + slot_w && same; ++c) {
            const bool inside = r >= y && r < y + gh && c >= x && c < x + gw;
            const bool on = inside && kGlyphs[digit][(r - y) / scale][(c - x) / scale] == '#';
            same = on == (plane[r * size + c] > 0.3f);
          }
        if (same) out.push_back({digit, x, y});
      }
  return out;
}

// The caption read back from channel c of a noise-free image, and the glyph positions found ("" when a
// slot does not hold exactly one glyph).
std::string read_caption(const std::vector<float>& image, const Shapes& s, int64_t c, int64_t scale,
                         std::vector<Match>* where = nullptr) {
  const int64_t size = s.e.image_size, slot_w = size / s.d.caption_digits;
  std::string caption;
  for (int64_t i = 0; i < s.d.caption_digits; ++i) {
    const auto m = match_slot(image.data() + c * size * size, size, slot_w, i, scale);
    if (m.size() != 1) return "";
    caption += static_cast<char>('0' + m[0].digit);
    if (where) where->push_back(m[0]);
  }
  return caption;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ImageCaption, Deterministic) {
  auto tok = make_byte_tokenizer();
  const Shapes s = default_shapes();
  ImageCaptionTask a(s.d, s.e, *tok), b(s.d, s.e, *tok);
  for (int64_t i : {0, 1, 17, 123456}) {
    const Sample x = a.get(i), y = a.get(i), z = b.get(i);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.loss_mask, z.loss_mask);
    EXPECT_EQ(x.tokens, z.tokens);
    EXPECT_TRUE(bit_equal(x.image, y.image));
    EXPECT_TRUE(bit_equal(x.image, z.image));
    EXPECT_TRUE(bit_equal(x.image, draw_image_caption(s.d, s.e, false, i).image));
  }
}

TEST(ImageCaption, DifferentIndicesAndSeedsDiffer) {
  auto tok = make_byte_tokenizer();
  Shapes s = default_shapes();
  ImageCaptionTask t(s.d, s.e, *tok);
  std::set<std::string> captions;
  std::vector<std::vector<float>> images;
  for (int64_t i = 0; i < 50; ++i) {
    Sample x = t.get(i);
    captions.insert(tok->decode({x.tokens.end() - 3, x.tokens.end() - 1}));
    for (const auto& im : images) EXPECT_FALSE(bit_equal(im, x.image)) << "index " << i;
    images.push_back(std::move(x.image));
  }
  EXPECT_GT(captions.size(), 30u);  // 100 two-digit captions
  s.d.seed += 1;
  EXPECT_FALSE(bit_equal(images[0], draw_image_caption(s.d, s.e, false, 0).image));
}

TEST(ImageCaption, TokenLayoutAndLossMask) {
  auto tok = make_byte_tokenizer();
  for (const Shapes& s : {default_shapes(), small_shapes()}) {
    ImageCaptionTask t(s.d, s.e, *tok);
    const int64_t n_img = s.e.patches(), digits = s.d.caption_digits;
    for (int64_t i = 0; i < 20; ++i) {
      const Sample x = t.get(i);
      const ImageCaptionProblem p = draw_image_caption(s.d, s.e, false, i);
      ASSERT_EQ(static_cast<int64_t>(x.tokens.size()), 1 + n_img + 1 + digits + 1);
      ASSERT_EQ(x.loss_mask.size(), x.tokens.size());
      EXPECT_EQ(x.tokens.front(), tok->bos_id());
      for (int64_t k = 1; k <= n_img; ++k) EXPECT_EQ(x.tokens[k], 259);  // one contiguous run
      EXPECT_EQ(x.tokens[1 + n_img], '=');
      EXPECT_EQ(x.tokens.back(), tok->eos_id());
      EXPECT_EQ(tok->decode({x.tokens.begin() + 2 + n_img, x.tokens.end() - 1}), p.caption);
      ASSERT_EQ(static_cast<int64_t>(p.caption.size()), digits);
      for (size_t k = 0; k < x.tokens.size(); ++k)
        EXPECT_EQ(x.loss_mask[k], k >= static_cast<size_t>(2 + n_img) ? 1 : 0) << "token " << k;
      EXPECT_EQ(static_cast<int64_t>(x.image.size()), s.e.channels * s.e.image_size * s.e.image_size);
    }
  }
}

TEST(ImageCaption, ImageTokenId) {
  auto tok = make_byte_tokenizer();
  EncoderConfig e;
  EXPECT_EQ(image_token_id(e, *tok), 259);  // -1: first id past the byte vocabulary
  e.image_token = 300;
  EXPECT_EQ(image_token_id(e, *tok), 300);
  Shapes s = default_shapes();
  s.e.image_token = 300;
  const Sample x = ImageCaptionTask(s.d, s.e, *tok).get(0);
  EXPECT_EQ(std::count(x.tokens.begin(), x.tokens.end(), 300), s.e.patches());
  s.e.image_token = '=';  // would merge with the text: the placeholder run must stay unambiguous
  EXPECT_NE(error_of([&] { ImageCaptionTask(s.d, s.e, *tok); }).find("encoder.image_token"),
            std::string::npos);
}

TEST(ImageCaption, ImageShowsTheCaption) {
  auto tok = make_byte_tokenizer();
  struct Case {
    Shapes s;
    int64_t scale, samples;
  };
  for (Case c : {Case{default_shapes(), 2, 200}, Case{small_shapes(), 1, 100}}) {
    c.s.d.image_noise = 0;
    ImageCaptionTask t(c.s.d, c.s.e, *tok);
    for (int64_t i = 0; i < c.samples; ++i) {
      const Sample x = t.get(i);
      const std::string caption =
          tok->decode({x.tokens.end() - 1 - c.s.d.caption_digits, x.tokens.end() - 1});
      for (int64_t ch = 0; ch < c.s.e.channels; ++ch)
        ASSERT_EQ(read_caption(x.image, c.s, ch, c.scale), caption) << "sample " << i << " channel " << ch;
      for (float v : x.image) ASSERT_TRUE(v == 0.0f || (v >= 0.6f && v <= 1.0f)) << v;
    }
  }
}

TEST(ImageCaption, NoiseHasTheConfiguredStd) {
  Shapes s = default_shapes();
  s.e.channels = 2;
  s.d.image_noise = 0.2;
  Shapes clean = s;
  clean.d.image_noise = 0;
  double sum = 0, sum2 = 0, n = 0;
  for (int64_t i = 0; i < 20; ++i) {
    const auto noisy = draw_image_caption(s.d, s.e, false, i).image;
    const auto base = draw_image_caption(clean.d, clean.e, false, i).image;  // noise is on its own stream
    for (size_t k = 0; k < noisy.size(); ++k) {
      const double r = noisy[k] - base[k];
      sum += r, sum2 += r * r, n += 1;
    }
  }
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(sum2 / n), 0.2, 0.01);
}

TEST(ImageCaption, EvalSplitIsHeldOut) {
  auto tok = make_byte_tokenizer();
  // The 8x8 one-digit space has only 240 problems: without a held-out rule 300 draws of each split would
  // surely overlap.
  for (Shapes s : {small_shapes(), default_shapes()}) {
    s.d.image_noise = 0;
    ImageCaptionTask train(s.d, s.e, *tok), eval(s.d, s.e, *tok, true);
    const int64_t scale = s.e.image_size >= 16 ? 2 : 1;
    std::set<std::vector<Match>> seen[2];
    for (int split = 0; split < 2; ++split)
      for (int64_t i = 0; i < 300; ++i) {
        const Sample x = (split ? eval : train).get(i);
        std::vector<Match> where;
        ASSERT_NE(read_caption(x.image, s, 0, scale, &where), "");
        seen[split].insert(where);
      }
    EXPECT_GT(seen[1].size(), 10u);
    for (const auto& p : seen[1]) EXPECT_EQ(seen[0].count(p), 0u) << "an eval problem appears in training";
  }
  // Validation dataset = the eval split = the exact-match problems.
  const Shapes s = default_shapes();
  auto val = make_dataset(s.d, *tok, true, s.e);
  ASSERT_TRUE(val.is_ok()) << val.status().message();
  const auto probs = image_caption_eval_problems(s.d, s.e, *tok, 5);
  ASSERT_EQ(probs.size(), 5u);
  for (int64_t i = 0; i < 5; ++i) {
    const Sample x = val.value()->get(i);
    const auto& p = probs[static_cast<size_t>(i)];
    EXPECT_EQ(std::vector<int32_t>(x.tokens.begin(), x.tokens.begin() + 2 + s.e.patches()), p.prompt);
    EXPECT_EQ(tok->decode({x.tokens.begin() + 2 + s.e.patches(), x.tokens.end() - 1}), p.answer);
    EXPECT_TRUE(bit_equal(x.image, p.image));
  }
  auto train = make_dataset(s.d, *tok, false, s.e);
  ASSERT_TRUE(train.is_ok());
  EXPECT_FALSE(bit_equal(train.value()->get(0).image, val.value()->get(0).image));
}

TEST(ImageCaption, RejectsImagesTooSmallForTheDigits) {
  auto tok = make_byte_tokenizer();
  Shapes s = default_shapes();
  s.e.image_size = 6;  // slot width 3, height 6: fits 3x5 glyphs
  s.e.patch_size = 2;
  s.d.caption_digits = 2;
  EXPECT_EQ(draw_image_caption(s.d, s.e, false, 0).caption.size(), 2u);
  s.d.caption_digits = 3;  // slot width 2
  EXPECT_NE(error_of([&] { draw_image_caption(s.d, s.e, false, 0); }).find("encoder.image_size"),
            std::string::npos);
  s.d.caption_digits = 1;
  s.e.image_size = 4;  // height 4 < 5
  EXPECT_NE(error_of([&] { ImageCaptionTask(s.d, s.e, *tok); }).find("data.caption_digits"),
            std::string::npos);
  auto r = make_dataset(s.d, *tok, false, s.e);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("encoder.image_size"), std::string::npos);
  auto no_encoder = make_dataset(s.d, *tok, false);
  ASSERT_FALSE(no_encoder.is_ok());
  EXPECT_NE(no_encoder.status().message().find("encoder.image_size"), std::string::npos);
}

TEST(ImageCaption, RejectsSamplesLongerThanSeqLen) {
  auto tok = make_byte_tokenizer();
  Shapes s = default_shapes();
  s.d.seq_len = 16 + 2 + 2;  // BOS + 16 placeholders + '=' + 2 digits + EOS = 21 = seq_len + 1
  EXPECT_EQ(ImageCaptionTask(s.d, s.e, *tok).get(0).tokens.size(), 21u);
  s.d.seq_len -= 1;
  const std::string err = error_of([&] { ImageCaptionTask(s.d, s.e, *tok); });
  EXPECT_NE(err.find("data.seq_len"), std::string::npos) << err;
  EXPECT_NE(error_of([&] { image_caption_eval_problems(s.d, s.e, *tok, 1); }).find("data.seq_len"),
            std::string::npos);
  auto r = make_dataset(s.d, *tok, true, s.e);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("data.seq_len"), std::string::npos);
}
