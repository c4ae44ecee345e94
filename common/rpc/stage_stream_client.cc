#include "common/rpc/stage_stream_client.h"

#include <utility>
#include <vector>

#include <google/protobuf/io/coded_stream.h>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/rpc/internal/call_end.h"

namespace shardserve::rpc {

namespace {

// Stage.StepStream's method path, as the generated stub names it.
const std::string& StepStreamMethod() {
  static const std::string* const method =
      new std::string(absl::StrCat("/", v1::Stage::service_full_name(), "/StepStream"));
  return *method;
}

constexpr uint64_t LengthDelimitedTag(int field) { return (static_cast<uint64_t>(field) << 3) | 2; }

}  // namespace

grpc::ByteBuffer StageStreamClient::WireMessage(const v1::StepRequest& message, const grpc::Slice& hidden) {
  const size_t size = message.ByteSizeLong();
  grpc::Slice slices[3] = {grpc::Slice(size), grpc::Slice(), grpc::Slice()};
  // A fresh slice of `size` bytes is ours to fill (gRPC's own serializer does the same).
  message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(slices[0].begin()));
  if (hidden.size() == 0) return grpc::ByteBuffer(slices, 1);
  // hidden { data: <the slice> }: two tags and two lengths (at most 22 bytes, inline in a slice).
  constexpr uint64_t kHiddenTag = LengthDelimitedTag(v1::StepRequest::kHiddenFieldNumber);
  constexpr uint64_t kDataTag = LengthDelimitedTag(v1::Tensor::kDataFieldNumber);
  using Coded = google::protobuf::io::CodedOutputStream;
  const uint64_t data_bytes = hidden.size();
  const uint64_t tensor_bytes = Coded::VarintSize64(kDataTag) + Coded::VarintSize64(data_bytes) + data_bytes;
  uint8_t head[40];
  uint8_t* end = Coded::WriteVarint64ToArray(kHiddenTag, head);
  end = Coded::WriteVarint64ToArray(tensor_bytes, end);
  end = Coded::WriteVarint64ToArray(kDataTag, end);
  end = Coded::WriteVarint64ToArray(data_bytes, end);
  const size_t n = static_cast<size_t>(end - head);
  slices[1] = grpc::Slice(head, n);
  slices[2] = hidden;
  return grpc::ByteBuffer(slices, 3);
}

grpc::Slice StageStreamClient::OwningSlice(std::vector<float> values) {
  if (values.empty()) return grpc::Slice();
  auto* owned = new std::vector<float>(std::move(values));
  return grpc::Slice(
      owned->data(), owned->size() * sizeof(float), [](void* p) { delete static_cast<std::vector<float>*>(p); }, owned);
}

StageStreamClient::StageStreamClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : options_(std::move(options)), channel_(std::move(channel)), stub_(channel_) {}

std::shared_ptr<StageStreamClient> StageStreamClient::Open(std::shared_ptr<grpc::Channel> channel, Options options) {
  std::shared_ptr<StageStreamClient> client(new StageStreamClient(std::move(channel), std::move(options)));
  client->Start();
  return client;
}

void StageStreamClient::Start() {
  {
    MutexLock lock(&mu_);
    self_ = shared_from_this();  // gRPC uses the reactor until OnDone
  }
  stub_.PrepareBidiStreamingCall(&context_, StepStreamMethod(), grpc::StubOptions(), this);
  AddHold();  // released by Stop, so that OnDone waits for writes started outside reactions
  StartRead(&read_);
  StartCall();
}

absl::Status StageStreamClient::Send(uint64_t step_id, Messages messages, Answer& answer) {
  if (messages.empty()) return absl::InvalidArgumentError(absl::StrCat("step ", step_id, " has no messages"));
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i]) return absl::InvalidArgumentError(absl::StrCat("step ", step_id, " has an empty message lease"));
  }
  absl::InlinedVector<size_t, 4> sizes;  // for on_sent, called unlocked
  bool start = false;
  {
    MutexLock lock(&mu_);
    if (closing_) {
      return absl::UnavailableError(absl::StrCat(options_.peer, " ", problem_.empty() ? "is closed" : problem_));
    }
    if (!waiting_.try_emplace(step_id, std::move(answer)).second) {  // moves only if inserted
      return absl::InvalidArgumentError(absl::StrCat("step_id ", step_id, " is already in flight on the ",
                                                     options_.peer));
    }
    // Coded here, past every refusal and in queue order: the peer decodes in the order written.
    if (deltas_ != nullptr) deltas_->Encode(messages[0].get());
    if (options_.on_sent) {
      // (The hidden slice's tags and lengths, a few bytes, are not counted.)
      for (size_t i = 0; i < messages.size(); ++i) {
        sizes.push_back(messages[i]->ByteSizeLong() + messages.hidden(i).size());
      }
    }
    for (size_t i = 0; i < messages.size(); ++i) queue_.push_back(std::move(messages.entry(i)));
    if (!writing_) {
      writing_ = true;
      TakeNextWriteLocked();
      ++starting_;
      start = true;
    }
  }
  for (size_t bytes : sizes) options_.on_sent(bytes);
  if (!start) return absl::OkStatus();
  StartWrite(&writing_wire_);  // gRPC serializes it here, on this thread
  bool release = false;
  {
    MutexLock lock(&mu_);
    --starting_;
    release = ReleaseHoldLocked();
  }
  if (release) RemoveHold();
  return absl::OkStatus();
}

void StageStreamClient::TakeNextWriteLocked() {
  writing_entry_ = std::move(queue_.front());
  queue_.pop_front();
  writing_wire_ = WireRequest{.message = writing_entry_.message.get(), .hidden = &writing_entry_.hidden};
}

