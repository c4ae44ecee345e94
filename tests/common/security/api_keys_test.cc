#include "common/security/api_keys.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::security {
namespace {

using ::shardserve::testing::IsOk;
using ::shardserve::testing::StatusIs;
using ::testing::HasSubstr;

std::string File() {
  return absl::StrCat("# name role hash limits\n",                                                //
                      "alice user sha256:", Sha256Hex("alice-key"), " rps=2 burst=2\n",            //
                      "ops admin sha256:", Sha256Hex("ops-key"), "\n",                               //
                      "batch user sha256:", Sha256Hex("batch-key"), " concurrency=1  # one at a time\n");
}

TEST(ApiKeysTest, MissingMalformedOrUnknownKeysAreUnauthenticated) {
  ASSERT_OK_AND_ASSIGN(auto keys, ApiKeys::Parse(File()));
  EXPECT_EQ(keys->size(), 3u);
  EXPECT_THAT(keys->Admit("", ApiRole::kUser), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("missing")));
  EXPECT_THAT(keys->Admit("Basic b3BzLWtleQ==", ApiRole::kUser), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("Bearer")));
  EXPECT_THAT(keys->Admit("Bearer wrong-key", ApiRole::kUser), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("invalid")));
  // The stored hash itself is not a key.
  EXPECT_THAT(keys->Admit(absl::StrCat("Bearer ", Sha256Hex("ops-key")), ApiRole::kUser),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("invalid")));
  ASSERT_OK_AND_ASSIGN(auto lease, keys->Admit("Bearer ops-key", ApiRole::kUser));
  EXPECT_EQ(lease->key_name(), "ops");
}

TEST(ApiKeysTest, AdminCallsNeedTheAdminRole) {
  ASSERT_OK_AND_ASSIGN(auto keys, ApiKeys::Parse(File()));
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kAdmin),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("alice")));
  EXPECT_THAT(keys->Admit("Bearer ops-key", ApiRole::kAdmin), IsOk());
}

TEST(ApiKeysTest, RateLimitIsATokenBucketPerKey) {
  testing::FakeClock clock;
  ASSERT_OK_AND_ASSIGN(auto keys, ApiKeys::Parse(File(), &clock));
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kUser), IsOk());
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kUser), IsOk());
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kUser),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("rps=2")));
  EXPECT_THAT(keys->Admit("Bearer ops-key", ApiRole::kUser), IsOk());  // other keys are not affected
  clock.Advance(absl::Milliseconds(500));                                // one more token
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kUser), IsOk());
  EXPECT_THAT(keys->Admit("Bearer alice-key", ApiRole::kUser), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("rate")));
}

TEST(ApiKeysTest, ConcurrencyLimitHoldsUntilTheLeaseEnds) {
  ASSERT_OK_AND_ASSIGN(auto keys, ApiKeys::Parse(File()));
  {
    ASSERT_OK_AND_ASSIGN(auto first, keys->Admit("Bearer batch-key", ApiRole::kUser));
    EXPECT_THAT(keys->Admit("Bearer batch-key", ApiRole::kUser),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("concurrency=1")));
  }
  EXPECT_THAT(keys->Admit("Bearer batch-key", ApiRole::kUser), IsOk());
}

TEST(ApiKeysTest, MalformedFilesNameTheLine) {
  const std::string h = Sha256Hex("k");
  EXPECT_THAT(ApiKeys::Parse("# nothing\n"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no key")));
  EXPECT_THAT(ApiKeys::Parse(absl::StrCat("\na root sha256:", h)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2: role")));
  EXPECT_THAT(ApiKeys::Parse("a user plaintext-key"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sha256")));
  EXPECT_THAT(ApiKeys::Parse(absl::StrCat("a user sha256:", h, " rps=-1")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad limit")));
  EXPECT_THAT(ApiKeys::Parse(absl::StrCat("a user sha256:", h, "\nb admin sha256:", h)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("same key")));
  EXPECT_THAT(ApiKeys::Load("/nonexistent/keys"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot read")));
}

}  // namespace
}  // namespace shardserve::security
