// Tests of the post-training data side: reward tasks (addition, sort, JSONL), rewards, preference pairs,
// their JSONL errors, prompt/response samples, and the sort SFT dataset.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/make_dataset.h"
#include "data/sft.h"
#include "data/synthetic.h"
#include "posttrain/preferences.h"
#include "posttrain/tasks.h"
#include "temp_dir.h"
#include "train/config.h"

namespace fs = std::filesystem;
using ndt::testing::TempDir;
using namespace ndt;

namespace {

Config task_config(const std::string& task, const std::string& data_path = "",
                   const std::string& reward = "exact_match") {
  Config c;
  c.posttrain.task = task;
  c.posttrain.data_path = data_path;
  c.posttrain.reward = reward;
  c.data.addition_digits = 3;
  c.data.seed = 7;
  return c;
}

std::unique_ptr<RewardTask> task_of(const Config& c, const Tokenizer& tok) {
  auto t = make_reward_task(c, tok);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  return std::move(t).value();
}

std::string reward_error(const Config& c, const Tokenizer& tok) {
  auto t = make_reward_task(c, tok);
  return t.is_ok() ? "<ok>" : t.status().message();
}

std::string pairs_error(const Config& c, const Tokenizer& tok) {
  auto t = make_preference_data(c, tok);
  return t.is_ok() ? "<ok>" : t.status().message();
}

// Text of a generation prompt without its BOS.
std::string prompt_text(const Tokenizer& tok, const std::vector<int32_t>& prompt) {
  EXPECT_FALSE(prompt.empty());
  EXPECT_EQ(prompt.front(), tok.bos_id());
  return tok.decode(prompt);
}

// Text of an EOS-terminated response.
std::string response_text(const Tokenizer& tok, const std::vector<int32_t>& r) {
  EXPECT_FALSE(r.empty());
  EXPECT_EQ(r.back(), tok.eos_id());
  return tok.decode({r.begin(), r.end() - 1});
}

}  // namespace

TEST(RewardTask, AdditionMatchesSyntheticTask) {
  auto tok = make_byte_tokenizer();
  auto task = task_of(task_config("addition"), *tok);
  EXPECT_EQ(task->name(), "addition");
  EXPECT_EQ(task->size(), -1);
  EXPECT_EQ(task->max_answer_tokens(), 5);  // 4 sum digits + EOS
  AdditionTask sft(3, 7, *tok);
  for (int64_t i = 0; i < 50; ++i) {
    const RlPrompt p = task->prompt(i);
    const AdditionProblem ap = sft.problem(i);
    EXPECT_EQ(prompt_text(*tok, p.prompt), ap.prompt());
    EXPECT_EQ(p.answer, ap.reversed_answer());
    EXPECT_EQ(task->prompt(i).prompt, p.prompt);  // deterministic
    EXPECT_LE(static_cast<int64_t>(p.answer.size()) + 1, task->max_answer_tokens());
  }
  const auto eval = task->eval_prompts(20);
  const auto ref = addition_eval_problems(3, 7, 20, *tok);
  ASSERT_EQ(eval.size(), 20u);
  for (size_t i = 0; i < eval.size(); ++i) {
    EXPECT_EQ(eval[i].prompt, ref[i].prompt);
    EXPECT_EQ(eval[i].answer, ref[i].answer);
  }
}

TEST(RewardTask, TrainAndEvalPromptsAreDisjoint) {
  auto tok = make_byte_tokenizer();
  for (const char* name : {"addition", "sort"}) {
    auto task = task_of(task_config(name), *tok);
    std::set<std::vector<int32_t>> train;
    for (int64_t i = 0; i < 3000; ++i) train.insert(task->prompt(i).prompt);
    const auto eval = task->eval_prompts(300);
    ASSERT_EQ(eval.size(), 300u);
    std::set<std::vector<int32_t>> distinct_eval;
    for (const RlPrompt& e : eval) {
      EXPECT_EQ(train.count(e.prompt), 0u) << name << ": " << prompt_text(*tok, e.prompt);
      distinct_eval.insert(e.prompt);
    }
    EXPECT_GT(distinct_eval.size(), 100u) << name;
  }
}

