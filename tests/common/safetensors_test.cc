#include "common/safetensors/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace shardserve {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::shardserve::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Builds a safetensors file from a header JSON and raw data bytes.
std::string File(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A 3x4 F32 matrix with values 0..11 and a 2-element BF16 vector.
std::string GoodFile() {
  std::vector<float> m(12);
  for (int i = 0; i < 12; ++i) m[static_cast<size_t>(i)] = static_cast<float>(i);
  const uint16_t bf[2] = {0x3f80, 0xc000};  // 1, -2
  std::string data = Floats(m) + std::string(reinterpret_cast<const char*>(bf), 4);
  return File(R"({"__metadata__":{"format":"pt"},"m":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},)"
              R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[48,52]}})",
              data);
}

TEST(SafetensorsTest, ReadsWholeTensorsRowsAndColumns) {
  TempDir dir;
  const std::string path = dir.Write("model.safetensors", GoodFile());
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir.path()));
  EXPECT_THAT(ckpt->Names(), ElementsAre("b", "m"));
  ASSERT_OK_AND_ASSIGN(HostTensor m, ckpt->Read("m", {3, 4}));
  EXPECT_EQ(m.data()[11], 11.f);
  ASSERT_OK_AND_ASSIGN(HostTensor rows, ckpt->ReadRows("m", {3, 4}, 1, 3));
  EXPECT_EQ(rows.shape(), (Shape{2, 4}));
  EXPECT_EQ(rows.data()[0], 4.f);
  EXPECT_EQ(rows.data()[7], 11.f);
  ASSERT_OK_AND_ASSIGN(HostTensor cols, ckpt->ReadCols("m", {3, 4}, 1, 3));
  EXPECT_EQ(cols.shape(), (Shape{3, 2}));
  EXPECT_THAT(std::vector<float>(cols.data(), cols.data() + 6), ElementsAre(1, 2, 5, 6, 9, 10));
  ASSERT_OK_AND_ASSIGN(HostTensor b, ckpt->Read("b", {2}));
  EXPECT_EQ(b.data()[0], 1.f);
  EXPECT_EQ(b.data()[1], -2.f);
  // The stored bytes of rows, unconverted: the bf16 patterns of b[1], the f32 bytes of m's row 2.
  ASSERT_OK_AND_ASSIGN(absl::Span<const uint8_t> b1, ckpt->RowBytes("b", {2}, 1, 2));
  EXPECT_THAT(std::vector<uint8_t>(b1.begin(), b1.end()), ElementsAre(0x00, 0xc0));
  ASSERT_OK_AND_ASSIGN(absl::Span<const uint8_t> m2, ckpt->RowBytes("m", {3, 4}, 2, 3));
  ASSERT_EQ(m2.size(), 16u);
  float row2[4];
  std::memcpy(row2, m2.data(), sizeof(row2));
  EXPECT_THAT(row2, ElementsAre(8, 9, 10, 11));
  ASSERT_OK_AND_ASSIGN(absl::Span<const uint8_t> none, ckpt->RowBytes("m", {3, 4}, 3, 3));
  EXPECT_TRUE(none.empty());
}

