// Chat templates (data/chat_template.h): exact tokens and loss masks of each template on a two-turn
// conversation with a system message, prompt + response = training sample, packing keeps the masks, the
// config key, and the post-training JSONL formats that take "messages".
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/make_dataset.h"
#include "data/packing.h"
#include "data/sft.h"
#include "posttrain/preferences.h"
#include "posttrain/tasks.h"
#include "temp_dir.h"
#include "train/config.h"

using ndt::testing::TempDir;
using ndt::testing::write_text;
using namespace ndt;

namespace {

// Builds the expected (tokens, mask) of the byte tokenizer from pieces: text (one token per byte) or a
// special id, each with its mask.
struct Expect {
  const Tokenizer& tok;
  Sample s;
  Expect& text(const std::string& t, uint8_t m) {
    for (unsigned char c : t) {
      s.tokens.push_back(static_cast<int32_t>(c));
      s.loss_mask.push_back(m);
    }
    return *this;
  }
  Expect& bos() {
    s.tokens.push_back(tok.bos_id());
    s.loss_mask.push_back(0);
    return *this;
  }
  Expect& eos() {  // always loss-bearing: it closes an assistant turn
    s.tokens.push_back(tok.eos_id());
    s.loss_mask.push_back(1);
    return *this;
  }
};

const std::vector<ChatMessage> kChat = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}, {"assistant", "Ciao"}};
const char* kChatLine =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
    "\"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}, {\"role\": \"user\", \"content\": \"Bye\"}, "
    "{\"role\": \"assistant\", \"content\": \"Ciao\"}, {\"role\": \"user\", \"content\": \"dropped\"}]}\n";

Sample expected(const std::string& name, const Tokenizer& tok) {
  Expect e{tok, {}};
  if (name == "simple") {
    e.bos()
        .text("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n", 0)
        .text("Hello", 1)
        .text("\n<|user|>\nBye\n<|assistant|>\n", 0)
        .text("Ciao", 1)
        .eos();
  } else if (name == "chatml") {
    e.bos()
        .text(
            "<|im_start|>system\nBe "
            "brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            0)
        .text("Hello<|im_end|>", 1)
        .eos()
        .text("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0)
        .text("Ciao<|im_end|>", 1)
        .eos();
  } else {
    e.bos()
        .text(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            0)
        .text("Hello<|eot_id|>", 1)
        .eos()
        .text(
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_"
            "header_id|>\n\n",
            0)
        .text("Ciao<|eot_id|>", 1)
        .eos();
  }
  return e.s;
}

ChatTemplate tmpl_of(const std::string& name) {
  auto t = ChatTemplate::named(name);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  return t.value();
}

const std::vector<std::string> kTemplates = {"simple", "chatml", "llama3"};

}  // namespace

TEST(DataChatTemplate, ExactTokensAndMasksOfEachTemplate) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string path = d.file("chat.jsonl");
  write_text(path, kChatLine);
  for (const std::string& name : kTemplates) {
    const ChatTemplate t = tmpl_of(name);
    EXPECT_EQ(t.name(), name);
    const Sample want = expected(name, *tok);
    Sample got;
    ASSERT_EQ(t.conversation(*tok, kChat, got), "");
    EXPECT_EQ(got.tokens, want.tokens) << name;
    EXPECT_EQ(got.loss_mask, want.loss_mask) << name;
    // The SFT dataset reads the same from JSONL (the message after the last assistant one is dropped).
    auto ds = SftDataset::load(path, *tok, 512, t);
    ASSERT_TRUE(ds.is_ok()) << ds.status().message();
    const Sample s = ds.value()->get(0);
    EXPECT_EQ(s.tokens, want.tokens) << name;
    EXPECT_EQ(s.loss_mask, want.loss_mask) << name;
  }
  // The default template is today's format.
  auto ds = SftDataset::load(path, *tok, 512);
  ASSERT_TRUE(ds.is_ok());
  EXPECT_EQ(ds.value()->get(0).tokens, expected("simple", *tok).tokens);
}