TEST(RewardTask, SortPromptsAnswersAndRewards) {
  auto tok = make_byte_tokenizer();
  Config c = task_config("sort");
  c.data.addition_digits = 2;  // lists of 2..4 digits
  auto task = task_of(c, *tok);
  EXPECT_EQ(task->name(), "sort");
  EXPECT_EQ(task->max_answer_tokens(), 5);
  std::set<size_t> lengths;
  for (int64_t i = 0; i < 500; ++i) {
    const RlPrompt p = task->prompt(i);
    const SortProblem sp = draw_sort_problem(4, 7, false, i);
    EXPECT_EQ(prompt_text(*tok, p.prompt), sp.prompt());
    EXPECT_FALSE(sort_is_eval(sp));
    EXPECT_EQ(p.answer, sp.answer());
    EXPECT_TRUE(std::is_sorted(p.answer.begin(), p.answer.end()));
    EXPECT_EQ(p.answer.size(), sp.digits.size());
    lengths.insert(sp.digits.size());
    EXPECT_EQ(task->reward(p, p.answer), 1.0);
    EXPECT_EQ(task->reward(p, p.answer + "0"), 0.0);
    EXPECT_EQ(task->reward(p, ""), 0.0);
  }
  EXPECT_EQ(lengths, (std::set<size_t>{2, 3, 4}));
  // The held-out split mixes its hash: both parities of the odd-digit count are held out (FNV-1a's low
  // bit alone would fix it).
  std::set<int> parities;
  for (const RlPrompt& e : task->eval_prompts(100)) {
    int odd = 0;
    for (char ch : e.answer) odd += (ch - '0') % 2;
    parities.insert(odd % 2);
  }
  EXPECT_EQ(parities.size(), 2u);
  const SortProblem ex{{3, 1, 2}};
  EXPECT_EQ(ex.prompt(), "sort 3 1 2=");
  EXPECT_EQ(ex.answer(), "123");
}

TEST(RewardTask, AdditionRewardIsExactMatch) {
  auto tok = make_byte_tokenizer();
  auto task = task_of(task_config("addition"), *tok);
  const RlPrompt p = task->prompt(3);
  EXPECT_EQ(task->reward(p, p.answer), 1.0);
  EXPECT_EQ(task->reward(p, p.answer + "1"), 0.0);
  EXPECT_EQ(task->reward(p, " " + p.answer), 0.0);  // the model must produce exactly the answer
  std::string rev(p.answer.rbegin(), p.answer.rend());
  if (rev != p.answer) EXPECT_EQ(task->reward(p, rev), 0.0);
}

TEST(RewardRules, ExactContainsNumeric) {
  EXPECT_EQ(rule_reward("exact_match", "Paris", "  Paris\n"), 1.0);
  EXPECT_EQ(rule_reward("exact_match", " Paris ", "Paris"), 1.0);
  EXPECT_EQ(rule_reward("exact_match", "Paris", "paris"), 0.0);
  EXPECT_EQ(rule_reward("exact_match", "Paris", "Paris."), 0.0);
  EXPECT_EQ(rule_reward("contains", "Paris", "The capital is Paris."), 1.0);
  EXPECT_EQ(rule_reward("contains", " Paris ", "It is Paris"), 1.0);
  EXPECT_EQ(rule_reward("contains", "Paris", "London"), 0.0);
  EXPECT_EQ(rule_reward("numeric", "42", "42"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "42", " 42.0\n"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "42", "+42"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "1000", "1e3"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "1000000", "1000000.5"), 1.0);  // 5e-7 relative
  EXPECT_EQ(rule_reward("numeric", "1000", "1000.01"), 0.0);       // 1e-5 relative
  EXPECT_EQ(rule_reward("numeric", "0", "0.0"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "0", "1e-9"), 0.0);
  EXPECT_EQ(rule_reward("numeric", "-2.5", "-2.5"), 1.0);
  EXPECT_EQ(rule_reward("numeric", "42", "42 apples"), 0.0);
  EXPECT_EQ(rule_reward("numeric", "42", ""), 0.0);
  EXPECT_EQ(rule_reward("numeric", "42", "nan"), 0.0);
  EXPECT_EQ(rule_reward("numeric", "42", "0x2a"), 0.0);
  EXPECT_THROW(rule_reward("numeric", "forty-two", "42"), Error);
  EXPECT_THROW(rule_reward("fuzzy", "a", "a"), Error);
}