TEST(SafetensorsTest, ShapeMismatchAndBadRangesNameTheTensor) {
  TempDir dir;
  dir.Write("model.safetensors", GoodFile());
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir.path()));
  EXPECT_THAT(ckpt->Read("m", {4, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"m\" has shape [3, 4] but the model config implies [4, 3]")));
  EXPECT_THAT(ckpt->ReadRows("m", {3, 4}, 2, 4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of bounds")));
  EXPECT_THAT(ckpt->RowBytes("m", {3, 4}, 2, 4), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of bounds")));
  EXPECT_THAT(ckpt->RowBytes("m", {4, 3}, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[4, 3]")));
  EXPECT_THAT(ckpt->ReadCols("b", {2}, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2-D")));
  EXPECT_THAT(ckpt->Read("nope", {1}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\" not found")));
}

TEST(SafetensorsTest, MissingDirectoryOrFileIsNotFound) {
  TempDir dir;
  EXPECT_THAT(Checkpoint::Open(dir.path()), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no model.safetensors")));
  EXPECT_THAT(Checkpoint::OpenFile(dir.path() + "/x.safetensors"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("x.safetensors")));
}

TEST(SafetensorsTest, TruncatedFilesAreDataLoss) {
  TempDir dir;
  const std::string good = GoodFile();
  EXPECT_THAT(Checkpoint::OpenFile(dir.Write("a.safetensors", good.substr(0, 5))),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("a.safetensors: truncated")));
  EXPECT_THAT(Checkpoint::OpenFile(dir.Write("b.safetensors", good.substr(0, 30))),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header of")));
  EXPECT_THAT(Checkpoint::OpenFile(dir.Write("c.safetensors", good.substr(0, good.size() - 3))),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor \"b\" ends at byte 52")));
}

TEST(SafetensorsTest, ImplausibleHeaderLengthIsRejected) {
  TempDir dir;
  std::string f(16, '\0');
  const uint64_t n = ~uint64_t{0};
  std::memcpy(f.data(), &n, 8);
  EXPECT_THAT(Checkpoint::OpenFile(dir.Write("x.safetensors", f)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("implausible")));
}

struct BadHeader {
  std::string name, header, message;
};

void PrintTo(const BadHeader& c, std::ostream* os) { *os << c.name; }

class BadHeaderTest : public ::testing::TestWithParam<BadHeader> {};

TEST_P(BadHeaderTest, IsRejectedWithAClearMessage) {
  const auto& p = GetParam();
  auto r = ParseSafetensorsHeader(p.header, 16, "f.safetensors");
  ASSERT_FALSE(r.ok()) << p.name;
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(p.message)) << p.name;
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("f.safetensors")) << p.name;
}

INSTANTIATE_TEST_SUITE_P(
    Headers, BadHeaderTest,
    ::testing::Values(
        BadHeader{"NotJson", "{", "not valid JSON"}, BadHeader{"NotObject", "[1]", "not a JSON object"},
        BadHeader{"NoDtype", R"({"t":{"shape":[1],"data_offsets":[0,4]}})", "no string \"dtype\""},
        BadHeader{"BadDtype", R"({"t":{"dtype":"I4","shape":[1],"data_offsets":[0,4]}})", "unsupported dtype \"I4\""},
        BadHeader{"NegativeShape", R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "non-negative"},
        BadHeader{"ShapeOverflow",
                  R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
                  "overflows"},
        BadHeader{"SizeDisagrees", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "occupies 4 bytes"},
        BadHeader{"BeginAfterEnd", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", "begin 8 > end 4"},
        BadHeader{"BeyondData", R"({"t":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", "ends at byte 32"},
        BadHeader{"Overlap",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  "overlap"},
        BadHeader{"BadOffsets", R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "data_offsets"},
        BadHeader{"BadMetadata", R"({"__metadata__":{"a":1}})", "__metadata__"}),
    [](const auto& test_info) { return test_info.param.name; });

TEST(SafetensorsTest, ShardedCheckpointThroughIndex) {
  TempDir dir;
  dir.Write("part-a.safetensors", File(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Floats({1, 2})));
  dir.Write("part-b.safetensors", File(R"({"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Floats({3})));
  dir.Write("model.safetensors.index.json",
            R"({"metadata":{},"weight_map":{"x":"part-a.safetensors","y":"part-b.safetensors"}})");
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(dir.path()));
  ASSERT_OK_AND_ASSIGN(HostTensor y, ckpt->Read("y", {1}));
  EXPECT_EQ(y.data()[0], 3.f);
  ASSERT_OK_AND_ASSIGN(HostTensor x, ckpt->Read("x", {2}));
  EXPECT_EQ(x.data()[1], 2.f);
}

TEST(SafetensorsTest, IndexErrorsNameTheProblem) {
  TempDir dir;
  dir.Write("part-a.safetensors", File(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Floats({1, 2})));
  dir.Write("model.safetensors.index.json", R"({"weight_map":{"x":"../etc/passwd"}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a plain file name")));
  dir.Write("model.safetensors.index.json", R"({"weight_map":{"z":"part-a.safetensors"}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"z\" is mapped to part-a.safetensors")));
  dir.Write("model.safetensors.index.json", R"({"weight_map":{"x":"missing.safetensors"}})");
  EXPECT_THAT(Checkpoint::Open(dir.path()), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.safetensors")));
  dir.Write("model.safetensors.index.json", R"({"nothing":1})");
  EXPECT_THAT(Checkpoint::Open(dir.path()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_map")));
}

TEST(SafetensorsTest, ReadsTheRealStories260KCheckpoint) {
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open("../shared/models/stories260K"));
  EXPECT_EQ(ckpt->Names().size(), 48u);  // 5 layers x 9 + embed, norm, lm_head
  ASSERT_OK_AND_ASSIGN(HostTensor emb, ckpt->ReadRows("model.embed_tokens.weight", {512, 64}, 1, 2));
  ASSERT_OK_AND_ASSIGN(HostTensor head, ckpt->ReadRows("lm_head.weight", {512, 64}, 1, 2));
  for (int i = 0; i < 64; ++i) EXPECT_EQ(emb.data()[i], head.data()[i]);  // tied weights stored twice
}

}  // namespace
}  // namespace shardserve
