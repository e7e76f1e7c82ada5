#include "data/synthetic.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "core/rng.h"

namespace ndt {

namespace {

// Stream key of sample `index` of a named stream: distinct per (tag, index), so samples are independent
// draws that any rank can regenerate without walking a shared RNG.
uint64_t sample_stream(uint64_t tag, int64_t index) {
  return tag + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull;  // odd multiplier: injective in index
}

int64_t pow10(int64_t n) {
  int64_t p = 1;
  for (int64_t i = 0; i < n; ++i) p *= 10;
  return p;
}

int64_t draw_operand(CounterRng& rng, int64_t digits) {
  const int64_t nd = rng.uniform_int(1, digits);
  const int64_t lo = nd == 1 ? 0 : pow10(nd - 1);
  return rng.uniform_int(lo, pow10(nd) - 1);
}

// [BOS] prompt answer [EOS], loss on answer and EOS.
Sample qa_sample(const std::string& prompt, const std::string& answer, const Tokenizer& tok) {
  Sample s;
  s.tokens.push_back(tok.bos_id());
  for (int32_t t : tok.encode(prompt)) s.tokens.push_back(t);
  s.loss_mask.assign(s.tokens.size(), 0);
  for (int32_t t : tok.encode(answer)) s.tokens.push_back(t);
  s.tokens.push_back(tok.eos_id());
  s.loss_mask.resize(s.tokens.size(), 1);
  return s;
}

EvalProblem eval_problem(const std::string& prompt, std::string answer, const Tokenizer& tok) {
  EvalProblem e;
  e.prompt.push_back(tok.bos_id());
  for (int32_t t : tok.encode(prompt)) e.prompt.push_back(t);
  e.answer = std::move(answer);
  return e;
}

void check_sort_len(int64_t max_len) {
  NDT_CHECK(max_len >= 2 && max_len <= 64, "sort task: max list length must be in 2..64 (got {})", max_len);
}

}  // namespace

std::string AdditionProblem::prompt() const { return fmt::format("{}+{}=", a, b); }

std::string AdditionProblem::reversed_answer() const {
  std::string s = std::to_string(a + b);
  std::reverse(s.begin(), s.end());
  return s;
}

std::string AdditionProblem::carry_dropped_answer() const {
  std::string x = std::to_string(a), y = std::to_string(b), out;
  std::reverse(x.begin(), x.end());
  std::reverse(y.begin(), y.end());
  for (size_t i = 0; i < std::max(x.size(), y.size()); ++i) {
    const int dx = i < x.size() ? x[i] - '0' : 0, dy = i < y.size() ? y[i] - '0' : 0;
    out += static_cast<char>('0' + (dx + dy) % 10);
  }
  return out;
}

bool addition_is_eval(int64_t a, int64_t b) { return stable_hash(fmt::format("{}+{}", a, b)) % 10 == 0; }

AdditionProblem draw_addition_problem(int64_t digits, uint64_t seed, bool eval_split, int64_t index) {
  NDT_CHECK(digits >= 1 && digits <= 18, "addition digits must be in 1..18 (got {})", digits);
  NDT_CHECK(index >= 0, "negative sample index {}", index);
  static const uint64_t kTrain = stable_hash("addition/train"), kEval = stable_hash("addition/eval");
  CounterRng rng(seed, sample_stream(eval_split ? kEval : kTrain, index));
  // Rejection sampling: 90% of problems are training ones, so the train split needs ~1.1 draws and the
  // eval split ~10. The cap only trips when the split is (nearly) empty, e.g. a 1-digit space of 100.
  for (int attempt = 0; attempt < 100000; ++attempt) {
    AdditionProblem p;
    p.a = draw_operand(rng, digits);
    p.b = draw_operand(rng, digits);
    if (addition_is_eval(p.a, p.b) == eval_split) return p;
  }
  NDT_FAIL("addition task: no {} problem found with {} digit(s)", eval_split ? "eval" : "train", digits);
}

AdditionTask::AdditionTask(int64_t digits, int64_t seed, const Tokenizer& tok, bool eval_split,
                           double label_noise)
    : digits_(digits), seed_(seed), tok_(tok), eval_(eval_split), label_noise_(eval_split ? 0 : label_noise) {
  NDT_CHECK(digits >= 1 && digits <= 18, "addition digits must be in 1..18 (got {})", digits);
  NDT_CHECK(label_noise >= 0 && label_noise <= 1, "addition label noise must be in [0, 1] (got {})",
            label_noise);
}

AdditionProblem AdditionTask::problem(int64_t index) const {
  return draw_addition_problem(digits_, static_cast<uint64_t>(seed_), eval_, index);
}

Sample AdditionTask::get(int64_t index) const {
  const AdditionProblem p = problem(index);
  bool noisy = false;
  if (label_noise_ > 0) {  // its own stream: the problems stay those of the noise-free task
    static const uint64_t kNoise = stable_hash("addition/label_noise");
    noisy = CounterRng(static_cast<uint64_t>(seed_), sample_stream(kNoise, index)).uniform() < label_noise_;
  }
  return qa_sample(p.prompt(), noisy ? p.carry_dropped_answer() : p.reversed_answer(), tok_);
}

std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n,
                                                const Tokenizer& tok) {
  std::vector<EvalProblem> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) {
    AdditionProblem p = draw_addition_problem(digits, static_cast<uint64_t>(seed), true, i);
    out.push_back(eval_problem(p.prompt(), p.reversed_answer(), tok));
  }
  return out;
}