TEST(RewardRules, PartialMatchCreditsPositions) {
  EXPECT_EQ(rule_reward("partial_match", "8611", "8611"), 1.0);
  EXPECT_EQ(rule_reward("partial_match", "8611", " 8611\n"), 1.0);  // trimmed like exact_match
  EXPECT_EQ(rule_reward("partial_match", "8611", "8011"), 0.75);    // one digit wrong
  EXPECT_EQ(rule_reward("partial_match", "8611", "861"), 0.75);     // one digit missing
  EXPECT_EQ(rule_reward("partial_match", "861", "86111"), 0.6);     // two extra: over the longer length
  EXPECT_EQ(rule_reward("partial_match", "861", "168"), 1.0 / 3);   // the middle digit only
  EXPECT_EQ(rule_reward("partial_match", "861", ""), 0.0);
  EXPECT_EQ(rule_reward("partial_match", "", ""), 1.0);
  // Only the exact answer reaches 1, so solved_rate and held-out exact match keep their meaning.
  EXPECT_LT(rule_reward("partial_match", "12", "123"), 1.0);
}

TEST(RewardTask, BuiltinTasksTakeExactOrPartialMatch) {
  auto tokp = make_byte_tokenizer();
  const Tokenizer& tok = *tokp;
  for (const char* name : {"addition", "sort"}) {
    auto partial = task_of(task_config(name, "", "partial_match"), tok);
    auto exact = task_of(task_config(name, "", "exact_match"), tok);
    const RlPrompt p = partial->prompt(3);
    std::string one_off = p.answer;
    one_off[0] = one_off[0] == '5' ? '6' : '5';
    const double n = static_cast<double>(p.answer.size());
    EXPECT_EQ(partial->reward(p, p.answer), 1.0) << name;
    EXPECT_DOUBLE_EQ(partial->reward(p, one_off), (n - 1) / n) << name;
    EXPECT_EQ(exact->reward(p, one_off), 0.0) << name;
    EXPECT_EQ(exact->reward(p, " " + p.answer), 0.0) << name;  // built-in tasks compare untrimmed
    for (const char* jsonl_only : {"contains", "numeric"})
      EXPECT_NE(reward_error(task_config(name, "", jsonl_only), tok).find("applies to posttrain.task jsonl"),
                std::string::npos)
          << name << " " << jsonl_only;
  }
}

TEST(RewardTask, JsonlPromptsSplitAndRewards) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  std::string text;
  const int n = 60;
  for (int i = 0; i < n; ++i) {
    text += fmt::format("{{\"prompt\": \"What is {} + {}?\", \"answer\": {}}}\n", i, i, 2 * i);
    if (i == 5) text += "\n";  // blank lines are skipped
  }
  const std::string path = d.write("rl.jsonl", text);
  auto task = task_of(task_config("jsonl", path, "numeric"), *tok);
  EXPECT_EQ(task->name(), "jsonl");
  const auto eval = task->eval_prompts(1000);
  EXPECT_EQ(task->size() + static_cast<int64_t>(eval.size()), n);
  EXPECT_GT(task->size(), 0);
  EXPECT_GT(eval.size(), 0u);               // this file's hashes hold some prompts out
  EXPECT_EQ(task->max_answer_tokens(), 4);  // "118" + EOS
  // Held out by the hash of the prompt text; every other prompt trains, each once per epoch.
  std::set<std::vector<int32_t>> eval_set, seen;
  for (const RlPrompt& e : eval) {
    eval_set.insert(e.prompt);
    const std::string q = tok->decode(e.prompt);  // P "\n"
    EXPECT_TRUE(is_held_out_text(q.substr(0, q.size() - 1))) << q;
  }
  for (int64_t i = 0; i < task->size(); ++i) {
    const RlPrompt p = task->prompt(i);
    EXPECT_EQ(eval_set.count(p.prompt), 0u);
    seen.insert(p.prompt);
    EXPECT_EQ(task->prompt(i).prompt, p.prompt);
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), task->size());
  std::set<std::vector<int32_t>> epoch2;
  for (int64_t i = task->size(); i < 2 * task->size(); ++i) epoch2.insert(task->prompt(i).prompt);
  EXPECT_EQ(epoch2, seen);
  // Prompts carry the SFT template; numeric answers come back as their JSON text.
  const RlPrompt p0 = task->prompt(0);
  const std::string q = tok->decode(p0.prompt);
  ASSERT_EQ(q.back(), '\n');
  EXPECT_EQ(p0.prompt, sft_prompt_tokens(*tok, q.substr(0, q.size() - 1)));
  EXPECT_EQ(task->reward(p0, p0.answer + ".0"), 1.0);
  EXPECT_EQ(task->reward(p0, p0.answer + "1"), 0.0);
  EXPECT_EQ(task->eval_prompts(1).size(), std::min<size_t>(1, eval.size()));

  const std::string s = d.write("s.jsonl",
                                "{\"prompt\": \"Capital of France?\", \"answer\": \"Paris\"}\n"
                                "{\"prompt\": \"Capital of Italy?\", \"answer\": \"Rome\"}\n");
  auto contains = task_of(task_config("jsonl", s, "contains"), *tok);
  const RlPrompt c0{{}, "Paris"};
  EXPECT_EQ(contains->reward(c0, "It is Paris."), 1.0);
  EXPECT_EQ(contains->reward(c0, "Lyon"), 0.0);
  auto exact = task_of(task_config("jsonl", s, "exact_match"), *tok);
  EXPECT_EQ(exact->reward(c0, " Paris \n"), 1.0);
  EXPECT_EQ(exact->reward(c0, "It is Paris."), 0.0);
}

