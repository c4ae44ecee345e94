// Reasoning split (reasoning.h): the three formats on whole texts, and the same split however the
// text is cut into pieces, tags included.
#include "coordinator/frontend/reasoning.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/frontend/harmony.h"

namespace shardserve::coordinator::frontend {
namespace {

std::pair<std::string, std::string> Split(ReasoningFormat f, const std::string& text) {
  ReasoningSplit s = SplitReasoning(f, text);
  return {s.reasoning, s.content};
}

TEST(ReasoningTest, DeepSeekR1StartsInTheReasoning) {
  const ReasoningFormat f = ReasoningFormat::kDeepSeekR1;
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(Split(f, "Let me see.</think>\n\n42"), P("Let me see.", "\n\n42"));
  EXPECT_EQ(Split(f, "<think>Hmm</think>Yes"), P("Hmm", "Yes"));
  EXPECT_EQ(Split(f, "still thinking"), P("still thinking", ""));
  EXPECT_EQ(Split(f, "a</think>b</think>c"), P("a", "b</think>c"));
  EXPECT_EQ(Split(f, "</think>"), P("", ""));
  EXPECT_EQ(Split(f, ""), P("", ""));
  EXPECT_EQ(Split(f, "<thi"), P("<thi", ""));
  EXPECT_EQ(Split(f, "x</thi"), P("x</thi", ""));
}

TEST(ReasoningTest, Qwen3ReasonsOnlyAfterAnOpeningTag) {
  const ReasoningFormat f = ReasoningFormat::kQwen3;
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(Split(f, "<think>\nLet me see.\n</think>\n\n42"), P("\nLet me see.\n", "\n\n42"));
  EXPECT_EQ(Split(f, "42"), P("", "42"));
  EXPECT_EQ(Split(f, "Just 42 </think> no"), P("", "Just 42 </think> no"));
  EXPECT_EQ(Split(f, "<think>cut off"), P("cut off", ""));
  EXPECT_EQ(Split(f, "<thi"), P("", "<thi"));
  // Whitespace before the tag goes with it (GLM-4.5 answers "\n<think>..."); before other text it
  // is content.
  EXPECT_EQ(Split(f, "\n<think>Paris.</think>\nIt rains."), P("Paris.", "\nIt rains."));
  EXPECT_EQ(Split(f, " \n 42"), P("", " \n 42"));
  EXPECT_EQ(Split(f, "\n\n"), P("", "\n\n"));
}

// `text` streamed in pieces of each of `steps` bytes splits as the whole text does.
void ExpectPiecesAgree(ReasoningFormat f, const std::string& text, std::initializer_list<size_t> steps) {
  const ReasoningSplit whole = SplitReasoning(f, text);
  for (size_t step : steps) {
    SCOPED_TRACE(text + " in pieces of " + std::to_string(step));
    ReasoningStreamer streamer(f);
    ReasoningSplit got;
    for (size_t at = 0; at < text.size(); at += step) {
      ReasoningSplit part = streamer.Add(text.substr(at, step));
      got.reasoning += part.reasoning;
      got.content += part.content;
    }
    ReasoningSplit rest = streamer.Finish();
    EXPECT_EQ(got.reasoning + rest.reasoning, whole.reasoning);
    EXPECT_EQ(got.content + rest.content, whole.content);
  }
}

TEST(ReasoningTest, PiecesGiveTheSameSplitAsTheWholeText) {
  const std::vector<std::string> texts = {"<think>Ünïcödé ✓ reasoning</think>\n\nThe answer: <b>42</b> </think>",
                                          "no tags at all, ✓", "<think></think>", "a<</think>>b", "</th</think>x",
                                          "\n <think>a</think>b", " \n<thin"};
  for (const ReasoningFormat f : {ReasoningFormat::kDeepSeekR1, ReasoningFormat::kQwen3}) {
    for (const std::string& text : texts) ExpectPiecesAgree(f, text, {1, 2, 3, 4});
  }
}

TEST(ReasoningTest, OnlyATagsBeginningIsHeldBack) {
  ReasoningStreamer streamer(ReasoningFormat::kDeepSeekR1);
  EXPECT_EQ(streamer.Add("<thi").reasoning, "");  // may be <think>
  EXPECT_EQ(streamer.Add("nk>abc</").reasoning, "abc");
  ReasoningSplit s = streamer.Add("b>d");  // not </think> after all
  EXPECT_EQ(s.reasoning, "</b>d");
  s = streamer.Add("</think>e");
  EXPECT_EQ(s.content, "e");
  EXPECT_EQ(streamer.Add("</think>").content, "</think>");
}

TEST(ReasoningTest, FormatsAreNamedAsVllmNamesThem) {
  EXPECT_EQ(*ParseReasoningFormat("deepseek_r1"), ReasoningFormat::kDeepSeekR1);
  EXPECT_EQ(*ParseReasoningFormat("qwen3"), ReasoningFormat::kQwen3);
  EXPECT_EQ(*ParseReasoningFormat("glm45"), ReasoningFormat::kQwen3);  // GLM-4.5 thinks as Qwen3 does
  EXPECT_EQ(*ParseReasoningFormat("gpt_oss"), ReasoningFormat::kHarmony);
  EXPECT_EQ(*ParseReasoningFormat("openai_gptoss"), ReasoningFormat::kHarmony);
  EXPECT_FALSE(ParseReasoningFormat("r1").ok());
  EXPECT_NE(ParseReasoningFormat("r1").status().message().find("gpt_oss"), std::string::npos);
}

// GPT-OSS's harmony answers, as they arrive decoded with their special tokens spelled (the prompt
// ended with "<|start|>assistant").
constexpr char kHarmonyAnswer[] =
    "<|channel|>analysis<|message|>The user greets. Ünï ✓<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! <b>there</b><|return|>";
constexpr char kHarmonyCall[] =
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    "{\"city\":\"Paris\"}<|call|>";

TEST(ReasoningTest, HarmonyAnalysisIsReasoningAndFinalIsContent) {
  const ReasoningFormat f = ReasoningFormat::kHarmony;
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(Split(f, kHarmonyAnswer), P("The user greets. Ünï ✓", "Hello! <b>there</b>"));
  // Without the end tokens (they stop the answer and may not be decoded), the same.
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b"),
            P("a", "b"));
  // A final answer without reasoning, and a preamble on commentary before it, each on its line.
  EXPECT_EQ(Split(f, "<|channel|>final<|message|>Only this."), P("", "Only this."));
  EXPECT_EQ(Split(f, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done."),
            P("", "Checking.\nDone."));
  // Two analysis messages: two lines of reasoning.
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"),
            P("one\ntwo", ""));
}

TEST(ReasoningTest, HarmonyCallsGoToTheContentForTheToolParser) {
  const ReasoningFormat f = ReasoningFormat::kHarmony;
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(Split(f, kHarmonyCall),
            P("Need the weather.", harmony::CallText("get_weather", "{\"city\":\"Paris\"}")));
  EXPECT_EQ(harmony::CallText("get_weather", "{}"),
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}<|call|>");
  // The recipient before the channel (as the chat template writes calls), and no <|call|> text.
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time"
                     "<|channel|>commentary json<|message|>{}"),
            P("x", harmony::CallText("get_time", "{}")));
  // A call first thing in the answer (the header continues the prompt's "<|start|>assistant").
  EXPECT_EQ(Split(f, " to=functions.f<|channel|>commentary json<|message|>{\"a\":1}<|call|>"),
            P("", harmony::CallText("f", "{\"a\":1}")));
  // A built-in tool's call (browser, python) is the model's own business: reasoning.
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis to=browser.search "
                     "code<|message|>{\"query\":\"x\"}<|call|>"),
            P("a\n{\"query\":\"x\"}", ""));
}