std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n) {
  auto tok = make_byte_tokenizer();
  return addition_eval_problems(digits, seed, n, *tok);
}

// ---- SortTask ------------------------------------------------------------------------------------

std::string SortProblem::prompt() const {
  std::string s = "sort";
  for (int d : digits) {
    s += ' ';
    s += static_cast<char>('0' + d);
  }
  return s + "=";
}

std::string SortProblem::answer() const {
  std::string s;
  for (int d : digits) s += static_cast<char>('0' + d);
  std::sort(s.begin(), s.end());
  return s;
}

bool is_held_out_text(std::string_view text) {
  uint64_t h = stable_hash(text);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return (h ^ (h >> 31)) % 10 == 0;
}

bool sort_is_eval(const SortProblem& p) { return is_held_out_text(p.prompt()); }

SortProblem draw_sort_problem(int64_t max_len, uint64_t seed, bool eval_split, int64_t index) {
  check_sort_len(max_len);
  NDT_CHECK(index >= 0, "negative sample index {}", index);
  static const uint64_t kTrain = stable_hash("sort/train"), kEval = stable_hash("sort/eval");
  CounterRng rng(seed, sample_stream(eval_split ? kEval : kTrain, index));
  // Even the shortest lists (100 of length 2) hold eval and train problems, so both splits are
  // non-empty; ~10 draws per eval problem, ~1.1 per training one.
  for (int attempt = 0; attempt < 100000; ++attempt) {
    SortProblem p;
    const int64_t n = rng.uniform_int(2, max_len);
    for (int64_t i = 0; i < n; ++i) p.digits.push_back(static_cast<int>(rng.uniform_int(0, 9)));
    if (sort_is_eval(p) == eval_split) return p;
  }
  NDT_FAIL("sort task: no {} problem found with lists of up to {} digits", eval_split ? "eval" : "train",
           max_len);
}

SortTask::SortTask(int64_t max_len, int64_t seed, const Tokenizer& tok, bool eval_split)
    : max_len_(max_len), seed_(seed), tok_(tok), eval_(eval_split) {
  check_sort_len(max_len);
}

SortProblem SortTask::problem(int64_t index) const {
  return draw_sort_problem(max_len_, static_cast<uint64_t>(seed_), eval_, index);
}

Sample SortTask::get(int64_t index) const {
  const SortProblem p = problem(index);
  return qa_sample(p.prompt(), p.answer(), tok_);
}

std::vector<EvalProblem> sort_eval_problems(int64_t max_len, int64_t seed, int64_t n, const Tokenizer& tok) {
  std::vector<EvalProblem> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) {
    SortProblem p = draw_sort_problem(max_len, static_cast<uint64_t>(seed), true, i);
    out.push_back(eval_problem(p.prompt(), p.answer(), tok));
  }
  return out;
}

// ---- LmTask: a toy grammar ------------------------------------------------------------------------

namespace {

constexpr std::array<const char*, 8> kNouns = {"cat", "dog", "bird", "horse", "girl", "boy", "frog", "duck"};
constexpr std::array<const char*, 6> kAdjs = {"small", "big", "red", "old", "happy", "quiet"};
// (singular, plural) verb forms: the grammar's main learnable dependency is number agreement.
constexpr std::array<std::array<const char*, 2>, 6> kVerbs = {{{"sees", "see"},
                                                               {"likes", "like"},
                                                               {"chases", "chase"},
                                                               {"finds", "find"},
                                                               {"follows", "follow"},
                                                               {"helps", "help"}}};
constexpr std::array<const char*, 20> kNumbers = {"one",     "two",       "three",    "four",     "five",
                                                  "six",     "seven",     "eight",    "nine",     "ten",
                                                  "eleven",  "twelve",    "thirteen", "fourteen", "fifteen",
                                                  "sixteen", "seventeen", "eighteen", "nineteen", "twenty"};

template <typename A>
const auto& pick(CounterRng& rng, const A& a) {
  return a[static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(a.size()) - 1))];
}

