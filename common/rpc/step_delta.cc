#include "common/rpc/step_delta.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace shardserve::rpc {
namespace {

using ::google::protobuf::RepeatedField;

constexpr uint32_t kKeepProfile = v1::STEP_SEQUENCE_KEEP_PROFILE;
constexpr uint32_t kKeepPenalties = v1::STEP_SEQUENCE_KEEP_PENALTIES;
constexpr uint32_t kKeepMask = v1::STEP_SEQUENCE_KEEP_MASK;
constexpr uint32_t kKnownKeepBits = kKeepProfile | kKeepPenalties | kKeepMask;

bool SameFloat(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }  // bit for bit

// Equal in every field of SamplingParams (step_delta_test holds the list to the proto), bit for bit.
bool SameSampling(const v1::SamplingParams& a, const v1::SamplingParams& b) {
  if (!SameFloat(a.temperature(), b.temperature()) || a.top_k() != b.top_k() || !SameFloat(a.top_p(), b.top_p()) ||
      a.seed() != b.seed() || !SameFloat(a.min_p(), b.min_p()) ||
      !SameFloat(a.presence_penalty(), b.presence_penalty()) ||
      !SameFloat(a.frequency_penalty(), b.frequency_penalty()) ||
      !SameFloat(a.repetition_penalty(), b.repetition_penalty()) || a.logit_bias_size() != b.logit_bias_size()) {
    return false;
  }
  for (const auto& [id, bias] : a.logit_bias()) {
    auto it = b.logit_bias().find(id);
    if (it == b.logit_bias().end() || !SameFloat(it->second, bias)) return false;
  }
  return true;
}

template <typename C>
bool SameInts(const RepeatedField<int32_t>& a, const C& b) {
  return static_cast<size_t>(a.size()) == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// "sequence 3 (key 17, request req-9)": who a refusal is about.
std::string Who(int index, const v1::StepSequence& s) {
  return absl::StrCat("sequence ", index, " (key ", s.key(), ", request ", s.request_id().empty() ? "-" : s.request_id(),
                      ")");
}

bool StrictlyAscending(const RepeatedField<int32_t>& ids) {
  for (int i = 1; i < ids.size(); ++i) {
    if (ids[i - 1] >= ids[i]) return false;
  }
  return true;
}

}  // namespace

void StepSequenceProfile::Take(const v1::StepSequence& s) {
  has_sampling = s.has_sampling();
  if (has_sampling) {
    sampling = s.sampling();
  } else {
    sampling.Clear();
  }
  request_id = s.request_id();
  suppress_ids.assign(s.suppress_token_ids().begin(), s.suppress_token_ids().end());
  logprobs = s.logprobs();
  top_logprobs = s.top_logprobs();
}

void StepSequenceProfile::Give(v1::StepSequence* s) const {
  if (has_sampling) *s->mutable_sampling() = sampling;
  s->set_request_id(request_id);
  s->mutable_suppress_token_ids()->Assign(suppress_ids.begin(), suppress_ids.end());
  s->set_logprobs(logprobs);
  s->set_top_logprobs(top_logprobs);
}

StepDeltaEncoder::StepDeltaEncoder(Options options) : options_(options) {}

void StepDeltaEncoder::Encode(v1::StepRequest* request) {
  if (request->chunk_index() != 0) return;
  ++step_;
  request->set_deltas(true);
  request->clear_forget_keys();
  // Keys this message remembers; a repeated key (a caller's mistake) goes unremembered.
  absl::flat_hash_set<uint64_t>& seen = seen_;
  seen.clear();
  size_t adding = 0;
  for (v1::StepSequence& s : *request->mutable_sequences()) {
    s.set_keep(0);
    s.set_blocks_kept(0);
    if (s.key() == 0) continue;
    if (!seen.insert(s.key()).second) {
      s.set_key(0);
      continue;
    }
    if (!table_.contains(s.key())) ++adding;
  }
  Evict(seen, adding, request);
  for (v1::StepSequence& s : *request->mutable_sequences()) {
    if (s.key() == 0) continue;
    auto it = table_.find(s.key());
    const bool known = it != table_.end();
    if (!known) {
      if (table_.size() >= options_.max_sequences) {  // more keys in one message than the bound
        s.set_key(0);
        continue;
      }
      it = table_.try_emplace(s.key()).first;
    }
    EncodeSequence(&s, it->second, known);
  }
}

void StepDeltaEncoder::EncodeSequence(v1::StepSequence* s, Entry& entry, bool known) {
  entry.last_sent = step_;
  uint32_t keep = 0;
  // Blocks: the common prefix stays (a growing table sends only its new blocks).
  const size_t prefix = !known ? 0
                               : static_cast<size_t>(std::mismatch(s->block_ids().begin(), s->block_ids().end(),
                                                                   entry.blocks.begin(), entry.blocks.end())
                                                         .first -
                                                     s->block_ids().begin());
  entry.blocks.assign(s->block_ids().begin(), s->block_ids().end());
  if (prefix > 0) {  // drop the prefix in place (no allocation)
    RepeatedField<int32_t>* blocks = s->mutable_block_ids();
    std::copy(blocks->begin() + static_cast<int>(prefix), blocks->end(), blocks->begin());
    blocks->Truncate(blocks->size() - static_cast<int>(prefix));
    s->set_blocks_kept(static_cast<int32_t>(prefix));
  }
  // Penalties: the counts that changed, when the new history holds every id of the old one.
  const RepeatedField<int32_t>& ids = s->penalty_token_ids();
  const RepeatedField<int32_t>& counts = s->penalty_token_counts();
  if (known && ids.size() == counts.size() && StrictlyAscending(ids)) {
    RepeatedField<int32_t> up_ids, up_counts;
    size_t old = 0;
    bool dropped = false;  // an old id missing from the new list: not codable as updates
    for (int j = 0; j < ids.size() && !dropped; ++j) {
      if (old < entry.penalty_ids.size() && entry.penalty_ids[old] < ids[j]) {
        dropped = true;
      } else if (old < entry.penalty_ids.size() && entry.penalty_ids[old] == ids[j]) {
        if (entry.penalty_counts[old] != counts[j]) {
          up_ids.Add(ids[j]);
          up_counts.Add(counts[j]);
        }
        ++old;
      } else {
        up_ids.Add(ids[j]);
        up_counts.Add(counts[j]);
      }
    }
    // Every old id was met in order (none dropped), and the updates are fewer than the list.
    if (!dropped && old == entry.penalty_ids.size() && up_ids.size() < ids.size()) {
      entry.penalty_ids.assign(ids.begin(), ids.end());
      entry.penalty_counts.assign(counts.begin(), counts.end());
      s->mutable_penalty_token_ids()->Swap(&up_ids);
      s->mutable_penalty_token_counts()->Swap(&up_counts);
      keep |= kKeepPenalties;
    }
  }
  if ((keep & kKeepPenalties) == 0) {
    entry.penalty_ids.assign(ids.begin(), ids.end());
    entry.penalty_counts.assign(counts.begin(), counts.end());
  }
  // Mask: kept when equal.
  if (known && !s->allowed_token_mask().empty() && s->allowed_token_mask() == entry.mask) {
    s->clear_allowed_token_mask();
    keep |= kKeepMask;
  } else {
    entry.mask = s->allowed_token_mask();
  }
  // Profile: kept when equal.
  StepSequenceProfile& p = entry.profile;
  if (known && s->has_sampling() == p.has_sampling && (!p.has_sampling || SameSampling(s->sampling(), p.sampling)) &&
      s->request_id() == p.request_id && SameInts(s->suppress_token_ids(), p.suppress_ids) &&
      s->logprobs() == p.logprobs && s->top_logprobs() == p.top_logprobs) {
    s->clear_sampling();
    s->clear_request_id();
    s->clear_suppress_token_ids();
    s->clear_logprobs();
    s->clear_top_logprobs();
    keep |= kKeepProfile;
  } else {
    p.Take(*s);
  }
  s->set_keep(keep);
}

void StepDeltaEncoder::Evict(const absl::flat_hash_set<uint64_t>& in_message, size_t adding,
                             v1::StepRequest* request) {
  for (auto it = table_.begin(); it != table_.end();) {
    auto current = it++;
    if (!in_message.contains(current->first) && step_ - current->second.last_sent > options_.forget_after_steps) {
      request->add_forget_keys(current->first);
      table_.erase(current);
    }
  }
  if (table_.size() + adding <= options_.max_sequences) return;
  std::vector<std::pair<int64_t, uint64_t>> candidates;  // (last_sent, key): the oldest first, once sorted
  for (const auto& [key, entry] : table_) {
    if (!in_message.contains(key)) candidates.emplace_back(entry.last_sent, key);
  }
  std::sort(candidates.begin(), candidates.end());
  for (const auto& [last_sent, key] : candidates) {
    if (table_.size() + adding <= options_.max_sequences) break;
    request->add_forget_keys(key);
    table_.erase(key);
  }
}

absl::Status StepDeltaDecoder::Decode(v1::StepRequest* request) {
  if (!request->deltas()) return absl::OkStatus();
  // Check everything first: a refused message changes nothing.
  absl::flat_hash_set<uint64_t>& forgotten = forgotten_;
  forgotten.clear();
  for (uint64_t key : request->forget_keys()) {
    if (!table_.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request->step_id(), ": forget_keys names key ", key,
                                                     ", which is not in this stream's sequence table"));
    }
    if (!forgotten.insert(key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", request->step_id(), ": forget_keys names key ", key, " twice"));
    }
  }
  size_t size = table_.size() - forgotten.size();
  absl::flat_hash_set<uint64_t>& seen = seen_;
  seen.clear();
  for (int i = 0; i < request->sequences_size(); ++i) {
    const v1::StepSequence& s = request->sequences(i);
    const bool delta = s.keep() != 0 || s.blocks_kept() != 0;
    if (s.key() == 0) {
      if (delta) {
        return absl::InvalidArgumentError(
            absl::StrCat("step ", request->step_id(), ": ", Who(i, s), ": keep / blocks_kept without a key"));
      }
      continue;
    }
    if (!seen.insert(s.key()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", request->step_id(), ": ", Who(i, s), ": key appears twice in one step"));
    }
    auto it = table_.find(s.key());
    const bool known = it != table_.end() && !forgotten.contains(s.key());
    if (!known) ++size;
    if (!delta) continue;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request->step_id(), ": ", Who(i, s),
                                                     ": a delta for a sequence this stream does not know"));
    }
    const Entry& e = it->second;
    if (s.blocks_kept() < 0 || static_cast<size_t>(s.blocks_kept()) > e.blocks.size()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request->step_id(), ": ", Who(i, s), ": blocks_kept ",
                                                     s.blocks_kept(), " but the stream knows ", e.blocks.size(),
                                                     " block ids of it"));
    }
    if ((s.keep() & ~kKnownKeepBits) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", request->step_id(), ": ", Who(i, s), ": unknown keep bits ", s.keep()));
    }
    if ((s.keep() & kKeepPenalties) != 0 &&
        (s.penalty_token_ids_size() != s.penalty_token_counts_size() || !StrictlyAscending(s.penalty_token_ids()))) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request->step_id(), ": ", Who(i, s),
                                                     ": penalty_token_ids updates must be ascending, with one "
                                                     "penalty_token_counts entry each"));
    }
  }
  if (size > max_sequences_) {
    return absl::InvalidArgumentError(absl::StrCat("step ", request->step_id(), ": the stream's sequence table would hold ",
                                                   size, " sequences, more than ", max_sequences_));
  }
  // Apply.
  for (uint64_t key : forgotten) table_.erase(key);
  for (v1::StepSequence& s : *request->mutable_sequences()) {
    if (s.key() == 0) continue;
    auto [it, added] = table_.try_emplace(s.key());
    Entry& e = it->second;
    const bool delta = s.keep() != 0 || s.blocks_kept() != 0;
    if (!delta) e = Entry();  // a full entry replaces what was known
    if (s.blocks_kept() > 0) {
      RepeatedField<int32_t> full;
      full.Reserve(s.blocks_kept() + s.block_ids_size());
      full.Add(e.blocks.begin(), e.blocks.begin() + s.blocks_kept());
      full.Add(s.block_ids().begin(), s.block_ids().end());
      s.mutable_block_ids()->Swap(&full);
    }
    e.blocks.assign(s.block_ids().begin(), s.block_ids().end());
    if ((s.keep() & kKeepPenalties) != 0) {
      // Merge the ascending updates into the ascending lists.
      std::vector<int32_t> ids, counts;
      ids.reserve(e.penalty_ids.size() + static_cast<size_t>(s.penalty_token_ids_size()));
      counts.reserve(ids.capacity());
      size_t a = 0;
      int b = 0;
      while (a < e.penalty_ids.size() || b < s.penalty_token_ids_size()) {
        if (b == s.penalty_token_ids_size() || (a < e.penalty_ids.size() && e.penalty_ids[a] < s.penalty_token_ids(b))) {
          ids.push_back(e.penalty_ids[a]);
          counts.push_back(e.penalty_counts[a]);
          ++a;
        } else {
          if (a < e.penalty_ids.size() && e.penalty_ids[a] == s.penalty_token_ids(b)) ++a;  // updated
          ids.push_back(s.penalty_token_ids(b));
          counts.push_back(s.penalty_token_counts(b));
          ++b;
        }
      }
      e.penalty_ids = std::move(ids);
      e.penalty_counts = std::move(counts);
      s.mutable_penalty_token_ids()->Clear();
      s.mutable_penalty_token_ids()->Add(e.penalty_ids.begin(), e.penalty_ids.end());
      s.mutable_penalty_token_counts()->Clear();
      s.mutable_penalty_token_counts()->Add(e.penalty_counts.begin(), e.penalty_counts.end());
    } else {
      e.penalty_ids.assign(s.penalty_token_ids().begin(), s.penalty_token_ids().end());
      e.penalty_counts.assign(s.penalty_token_counts().begin(), s.penalty_token_counts().end());
    }
    if ((s.keep() & kKeepMask) != 0) {
      s.set_allowed_token_mask(e.mask);
    } else {
      e.mask = s.allowed_token_mask();
    }
    if ((s.keep() & kKeepProfile) != 0) {
      e.profile.Give(&s);
    } else {
      e.profile.Take(s);
    }
    s.set_keep(0);
    s.set_blocks_kept(0);
  }
  request->set_deltas(false);
  request->clear_forget_keys();
  return absl::OkStatus();
}

}  // namespace shardserve::rpc