TEST(ReasoningTest, HarmonyOddAnswers) {
  const ReasoningFormat f = ReasoningFormat::kHarmony;
  using P = std::pair<std::string, std::string>;
  // Not harmony at all (a constraint shaped it, or the model ignored the format): content as it is.
  EXPECT_EQ(Split(f, "Plain <|end|> text"), P("", "Plain <|end|> text"));
  EXPECT_EQ(Split(f, "{\"json\": true}"), P("", "{\"json\": true}"));
  // A header that never ends within kMaxHarmonyHeaderBytes is not one.
  const std::string long_header = "<|channel|>" + std::string(300, 'x') + "<|message|>hi";
  EXPECT_EQ(Split(f, long_header), P("", long_header));
  // Cut off inside a header, or right after one: nothing to tell.
  EXPECT_EQ(Split(f, "<|channel|>analy"), P("", ""));
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>"), P("", ""));
  EXPECT_EQ(Split(f, ""), P("", ""));
  // Between messages: special tokens and blanks are dropped, other text is kept as content (a line
  // of its own).
  EXPECT_EQ(Split(f, "<|channel|>final<|message|>a<|end|> <|endoftext|>junk<|start|>assistant<|channel|>final<|message|>b"),
            P("", "a\njunk\nb"));
  // A message that starts without ending the last one.
  EXPECT_EQ(Split(f, "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b"), P("a", "b"));
  // Text that looks like a tag but is not one stays.
  EXPECT_EQ(Split(f, "<|channel|>final<|message|>a <|en b"), P("", "a <|en b"));
}

