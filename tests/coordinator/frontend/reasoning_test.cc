// Reasoning split (reasoning.h): the two formats on whole texts, and the same split however the
// text is cut into pieces, tags included.
#include "coordinator/frontend/reasoning.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

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
}

TEST(ReasoningTest, PiecesGiveTheSameSplitAsTheWholeText) {
  const std::vector<std::string> texts = {"<think>Ünïcödé ✓ reasoning</think>\n\nThe answer: <b>42</b> </think>",
                                          "no tags at all, ✓", "<think></think>", "a<</think>>b", "</th</think>x"};
  for (const ReasoningFormat f : {ReasoningFormat::kDeepSeekR1, ReasoningFormat::kQwen3}) {
    for (const std::string& text : texts) {
      const ReasoningSplit whole = SplitReasoning(f, text);
      for (size_t step = 1; step <= 4; ++step) {
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
  EXPECT_FALSE(ParseReasoningFormat("r1").ok());
}

}  // namespace
}  // namespace shardserve::coordinator::frontend
