// SequenceText (decoder + stop strings, token by token) and SequenceCanceller (a cancel before or
// after the id is known).
#include "coordinator/frontend/sequence_output.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace shardserve::coordinator::frontend {
namespace {

// Token i decodes to kPieces[i]; ids outside the table have no text. Token 9 holds its text back
// until Finish (like the first bytes of a multi-byte character).
class TableDecoder final : public StreamDecoder {
 public:
  absl::StatusOr<std::string> Next(int32_t id) override {
    if (id == 9) {
      held_ += "!";
      return std::string();
    }
    auto it = kPieces.find(id);
    if (it == kPieces.end()) return absl::InvalidArgumentError("outside the vocabulary");
    return it->second;
  }
  std::string Finish() override { return std::exchange(held_, ""); }
  std::unique_ptr<StreamDecoder> Clone() const override { return std::make_unique<TableDecoder>(*this); }

 private:
  inline static const std::map<int32_t, std::string> kPieces = {{1, "Once"}, {2, " upon"}, {3, " a"}, {4, " time"}};
  std::string held_;
};

TEST(SequenceTextTest, TextPassesThroughUntilAStopStringAndNothingAfter) {
  SequenceText text(std::make_unique<TableDecoder>(), {" a t"});
  std::string out;
  EXPECT_FALSE(text.Add(1, &out));
  EXPECT_FALSE(text.Add(2, &out));
  EXPECT_FALSE(text.Add(77, &out)) << "a token without text adds nothing";
  EXPECT_FALSE(text.Add(3, &out));
  EXPECT_EQ(out, "Once upon") << "\" a\" is held back: it may start the stop string";
  EXPECT_TRUE(text.Add(4, &out));
  EXPECT_EQ(out, "Once upon");
  EXPECT_TRUE(text.stopped());
  EXPECT_TRUE(text.Add(1, &out));
  EXPECT_TRUE(text.Finish(&out));
  EXPECT_EQ(out, "Once upon");
}

TEST(SequenceTextTest, FinishReleasesWhatWasHeldBack) {
  SequenceText text(std::make_unique<TableDecoder>(), {" a t"});
  std::string out;
  EXPECT_FALSE(text.Add(1, &out));
  EXPECT_FALSE(text.Add(3, &out));
  EXPECT_FALSE(text.Add(9, &out));
  EXPECT_EQ(out, "Once");
  EXPECT_FALSE(text.Finish(&out));
  EXPECT_EQ(out, "Once a!");
  // A stop string completed by the decoder's held-back text stops at Finish.
  SequenceText stopping(std::make_unique<TableDecoder>(), {"e!"});
  std::string s;
  EXPECT_FALSE(stopping.Add(1, &s));
  EXPECT_FALSE(stopping.Add(9, &s));
  EXPECT_TRUE(stopping.Finish(&s));
  EXPECT_EQ(s, "Onc");
}

TEST(SequenceTextTest, WithoutADecoderThereIsNoText) {
  SequenceText text(nullptr, {"x"});
  std::string out;
  EXPECT_FALSE(text.has_text());
  EXPECT_FALSE(text.Add(1, &out));
  EXPECT_FALSE(text.Finish(&out));
  EXPECT_EQ(out, "");
}

}  // namespace
}  // namespace shardserve::coordinator::frontend