// A noun phrase; returns whether it is plural.
bool noun_phrase(CounterRng& rng, std::string& out) {
  const bool plural = rng.uniform_int(0, 1) == 1;
  static constexpr std::array<const char*, 3> kDetSg = {"the", "a", "every"};
  static constexpr std::array<const char*, 3> kDetPl = {"the", "some", "two"};
  out += plural ? pick(rng, kDetPl) : pick(rng, kDetSg);
  out += ' ';
  if (rng.uniform_int(0, 2) == 0) {
    out += pick(rng, kAdjs);
    out += ' ';
  }
  out += pick(rng, kNouns);
  if (plural) out += 's';
  return plural;
}

std::string sentence(CounterRng& rng) {
  std::string s;
  switch (rng.uniform_int(0, 3)) {
    case 0: {  // NP V NP .
      const bool pl = noun_phrase(rng, s);
      s += ' ';
      s += pick(rng, kVerbs)[pl ? 1 : 0];
      s += ' ';
      noun_phrase(rng, s);
      break;
    }
    case 1: {  // NP and NP V NP .  (always plural agreement)
      noun_phrase(rng, s);
      s += " and ";
      noun_phrase(rng, s);
      s += ' ';
      s += pick(rng, kVerbs)[1];
      s += ' ';
      noun_phrase(rng, s);
      break;
    }
    case 2: {  // NP is/are ADJ .
      const bool pl = noun_phrase(rng, s);
      s += pl ? " are " : " is ";
      s += pick(rng, kAdjs);
      break;
    }
    default: {  // counting: "three four five six ."
      const int64_t len = rng.uniform_int(3, 6);
      const int64_t start = rng.uniform_int(0, static_cast<int64_t>(kNumbers.size()) - len);
      for (int64_t i = 0; i < len; ++i) {
        if (i) s += ' ';
        s += kNumbers[static_cast<size_t>(start + i)];
      }
      break;
    }
  }
  s += " .";
  return s;
}

}  // namespace

LmTask::LmTask(int64_t seq_len, int64_t seed, const Tokenizer& tok, const std::string& stream,
               int64_t min_len)
    : seq_len_(seq_len), seed_(seed), min_len_(min_len), tok_(tok), stream_(stable_hash("lm/" + stream)) {
  NDT_CHECK(seq_len >= 1, "lm task: seq_len must be >= 1 (got {})", seq_len);
  NDT_CHECK(min_len >= 0 && min_len <= seq_len, "lm task: min_len {} must be in [0, seq_len = {}]", min_len,
            seq_len);
}

int64_t LmTask::length_of(int64_t index) const {
  if (min_len_ <= 0) return seq_len_;
  const double u = philox_uniform(static_cast<uint64_t>(seed_), stream_ ^ 0x9E3779B97F4A7C15ull,
                                  static_cast<uint64_t>(index));
  const double lo = std::log(static_cast<double>(min_len_)), hi = std::log(static_cast<double>(seq_len_) + 1);
  return std::clamp<int64_t>(static_cast<int64_t>(std::exp(lo + u * (hi - lo))), min_len_, seq_len_);
}

std::string LmTask::text(int64_t index) const {
  NDT_CHECK(index >= 0, "negative sample index {}", index);
  CounterRng rng(static_cast<uint64_t>(seed_), sample_stream(stream_, index));
  std::string text;
  // Bytes bound tokens from above for the byte tokenizer; for subword tokenizers keep adding sentences
  // until the encoded text fills the window.
  int64_t want_bytes = seq_len_ + 1;
  for (;;) {
    while (static_cast<int64_t>(text.size()) < want_bytes) {
      if (!text.empty()) text += ' ';
      text += sentence(rng);
    }
    if (static_cast<int64_t>(tok_.encode(text).size()) >= seq_len_) return text;
    want_bytes *= 2;
  }
}

Sample LmTask::get(int64_t index) const {
  Sample s;
  s.tokens.push_back(tok_.bos_id());
  std::vector<int32_t> ids = tok_.encode(text(index));
  ids.resize(std::min(ids.size(), static_cast<size_t>(length_of(index))));
  s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
  s.loss_mask.assign(s.tokens.size(), 1);
  s.loss_mask[0] = 0;
  return s;
}

}  // namespace ndt