TEST(DataChatTemplate, GenerationPromptPlusResponseIsTheTrainingSample) {
  auto tok = make_byte_tokenizer();
  for (const std::string& name : kTemplates) {
    const ChatTemplate t = tmpl_of(name);
    // The conversation up to the last user message, then the assistant's response.
    const std::vector<ChatMessage> so_far(kChat.begin(), kChat.end() - 1);
    std::vector<int32_t> joined = t.chat_prompt(*tok, so_far);
    const std::vector<int32_t> resp = t.response(*tok, "Ciao");
    joined.insert(joined.end(), resp.begin(), resp.end());
    const Sample want = expected(name, *tok);
    EXPECT_EQ(joined, want.tokens) << name;
    // The same with the posttrain sample builder: its mask is the training mask of the last turn.
    const Sample pr = prompt_response_sample(t.chat_prompt(*tok, so_far), resp);
    for (size_t i = t.chat_prompt(*tok, so_far).size(); i < pr.tokens.size(); ++i)
      EXPECT_EQ(pr.loss_mask[i], want.loss_mask[i]) << name << " " << i;
    EXPECT_EQ(resp.back(), tok->eos_id());
    // prompt/response lines: the text prompt is the sample's prefix, the response its loss-bearing tail.
    const Sample s = t.prompt_response(*tok, "2+2?", "4");
    std::vector<int32_t> pr2 = t.text_prompt(*tok, "2+2?");
    const std::vector<int32_t> r4 = t.response(*tok, "4");
    pr2.insert(pr2.end(), r4.begin(), r4.end());
    EXPECT_EQ(s.tokens, pr2) << name;
    EXPECT_EQ(prompt_response_sample(t.text_prompt(*tok, "2+2?"), r4).loss_mask, s.loss_mask) << name;
  }
  // Exact generation prompts: they end with the assistant header.
  const std::vector<ChatMessage> q = {{"user", "Hi"}};
  EXPECT_EQ(tok->decode(tmpl_of("chatml").chat_prompt(*tok, q)),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(tok->decode(tmpl_of("llama3").chat_prompt(*tok, q)),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(tok->decode(tmpl_of("simple").chat_prompt(*tok, q)), "<|user|>\nHi\n<|assistant|>\n");
  EXPECT_EQ(tmpl_of("simple").text_prompt(*tok, "Hi"), sft_prompt_tokens(*tok, "Hi"));
  EXPECT_EQ(tmpl_of("simple").chat_prompt(*tok, q), sft_chat_prompt_tokens(*tok, {{"user", "Hi"}}));
  // A prompt/response line under chatml is the user/assistant conversation.
  Sample conv;
  ASSERT_EQ(tmpl_of("chatml").conversation(*tok, {{"user", "2+2?"}, {"assistant", "4"}}, conv), "");
  EXPECT_EQ(tmpl_of("chatml").prompt_response(*tok, "2+2?", "4").tokens, conv.tokens);
  EXPECT_EQ(tmpl_of("chatml").prompt_response(*tok, "2+2?", "4").loss_mask, conv.loss_mask);
}

TEST(DataChatTemplate, CompletionTextDropsTheEndMarker) {
  EXPECT_EQ(tmpl_of("chatml").completion_text("4<|im_end|>"), "4");
  EXPECT_EQ(tmpl_of("chatml").completion_text("4"), "4");  // EOS without the marker: kept as is
  EXPECT_EQ(tmpl_of("llama3").completion_text("Paris<|eot_id|>"), "Paris");
  EXPECT_EQ(tmpl_of("llama3").completion_text("<|im_end|>"), "<|im_end|>");
  EXPECT_EQ(tmpl_of("simple").completion_text("4<|im_end|>"), "4<|im_end|>");
  EXPECT_EQ(tmpl_of("chatml").end_marker(), "<|im_end|>");
  EXPECT_EQ(tmpl_of("llama3").end_marker(), "<|eot_id|>");
  EXPECT_EQ(tmpl_of("simple").end_marker(), "");
}

TEST(DataChatTemplate, UnknownTemplateAndRoleErrors) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  auto bad = ChatTemplate::named("vicuna");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("data.chat_template is 'vicuna'"), std::string::npos);
  // The config key rejects it at parse time, naming the key.
  auto cfg = parse_config_string("data:\n  chat_template: vicuna\n", {});
  ASSERT_FALSE(cfg.is_ok());
  EXPECT_NE(cfg.status().message().find("data.chat_template"), std::string::npos) << cfg.status().message();
  auto ok = parse_config_string("data:\n  chat_template: llama3\n", {});
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok.value().data.chat_template, "llama3");
  EXPECT_EQ(Config().data.chat_template, "simple");
  // make_dataset checks the name too (configs built in code skip the parser).
  const std::string path = d.file("c.jsonl");
  write_text(path, kChatLine);
  DataConfig dc;
  dc.task = "sft";
  dc.path = path;
  dc.chat_template = "vicuna";
  auto ds = make_dataset(dc, *tok, false);
  ASSERT_FALSE(ds.is_ok());
  EXPECT_NE(ds.status().message().find("data.chat_template"), std::string::npos);
  dc.chat_template = "chatml";
  ASSERT_TRUE(make_dataset(dc, *tok, false).is_ok());
  // An unknown role names file:line and the field, under every template.
  const std::string role = d.file("role.jsonl");
  write_text(role, std::string(kChatLine) +
                       "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}, {\"role\": \"assistant\", "
                       "\"content\": \"y\"}]}\n");
  for (const std::string& name : kTemplates) {
    auto r = SftDataset::load(role, *tok, 64, tmpl_of(name));
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(role + ":2: messages[0].role is \"tool\""), std::string::npos)
        << r.status().message();
  }
}