TEST(RewardTask, JsonlErrorsNameFileAndLine) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string ok = "{\"prompt\": \"a\", \"answer\": \"1\"}\n";
  auto err = [&](const std::string& name, const std::string& text,
                 const std::string& reward = "exact_match") {
    return reward_error(task_config("jsonl", d.write(name, text), reward), *tok);
  };
  std::string e = err("j.jsonl", ok + "\n{not json\n");
  EXPECT_NE(e.find("j.jsonl:3: invalid JSON"), std::string::npos) << e;
  e = err("m.jsonl", ok + "{\"prompt\": \"b\"}\n");
  EXPECT_NE(e.find("m.jsonl:2: \"answer\" is missing"), std::string::npos) << e;
  e = err("p.jsonl", "{\"prompt\": 3, \"answer\": \"1\"}\n");
  EXPECT_NE(e.find("p.jsonl:1: \"prompt\" must be a string"), std::string::npos) << e;
  e = err("a.jsonl", ok + ok + "{\"prompt\": \"c\", \"answer\": [1]}\n");
  EXPECT_NE(e.find("a.jsonl:3: \"answer\" must be a string or a number"), std::string::npos) << e;
  e = err("o.jsonl", "[1, 2]\n");
  EXPECT_NE(e.find("o.jsonl:1: expected a JSON object"), std::string::npos) << e;
  e = err("z.jsonl", "{\"prompt\": \"a\", \"answer\": \"  \"}\n");
  EXPECT_NE(e.find("z.jsonl:1: \"answer\" is empty"), std::string::npos) << e;
  e = err("n.jsonl", ok + "{\"prompt\": \"b\", \"answer\": \"four\"}\n", "numeric");
  EXPECT_NE(e.find("n.jsonl:2: \"answer\" 'four' is not a number"), std::string::npos) << e;
  e = err("e.jsonl", "\n  \n");
  EXPECT_NE(e.find("e.jsonl"), std::string::npos) << e;
  EXPECT_NE(e.find("empty file"), std::string::npos) << e;
  e = reward_error(task_config("jsonl", d.write("x", "") + ".missing"), *tok);
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
  EXPECT_NE(reward_error(task_config("jsonl", ""), *tok).find("posttrain.data_path"), std::string::npos);
}

TEST(Preferences, TaskPairsAreDeterministicAndWrong) {
  auto tok = make_byte_tokenizer();
  for (const char* name : {"addition", "sort"}) {
    const Config c = task_config(name);
    auto task = task_of(c, *tok);
    auto pairs = make_preference_data(c, *tok);
    ASSERT_TRUE(pairs.is_ok()) << pairs.status().message();
    auto& data = *pairs.value();
    EXPECT_EQ(data.size(), -1);
    std::set<size_t> shapes;  // (rejected length - chosen length): several kinds of mistakes occur
    for (int64_t i = 0; i < 500; ++i) {
      const PreferencePair p = data.get(i);
      const RlPrompt rp = task->prompt(i);
      EXPECT_EQ(p.prompt, rp.prompt) << name << " " << i;  // built on the training prompts
      const std::string chosen = response_text(*tok, p.chosen), rejected = response_text(*tok, p.rejected);
      EXPECT_EQ(chosen, rp.answer);
      EXPECT_NE(rejected, chosen);
      EXPECT_EQ(task->reward(rp, chosen), 1.0);
      EXPECT_EQ(task->reward(rp, rejected), 0.0) << name << " " << i << ": " << rejected;
      EXPECT_FALSE(rejected.empty());
      EXPECT_EQ(rejected.find_first_not_of("0123456789"), std::string::npos) << rejected;
      EXPECT_LE(rejected.size(), chosen.size());
      shapes.insert(chosen.size() - rejected.size());
      const PreferencePair again = data.get(i);
      EXPECT_EQ(again.rejected, p.rejected);
      EXPECT_EQ(again.chosen, p.chosen);
    }
    EXPECT_EQ(shapes.size(), 2u) << name;  // same-length and one-shorter mistakes
    // Another seed gives other pairs.
    Config c2 = c;
    c2.data.seed = 8;
    auto other = make_preference_data(c2, *tok);
    int differ = 0;
    for (int64_t i = 0; i < 20; ++i) differ += other.value()->get(i).prompt != data.get(i).prompt;
    EXPECT_GT(differ, 10) << name;
  }
}

