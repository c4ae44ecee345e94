// GMock matchers for absl::Status / StatusOr (Abseil 20220623 ships none).
//   EXPECT_THAT(status, IsOk());
//   EXPECT_THAT(status_or, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor")));
#ifndef SHARDSERVE_TESTS_TESTING_STATUS_MATCHERS_H_
#define SHARDSERVE_TESTS_TESTING_STATUS_MATCHERS_H_

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardserve::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace shardserve::testing

#define ASSERT_OK_AND_ASSIGN(lhs, expr)                                              \
  auto SHARDSERVE_TEST_CONCAT_(_st_, __LINE__) = (expr);                           \
  ASSERT_TRUE(SHARDSERVE_TEST_CONCAT_(_st_, __LINE__).ok())                        \
      << SHARDSERVE_TEST_CONCAT_(_st_, __LINE__).status();                          \
  lhs = std::move(SHARDSERVE_TEST_CONCAT_(_st_, __LINE__)).value()
#define SHARDSERVE_TEST_CONCAT_INNER_(a, b) a##b
#define SHARDSERVE_TEST_CONCAT_(a, b) SHARDSERVE_TEST_CONCAT_INNER_(a, b)

#endif  // SHARDSERVE_TESTS_TESTING_STATUS_MATCHERS_H_