TEST(DataChatTemplate, PackedSamplesKeepTheirMasks) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string path = d.file("chat.jsonl");
  write_text(path, std::string(kChatLine) +
                       "{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}\n"
                       "{\"messages\": [{\"role\": \"user\", \"content\": \"Name a color.\"}, {\"role\": "
                       "\"assistant\", \"content\": \"Blue\"}]}\n");
  const int64_t seq_len = 200;
  for (const std::string& name : kTemplates) {
    auto ds = SftDataset::load(path, *tok, seq_len, tmpl_of(name));
    ASSERT_TRUE(ds.is_ok()) << ds.status().message();
    std::vector<Sample> samples;
    for (int64_t i = 0; i < ds.value()->size(); ++i) samples.push_back(ds.value()->get(i));
    const int32_t pad = tok->pad_id();
    const Microbatch padded = make_microbatch(samples, seq_len, pad);
    for (int64_t cp : {1, 2}) {
      const Microbatch packed = pack_samples(samples, pad, pack_layout(cp, 1, false));
      ASSERT_EQ(packed.nseq, static_cast<int64_t>(samples.size()));
      EXPECT_EQ(packed.num_loss_tokens, padded.num_loss_tokens) << name;
      const int32_t* cu = packed.cu_seqlens.i32();
      for (size_t k = 0; k < samples.size(); ++k) {
        const auto n = static_cast<int64_t>(samples[k].tokens.size()) - 1;  // inputs of sample k
        ASSERT_GE(cu[k + 1] - cu[k], n);
        for (int64_t i = 0; i < cu[k + 1] - cu[k]; ++i) {
          const int64_t p = cu[k] + i, q = static_cast<int64_t>(k) * seq_len + i;
          if (i < n) {
            EXPECT_EQ(packed.tokens.i32()[p], padded.tokens.i32()[q])
                << name << " sample " << k << " row " << i;
            EXPECT_EQ(packed.targets.i32()[p], padded.targets.i32()[q])
                << name << " sample " << k << " row " << i;
            EXPECT_EQ(packed.loss_mask.f32()[p], padded.loss_mask.f32()[q])
                << name << " sample " << k << " row " << i;
            EXPECT_EQ(packed.loss_mask.f32()[p], samples[k].loss_mask[static_cast<size_t>(i + 1)]);
          } else {
            EXPECT_EQ(packed.loss_mask.f32()[p], 0.0f);  // CP padding of the sequence
          }
        }
      }
    }
  }
}

// ---- post-training prompts from "messages" ---------------------------------------------------------

namespace {

Config posttrain_config(const std::string& path, const std::string& tmpl) {
  Config c;
  c.posttrain.task = "jsonl";
  c.posttrain.data_path = path;
  c.posttrain.reward = "exact_match";
  c.data.chat_template = tmpl;
  return c;
}

}  // namespace

