// tokenizer.json "post_processor" for single sequences: the ids added before and after the encoded
// text when add_special_tokens is true. Supported types: TemplateProcessing, ByteLevel (adds
// nothing), RobertaProcessing and BertProcessing (cls ... sep), Sequence. Others are Unimplemented.
#ifndef SHARDSERVE_COMMON_TOKENIZER_INTERNAL_POST_PROCESSOR_H_
#define SHARDSERVE_COMMON_TOKENIZER_INTERNAL_POST_PROCESSOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/internal/json_util.h"

namespace shardserve::tokenizer_internal {

struct SpecialAffixes {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
};

// `j` is the "post_processor" value (null adds nothing). Ids must be below `id_limit`.
absl::StatusOr<SpecialAffixes> ParsePostProcessor(const Json& j, const JsonWhere& where, int64_t id_limit);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COMMON_TOKENIZER_INTERNAL_POST_PROCESSOR_H_