TEST(Preferences, WrongAnswersCoverTheirKinds) {
  // 57 + 68 = 125, reversed "521": carries dropped give "51", the final carry dropped "52".
  const AdditionProblem carry{57, 68};
  std::set<std::string> seen;
  for (uint64_t k = 0; k < 200; ++k) {
    const std::string w = wrong_addition_answer(carry, k);
    EXPECT_NE(w, "521");
    EXPECT_NE(w.back(), '0');  // no leading zero in the most significant digit
    seen.insert(w);
  }
  EXPECT_TRUE(seen.count("51"));
  EXPECT_TRUE(seen.count("52"));
  EXPECT_TRUE(seen.count("511") || seen.count("531") || seen.count("421") || seen.count("621"));
  // Carry-free sums fall back to a digit slip: same length, one digit off by one.
  const AdditionProblem plain{12, 13};  // "52"
  for (uint64_t k = 0; k < 100; ++k) {
    const std::string w = wrong_addition_answer(plain, k);
    ASSERT_EQ(w.size(), 2u);
    EXPECT_EQ((w[0] != '5') + (w[1] != '2'), 1) << w;
  }
  EXPECT_EQ(wrong_addition_answer({0, 0}, 3).size(), 1u);

  const SortProblem sp{{3, 1, 2}};  // "123"
  seen.clear();
  for (uint64_t k = 0; k < 200; ++k) seen.insert(wrong_sort_answer(sp, k));
  EXPECT_FALSE(seen.count("123"));
  for (const char* w : {"213", "132", "312", "23", "13", "12"}) EXPECT_TRUE(seen.count(w)) << w;
  const SortProblem same{{4, 4, 4}};  // no swap or echo is wrong: a digit is left out
  for (uint64_t k = 0; k < 20; ++k) EXPECT_EQ(wrong_sort_answer(same, k), "44");
}

TEST(Preferences, JsonlPairs) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string path =
      d.write("p.jsonl",
              "{\"prompt\": \"2+2?\", \"chosen\": \"4\", \"rejected\": \"5\"}\n\n"
              "{\"prompt\": \"Hi\", \"chosen\": \"Hello!\", \"rejected\": \"Go away.\"}\n");
  auto pairs = make_preference_data(task_config("jsonl", path), *tok);
  ASSERT_TRUE(pairs.is_ok()) << pairs.status().message();
  ASSERT_EQ(pairs.value()->size(), 2);
  const PreferencePair p = pairs.value()->get(1);
  EXPECT_EQ(p.prompt, sft_prompt_tokens(*tok, "Hi"));
  std::vector<int32_t> chosen = tok->encode("Hello!");
  chosen.push_back(tok->eos_id());
  EXPECT_EQ(p.chosen, chosen);
  EXPECT_EQ(response_text(*tok, p.rejected), "Go away.");
  EXPECT_THROW(pairs.value()->get(2), Error);
}

TEST(Preferences, JsonlErrorsNameFileAndLine) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string ok = "{\"prompt\": \"a\", \"chosen\": \"x\", \"rejected\": \"y\"}\n";
  auto err = [&](const std::string& name, const std::string& text) {
    return pairs_error(task_config("jsonl", d.write(name, text)), *tok);
  };
  std::string e = err("j.jsonl", ok + "{\"prompt\": \n");
  EXPECT_NE(e.find("j.jsonl:2: invalid JSON"), std::string::npos) << e;
  e = err("m.jsonl", ok + ok + "{\"prompt\": \"a\", \"chosen\": \"x\"}\n");
  EXPECT_NE(e.find("m.jsonl:3: \"rejected\" is missing"), std::string::npos) << e;
  e = err("t.jsonl", "{\"prompt\": \"a\", \"chosen\": 1, \"rejected\": \"y\"}\n");
  EXPECT_NE(e.find("t.jsonl:1: \"chosen\" must be a string"), std::string::npos) << e;
  e = err("s.jsonl", ok + "\n{\"prompt\": \"a\", \"chosen\": \"same\", \"rejected\": \"same\"}\n");
  EXPECT_NE(e.find("s.jsonl:3: \"chosen\" and \"rejected\" are the same"), std::string::npos) << e;
  e = err("e.jsonl", "");
  EXPECT_NE(e.find("e.jsonl"), std::string::npos) << e;
  EXPECT_NE(e.find("empty file"), std::string::npos) << e;
  EXPECT_NE(pairs_error(task_config("jsonl", ""), *tok).find("posttrain.data_path"), std::string::npos);
}