TEST(ReasoningTest, HarmonyPiecesGiveTheSameSplitAsTheWholeText) {
  const std::vector<std::string> texts = {kHarmonyAnswer, kHarmonyCall, "Plain text ✓",
                                          "<|channel|>final<|message|>a<|end|> <|endoftext|>junk<|start|>assistant"
                                          "<|channel|>final<|message|>b <|en",
                                          " to=functions.f<|channel|>commentary json<|message|>{}<|call|>"};
  for (const std::string& text : texts) ExpectPiecesAgree(ReasoningFormat::kHarmony, text, {1, 4, 7, 10, 13});
}

TEST(ReasoningTest, HarmonyReasoningStreamsAsItComes) {
  ReasoningStreamer streamer(ReasoningFormat::kHarmony);
  EXPECT_EQ(streamer.Add("<|channel|>analysis<|mess").reasoning, "");  // a header is held whole
  EXPECT_EQ(streamer.Add("age|>Thinking").reasoning, "Thinking");
  EXPECT_EQ(streamer.Add(" more<|e").reasoning, " more");  // may be <|end|>
  ReasoningSplit s = streamer.Add("nd|><|start|>assistant<|channel|>final<|message|>Hi");
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "Hi");
  // A call is held until it ends.
  s = streamer.Add("<|end|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{\"a\"");
  EXPECT_EQ(s.content, "");
  s = streamer.Finish();
  EXPECT_EQ(s.content, harmony::CallText("f", "{\"a\""));
}

// A message the prompt opened (structured output's final channel, a named call): the text starts
// in its body.
TEST(ReasoningTest, HarmonyTextInAMessageThePromptOpened) {
  const ReasoningFormat f = ReasoningFormat::kHarmony;
  ReasoningSplit s = SplitReasoning(f, "{\"a\":1}", "<|channel|>final");
  EXPECT_EQ(s.content, "{\"a\":1}");
  EXPECT_EQ(s.reasoning, "");
  s = SplitReasoning(f, "{\"a\":1}<|call|>", "<|channel|>commentary to=functions.f <|constrain|>json");
  EXPECT_EQ(s.content, harmony::CallText("f", "{\"a\":1}"));
  ReasoningStreamer streamer(f, "<|channel|>commentary to=functions.f <|constrain|>json");
  EXPECT_EQ(streamer.Add("{\"a\"").content, "");
  EXPECT_EQ(streamer.Add(":2}").content, "");
  EXPECT_EQ(streamer.Finish().content, harmony::CallText("f", "{\"a\":2}"));
  // Other formats ignore it.
  EXPECT_EQ(SplitReasoning(ReasoningFormat::kQwen3, "x", "<|channel|>final").content, "x");
}

TEST(ReasoningTest, HarmonyTemplatesAreRecognised) {
  EXPECT_TRUE(harmony::UsesHarmony("{{ '<|start|>assistant<|channel|>final<|message|>' + m.content }}"));
  EXPECT_FALSE(harmony::UsesHarmony("<|im_start|>{{ m.role }}<|message|>"));
  EXPECT_FALSE(harmony::UsesHarmony(""));
  const harmony::Header h = harmony::ParseHeader("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json");
  EXPECT_EQ(h.channel, "commentary");
  EXPECT_EQ(h.recipient, "functions.get_weather");
  const harmony::Header before = harmony::ParseHeader("assistant to=functions.x<|channel|>commentary json");
  EXPECT_EQ(before.channel, "commentary");
  EXPECT_EQ(before.recipient, "functions.x");
  EXPECT_EQ(harmony::ParseHeader("<|channel|>final").recipient, "");
}

}  // namespace
}  // namespace shardserve::coordinator::frontend
