#pragma once
// Embedded synthetic tasks (no files needed): multi-digit addition and a toy-grammar language model.
// Both are unbounded generators (size() = -1): sample `index` is a pure function of (seed, index), so
// every rank that asks for the same global index builds the same sample (DESIGN.md §1).
// The tasks keep a reference to their tokenizer: it must outlive them.
#include <cstdint>
#include <string>
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
  AdditionTask(int64_t digits, int64_t seed, const Tokenizer& tok, bool eval_split = false);
  int64_t size() const override { return -1; }
  Sample get(int64_t index) const override;
  AdditionProblem problem(int64_t index) const;

 private:
  int64_t digits_, seed_;
  const Tokenizer& tok_;
  bool eval_;
};

// The first n eval-split problems for (digits, seed) as prompts [BOS] + "a+b=" and reversed answers
// (may repeat when digits is small). The 3-argument form uses the byte tokenizer.
std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n,
                                                const Tokenizer& tok);
std::vector<EvalProblem> addition_eval_problems(int64_t digits, int64_t seed, int64_t n);

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
