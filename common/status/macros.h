// Status propagation macros. Abseil 20220623 has no ABSL_RETURN_IF_ERROR, so the project keeps its
// own, shaped like Triton core's RETURN_IF_ERROR.
//
//   RETURN_IF_ERROR(expr);              // returns the absl::Status of `expr` if it is not OK.
//   ASSIGN_OR_RETURN(auto x, expr);     // `expr` is an absl::StatusOr<T>: binds its value to `x`
//                                       // or returns its status.
//
// Both evaluate `expr` exactly once. ASSIGN_OR_RETURN expands to several statements: use it only
// as a statement of its own, inside braces (never as the body of an unbraced `if`). They may be used in functions returning absl::Status or any
// absl::StatusOr<U>.
#ifndef SHARDSERVE_COMMON_STATUS_MACROS_H_
#define SHARDSERVE_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDSERVE_STATUS_CONCAT_INNER_(a, b) a##b
#define SHARDSERVE_STATUS_CONCAT_(a, b) SHARDSERVE_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                               \
  do {                                                      \
    if (::absl::Status _shardserve_st = (expr); !_shardserve_st.ok()) { \
      return _shardserve_st;                                \
    }                                                       \
  } while (false)

#define SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                      \
  if (!tmp.ok()) return std::move(tmp).status();          \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(SHARDSERVE_STATUS_CONCAT_(_shardserve_so_, __LINE__), lhs, expr)

#endif  // SHARDSERVE_COMMON_STATUS_MACROS_H_