bool StageStreamClient::Forget(uint64_t step_id) {
  MutexLock lock(&mu_);
  return waiting_.erase(step_id) > 0;
}

void StageStreamClient::Close(const std::string& why) { Stop(why, /*cancel=*/true); }

bool StageStreamClient::closing() {
  MutexLock lock(&mu_);
  return closing_;
}

bool StageStreamClient::WaitDone(absl::Duration timeout) {
  MutexLock lock(&mu_);
  return internal::WaitUntilDone(&mu_, &done_cv_, &done_, timeout);
}

void StageStreamClient::Stop(const std::string& why, bool cancel) {
  bool release = false;
  {
    MutexLock lock(&mu_);
    if (!closing_) {
      closing_ = true;
      problem_ = why;
      release = ReleaseHoldLocked();
    }
    if (cancel && !cancelled_ && !done_) {
      cancelled_ = true;
      problem_ = absl::StrCat("closed: ", why);
    } else {
      cancel = false;
    }
  }
  if (cancel) context_.TryCancel();
  if (release) RemoveHold();
}

bool StageStreamClient::ReleaseHoldLocked() {
  if (!closing_ || starting_ > 0 || hold_released_) return false;
  hold_released_ = true;
  return true;
}

void StageStreamClient::OnWriteDone(bool ok) {
  // The written message goes back to its pool, and the hidden bytes once gRPC lets go of their
  // slice: after the lock (`written` is destroyed last).
  Messages::Entry written;
  bool next = false;
  {
    MutexLock lock(&mu_);
    written = std::move(writing_entry_);
    writing_wire_ = WireRequest();
    if (ok && !closing_ && !queue_.empty()) {
      TakeNextWriteLocked();
      next = true;
    } else {
      writing_ = false;
    }
  }
  if (!ok) {
    Stop("failed a write", /*cancel=*/false);  // the read fails too; OnDone brings the status
    return;
  }
  if (next) StartWrite(&writing_wire_);  // from a reaction: the call cannot end meanwhile
}

void StageStreamClient::OnReadDone(bool ok) {
  if (!ok) {
    Stop("ended the stream", /*cancel=*/false);
    return;
  }
  if (options_.on_received) options_.on_received(read_.ByteSizeLong());
  Answer answer;
  {
    MutexLock lock(&mu_);
    answer = internal::TakeWaiting(waiting_, read_.step_id());
  }
  if (answer == nullptr) {
    // An answer to nothing in flight (e.g. the peer could not reassemble a batch): the stream's
    // state is unknown, so it ends and what is waiting fails.
    Stop(absl::StrCat("answered step ", read_.step_id(), ", which was not in flight",
                      read_.error_message().empty() ? "" : ": ", read_.error_message()),
         /*cancel=*/true);
    return;
  }
  v1::StepResponse response = std::move(read_);
  read_.Clear();
  // Answer before reading on: the next answer's reaction may run on another thread as soon as the
  // read is started, and the caller must see answers in the order the peer gave them. (Inside
  // this reaction the call cannot end, so the client is alive while `answer` runs.)
  answer(std::move(response));
  StartRead(&read_);
}

void StageStreamClient::OnReadInitialMetadataDone(bool ok) {
  if (!ok) return;
  const auto& metadata = context_.GetServerInitialMetadata();
  const auto announced = [&metadata](const char* key) {
    auto it = metadata.find(key);
    return it != metadata.end() && it->second == "1";
  };
  const bool deltas = options_.step_deltas && announced(kStepDeltasKey);
  const bool overlapped = announced(kOverlappedDecodeKey);
  MutexLock lock(&mu_);
  overlapped_decode_ = overlapped;
  if (deltas) deltas_ = std::make_unique<StepDeltaEncoder>();
}

bool StageStreamClient::overlapped_decode() {
  MutexLock lock(&mu_);
  return overlapped_decode_;
}

void StageStreamClient::OnDone(const grpc::Status& status) {
  absl::flat_hash_map<uint64_t, Answer> waiting;
  std::string problem;
  bool cancelled = false;
  {
    MutexLock lock(&mu_);
    closing_ = true;
    cancelled = cancelled_;
    if (!cancelled_) internal::DescribeEnd(status, &problem_);  // when we cancelled, our reason says more
    problem = problem_;
    waiting = std::move(waiting_);
    waiting_.clear();
  }
  if (!waiting.empty() || (!status.ok() && !cancelled)) {
    LOG(WARNING) << options_.peer << " " << problem << "; " << waiting.size() << " micro-batch(es) in flight fail";
  }
  const absl::Status failed = absl::UnavailableError(absl::StrCat(options_.peer, " ", problem));
  for (auto& [step_id, answer] : waiting) answer(failed);
  // Its own reference may be the last: the client is then destroyed on the reaper's thread.
  internal::MarkDoneAndDispose(&mu_, &done_cv_, &done_, &self_);
}

}  // namespace shardserve::rpc

namespace grpc {

Status SerializationTraits<shardserve::rpc::WireRequest, void>::Serialize(const shardserve::rpc::WireRequest& request,
                                                                          ByteBuffer* buffer, bool* own_buffer) {
  const Slice none;  // empty: no allocation
  ByteBuffer bytes = shardserve::rpc::StageStreamClient::WireMessage(
      *request.message, request.hidden != nullptr ? *request.hidden : none);
  buffer->Swap(&bytes);
  *own_buffer = true;
  return Status::OK;
}

Status SerializationTraits<shardserve::rpc::WireRequest, void>::Deserialize(ByteBuffer* /*buffer*/,
                                                                            shardserve::rpc::WireRequest* /*request*/) {
  return Status(StatusCode::UNIMPLEMENTED, "a WireRequest is only written");
}

}  // namespace grpc
