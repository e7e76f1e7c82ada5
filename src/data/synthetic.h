#pragma once
// Embedded synthetic tasks (no files needed): multi-digit addition, digit sorting and a toy-grammar
// language model. All are unbounded generators (size() = -1): sample `index` is a pure function of (seed,
// index), so every rank that asks for the same global index builds the same sample (DESIGN.md §1). The tasks
// keep a reference to their tokenizer: it must outlive them.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/dataset.h"
#include "data/tokenizer.h"

namespace ndt {

// One addition problem a + b. The answer is written least significant digit first ("reversed"):
// a causal model then produces each digit after having seen the digits that determine it and the
// carry, which makes the task learnable by a small model (left-to-right sums are not).
struct AdditionProblem {
  int64_t a = 0, b = 0;
  std::string prompt() const;           // "a+b="
  std::string reversed_answer() const;  // digits of a + b, least significant first
  // The answer with every carry dropped (digit-wise sums mod 10 over the longer operand's digits, least
  // significant first): the classic wrong answer; equal to reversed_answer() when a + b has no carry.
  std::string carry_dropped_answer() const;
};

// Held-out split: (a, b) is an eval problem iff stable_hash("a+b") % 10 == 0. Independent of the seed,
// so the held-out set never changes between runs.
bool addition_is_eval(int64_t a, int64_t b);

// Draws one problem of the chosen split for (seed, stream, index): the digit count of each operand is
// uniform in 1..digits, then the operand is uniform among numbers with that many digits (0..9 for one
// digit). Problems of the other split are rejected and redrawn from the same counter stream.
AdditionProblem draw_addition_problem(int64_t digits, uint64_t seed, bool eval_split, int64_t index);

// Tokens: [BOS] + "a+b=" + reversed answer + [EOS]; loss_mask = 1 exactly on the answer and EOS.
class AdditionTask final : public Dataset {
 public:
  // eval_split = false: training problems only (eval problems never appear); true: eval problems only,
  // sample i being the problem of addition_eval_problems(..)[i] (validation loss on held-out problems).
  // label_noise (data.addition_label_noise, training split only): the probability, drawn per sample from
  // (seed, index), that a sample's answer is its carry_dropped_answer() instead of the right one.
  AdditionTask(int64_t digits, int64_t seed, const Tokenizer& tok, bool eval_split = false,
               double label_noise = 0);
  int64_t size() const override { return -1; }
  Sample get(int64_t index) const override;
  AdditionProblem problem(int64_t index) const;

 private:
  int64_t digits_, seed_;
  const Tokenizer& tok_;
  bool eval_;
  double label_noise_;
};

// The first n eval-split problems for (digits, seed) as prompts [BOS] + "a+b=" and reversed answers
// (may repeat when digits is small). The 3-argument form uses the byte tokenizer.
std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n,
                                                const Tokenizer& tok);
std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n);

// One sort problem: a list of single digits (repeats allowed) to be written in ascending order.
struct SortProblem {
  std::vector<int> digits;
  std::string prompt() const;  // "sort 3 1 2="
  std::string answer() const;  // "123": the digits ascending, no separators (one byte token each)
};

// Longest list of the sort task: it reuses data.addition_digits (d) as its difficulty knob, lists of
// 2..d+2 digits (2..5 by default).
inline int64_t sort_max_len(int64_t addition_digits) { return addition_digits + 2; }

// 1 in 10 texts, by a hash of the text alone (seed-independent): the held-out splits of the sort task and
// of post-training JSONL prompts. stable_hash is finalized (splitmix64) first: FNV-1a's low bit is the
// parity of the text's byte low bits, so `% 10` on it alone would hold out e.g. only lists with an even
// count of odd digits (as addition_is_eval does; kept for its fixed held-out set).
bool is_held_out_text(std::string_view text);

// Held-out split: a list is an eval problem iff is_held_out_text(prompt()).
bool sort_is_eval(const SortProblem& p);

// Draws one problem of the chosen split for (seed, index): length uniform in 2..max_len, then each digit
// uniform in 0..9; problems of the other split are rejected and redrawn from the same counter stream.
SortProblem draw_sort_problem(int64_t max_len, uint64_t seed, bool eval_split, int64_t index);

// Tokens: [BOS] + "sort 3 1 2=" + "123" + [EOS]; loss_mask = 1 exactly on the answer and EOS.
class SortTask final : public Dataset {
 public:
  // eval_split: as AdditionTask (sample i is the problem of sort_eval_problems(..)[i]).
  SortTask(int64_t max_len, int64_t seed, const Tokenizer& tok, bool eval_split = false);
  int64_t size() const override { return -1; }
  Sample get(int64_t index) const override;
  SortProblem problem(int64_t index) const;

 private:
  int64_t max_len_, seed_;
  const Tokenizer& tok_;
  bool eval_;
};

// The first n eval-split sort problems as prompts [BOS] + "sort ...=" and answers (may repeat).
std::vector<EvalProblem> sort_eval_problems(int64_t max_len, int64_t seed, int64_t n, const Tokenizer& tok);

// Plain language modelling on sentences of a small embedded grammar with learnable structure
// (subject-verb number agreement, "and" lists, counting phrases), e.g. "the small cat sees a dog ."
// A document is [BOS] + sentences joined by spaces, cut to exactly seq_len + 1 tokens; loss on every
// token after BOS. `stream` separates independent streams of the same seed (training vs validation).
class LmTask final : public Dataset {
 public:
  // min_len > 0: each sample's token count is drawn log-uniformly from [min_len, seq_len] (keyed by
  // seed and index), a skewed length distribution for packing; 0: every sample fills seq_len.
  LmTask(int64_t seq_len, int64_t seed, const Tokenizer& tok, const std::string& stream = "train",
         int64_t min_len = 0);
  int64_t size() const override { return -1; }
  Sample get(int64_t index) const override;
  // The text of document `index` before tokenization (at least long enough to fill the window).
  std::string text(int64_t index) const;

 private:
  int64_t length_of(int64_t index) const;

  int64_t seq_len_, seed_, min_len_;
  const Tokenizer& tok_;
  uint64_t stream_;
};

}  // namespace ndt