TEST(Preferences, PromptResponseSampleMasksTheResponse) {
  const Sample s = prompt_response_sample({256, 10, 11, 12}, {20, 21, 257});
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{256, 10, 11, 12, 20, 21, 257}));
  EXPECT_EQ(s.loss_mask, (std::vector<uint8_t>{0, 0, 0, 0, 1, 1, 1}));
  const Sample only_prompt = prompt_response_sample({256, 1}, {});
  EXPECT_EQ(only_prompt.loss_mask, (std::vector<uint8_t>{0, 0}));
}

TEST(SortTask, SamplesDecodeToTheExpectedText) {
  auto tok = make_byte_tokenizer();
  SortTask task(5, 11, *tok);
  for (int64_t i = 0; i < 100; ++i) {
    const SortProblem p = task.problem(i);
    const Sample s = task.get(i);
    ASSERT_EQ(s.tokens.size(), s.loss_mask.size());
    EXPECT_EQ(s.tokens.front(), tok->bos_id());
    EXPECT_EQ(s.tokens.back(), tok->eos_id());
    EXPECT_EQ(tok->decode(s.tokens), p.prompt() + p.answer());
    const size_t first_loss = 1 + p.prompt().size();  // byte tokenizer: one token per byte
    for (size_t t = 0; t < s.tokens.size(); ++t) EXPECT_EQ(s.loss_mask[t], t >= first_loss ? 1 : 0) << t;
    std::vector<int32_t> answer(s.tokens.begin() + static_cast<std::ptrdiff_t>(first_loss),
                                s.tokens.end() - 1);
    EXPECT_EQ(tok->decode(answer), p.answer());
    EXPECT_EQ(task.get(i).tokens, s.tokens);
  }
  const Sample ex = SortTask(5, 11, *tok).get(0);
  const std::string text = tok->decode(ex.tokens);
  EXPECT_EQ(text.rfind("sort ", 0), 0u) << text;
  // The eval split: sample i is sort_eval_problems(..)[i]; both stay on their side of the split.
  SortTask eval(5, 11, *tok, true);
  const auto problems = sort_eval_problems(5, 11, 10, *tok);
  for (int64_t i = 0; i < 10; ++i) {
    const Sample s = eval.get(i);
    EXPECT_TRUE(sort_is_eval(eval.problem(i)));
    EXPECT_FALSE(sort_is_eval(task.problem(i)));
    EXPECT_EQ(std::vector<int32_t>(s.tokens.begin(),
                                   s.tokens.begin() + static_cast<std::ptrdiff_t>(problems[i].prompt.size())),
              problems[i].prompt);
    EXPECT_EQ(problems[i].answer, eval.problem(i).answer());
  }
}

TEST(SortTask, ConfigAndMakeDataset) {
  auto cfg = parse_config_string("data:\n  task: sort\n  addition_digits: 1\n", {});
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  auto tok = make_byte_tokenizer();
  auto train = make_dataset(cfg.value().data, *tok, false);
  auto val = make_dataset(cfg.value().data, *tok, true);
  ASSERT_TRUE(train.is_ok()) << train.status().message();
  ASSERT_TRUE(val.is_ok()) << val.status().message();
  EXPECT_EQ(train.value()->size(), -1);
  const std::string t = tok->decode(train.value()->get(0).tokens);
  EXPECT_EQ(t.rfind("sort ", 0), 0u) << t;
  for (int64_t i = 0; i < 200; ++i) {
    const Sample s = train.value()->get(i);
    EXPECT_LE(s.tokens.size(), 3u * 3 + 7);  // lists of up to sort_max_len(1) = 3 digits
  }
  EXPECT_NE(tok->decode(val.value()->get(0).tokens), t);
  EXPECT_FALSE(parse_config_string("data:\n  task: sorting\n", {}).is_ok());
}
