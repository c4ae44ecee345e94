// Our code and the generated message code agree on how messages are laid out, in every build: a
// message is filled by our (possibly instrumented) accessors, serialized and parsed by the
// generated code and libprotobuf, and read back by our accessors. Each field of SamplingParams
// sits after a map field (logit_bias), the layout that differed between TSan-instrumented code and
// the uninstrumented library until the TSan build undefined __SANITIZE_THREAD__
// (cmake/ShardserveHelpers.cmake): fields past the map then came back as other bytes.
#include <gtest/gtest.h>

#include <string>

#include "shardserve/v1/common.pb.h"
#include "shardserve/v1/stage.pb.h"

namespace shardserve::rpc {
namespace {

v1::SamplingParams Filled() {
  v1::SamplingParams p;
  p.set_temperature(0.75f);
  p.set_top_k(40);
  p.set_top_p(0.9f);
  p.set_seed(0x1234'5678'9abc'def0ULL);
  p.set_min_p(0.05f);
  (*p.mutable_logit_bias())[17] = -3.5f;
  (*p.mutable_logit_bias())[4242] = 12.0f;
  p.set_presence_penalty(0.25f);
  p.set_frequency_penalty(-0.5f);
  p.set_repetition_penalty(1.3f);
  return p;
}

void ExpectFilled(const v1::SamplingParams& p) {
  EXPECT_EQ(p.temperature(), 0.75f);
  EXPECT_EQ(p.top_k(), 40);
  EXPECT_EQ(p.top_p(), 0.9f);
  EXPECT_EQ(p.seed(), 0x1234'5678'9abc'def0ULL);
  EXPECT_EQ(p.min_p(), 0.05f);
  ASSERT_EQ(p.logit_bias_size(), 2);
  EXPECT_EQ(p.logit_bias().at(17), -3.5f);
  EXPECT_EQ(p.logit_bias().at(4242), 12.0f);
  EXPECT_EQ(p.presence_penalty(), 0.25f);
  EXPECT_EQ(p.frequency_penalty(), -0.5f);
  EXPECT_EQ(p.repetition_penalty(), 1.3f);
}

TEST(ProtoLayoutTest, SamplingParamsRoundTripsThroughTheGeneratedCode) {
  const std::string wire = Filled().SerializeAsString();
  v1::SamplingParams parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  ExpectFilled(parsed);
  // Copied by the generated code (CopyFrom), not parsed.
  v1::SamplingParams copied;
  copied.CopyFrom(Filled());
  ExpectFilled(copied);
}

TEST(ProtoLayoutTest, SamplingParamsInsideAStepSequenceRoundTrips) {
  v1::StepRequest request;
  v1::StepSequence* s = request.add_sequences();
  *s->mutable_sampling() = Filled();
  s->set_request_id("request-0");
  s->set_sample_index(5);
  v1::StepRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  ASSERT_EQ(parsed.sequences_size(), 1);
  ExpectFilled(parsed.sequences(0).sampling());
  EXPECT_EQ(parsed.sequences(0).request_id(), "request-0");
  EXPECT_EQ(parsed.sequences(0).sample_index(), 5);
}

}  // namespace
}  // namespace shardserve::rpc