TEST(PosttrainChatPrompts, RewardTaskTakesMessages) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  // Enough distinct prompts that some train; the same conversation as a held-out or training prompt.
  std::string text;
  for (int i = 0; i < 20; ++i)
    text +=
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
        "\"content\": \"" +
        std::to_string(i) + "+1?\"}], \"answer\": \"" + std::to_string(i + 1) + "\"}\n";
  const std::string path = d.file("rl.jsonl");
  write_text(path, text);
  for (const std::string& name : kTemplates) {
    const ChatTemplate t = tmpl_of(name);
    auto task = make_reward_task(posttrain_config(path, name), *tok);
    ASSERT_TRUE(task.is_ok()) << task.status().message();
    std::vector<RlPrompt> all = task.value()->eval_prompts(100);
    for (int64_t i = 0; i < task.value()->size(); ++i) all.push_back(task.value()->prompt(i));
    ASSERT_EQ(all.size(), 20u);
    for (const RlPrompt& p : all) {
      const int k = std::stoi(p.answer) - 1;
      EXPECT_EQ(p.prompt,
                t.chat_prompt(*tok, {{"system", "Be brief."}, {"user", std::to_string(k) + "+1?"}}));
    }
    // The completion before EOS ends with the end marker; the reward compares the text before it.
    const RlPrompt& p = all.front();
    EXPECT_EQ(task.value()->reward(p, p.answer + t.end_marker()), 1.0) << name;
    EXPECT_EQ(task.value()->reward(p, p.answer + "0" + t.end_marker()), 0.0) << name;
    // The budget fits the longest answer, its marker and EOS.
    EXPECT_EQ(task.value()->max_answer_tokens(), static_cast<int64_t>(t.response(*tok, "20").size())) << name;
  }
  // A plain "prompt" under chatml is one user message.
  const std::string plain = d.file("plain.jsonl");
  write_text(plain,
             "{\"prompt\": \"Capital of France?\", \"answer\": \"Paris\"}\n"
             "{\"prompt\": \"Capital of Italy?\", \"answer\": \"Rome\"}\n");
  auto task = make_reward_task(posttrain_config(plain, "chatml"), *tok);
  ASSERT_TRUE(task.is_ok()) << task.status().message();
  const RlPrompt p0 = task.value()->prompt(0);
  EXPECT_EQ(p0.prompt,
            tmpl_of("chatml").chat_prompt(
                *tok, {{"user", p0.answer == "Paris" ? "Capital of France?" : "Capital of Italy?"}}));
}

TEST(PosttrainChatPrompts, PreferencePairsTakeMessages) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string path = d.file("p.jsonl");
  write_text(
      path,
      "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
      "\"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}, {\"role\": \"user\", \"content\": "
      "\"Bye\"}], \"chosen\": \"Ciao\", \"rejected\": \"No.\"}\n");
  for (const std::string& name : kTemplates) {
    const ChatTemplate t = tmpl_of(name);
    auto pairs = make_preference_data(posttrain_config(path, name), *tok);
    ASSERT_TRUE(pairs.is_ok()) << pairs.status().message();
    const PreferencePair p = pairs.value()->get(0);
    EXPECT_EQ(p.chosen, t.response(*tok, "Ciao"));
    EXPECT_EQ(p.rejected, t.response(*tok, "No."));
    // The chosen sample is exactly the SFT sample of the whole conversation, mask included.
    const Sample s = prompt_response_sample(p.prompt, p.chosen);
    const Sample want = expected(name, *tok);
    EXPECT_EQ(s.tokens, want.tokens) << name;
    // Earlier assistant turns are context in DPO (mask 0); the response's mask equals SFT's.
    for (size_t i = p.prompt.size(); i < s.tokens.size(); ++i) EXPECT_EQ(s.loss_mask[i], want.loss_mask[i]);
  }
}

TEST(PosttrainChatPrompts, MessageErrorsNameFileAndLine) {
  TempDir d;
  auto tok = make_byte_tokenizer();
  const std::string ok_rl = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"answer\": \"1\"}\n";
  const std::string ok_pair =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"chosen\": \"x\", \"rejected\": \"y\"}\n";
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {"{\"messages\": [{\"role\": \"bot\", \"content\": \"a\"}]", ":2: messages[0].role is \"bot\""},
      {"{\"messages\": []", ":2: \"messages\" is empty"},
      {"{\"messages\": \"a\"", ":2: \"messages\" must be an array"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": "
       "\"b\"}]",
       ":2: messages[1] is an assistant message"},
      {"{\"prompt\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"a\"}]",
       ":2: give either \"prompt\" or \"messages\""},
      {"{\"text\": \"a\"", ":2: \"prompt\" is missing (or give \"messages\")"},
  };
  int n = 0;
  for (const Case& c : cases) {
    const std::string rl = d.file("rl" + std::to_string(n) + ".jsonl");
    write_text(rl, ok_rl + c.line + ", \"answer\": \"1\"}\n");
    auto t = make_reward_task(posttrain_config(rl, "chatml"), *tok);
    ASSERT_FALSE(t.is_ok()) << c.line;
    EXPECT_NE(t.status().message().find(rl + c.expect), std::string::npos) << t.status().message();
    const std::string pp = d.file("pp" + std::to_string(n++) + ".jsonl");
    write_text(pp, ok_pair + c.line + ", \"chosen\": \"x\", \"rejected\": \"y\"}\n");
    auto p = make_preference_data(posttrain_config(pp, "llama3"), *tok);
    ASSERT_FALSE(p.is_ok()) << c.line;
    EXPECT_NE(p.status().message().find(pp + c.expect), std::string::npos) << p.status().message();
  }
  auto bad = make_reward_task(posttrain_config(d.file("rl0.jsonl"), "vicuna"), *tok);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("data.chat_template"), std::string::npos);
}
