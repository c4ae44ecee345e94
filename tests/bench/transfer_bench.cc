// shardserve-bench-transfer: the cost of sending a stage's hidden states to the next stage, as a
// prefill chunk sends them (megabytes per micro-batch), through the StageStreamClient every hop
// uses, to an in-process stage that parses each message as a worker does and answers the last chunk.
//
// Three ways of building the micro-batch, taking turns in one run:
//   copied: the bytes are copied into each message's hidden.data and then serialized by gRPC (how
//           ToNextStage built its messages before they carried their bytes as slices);
//   slices: ToNextStage's messages, whose bytes ride beside them as slices of the engine's output
//           buffer (StageStreamClient::WireMessage): no copy of ours, none by serialization;
//   bf16:   the same with --hidden_wire_dtype=bf16: the sender rounds the states into a buffer of
//           half the size, which its slices view, and the receiver widens them back.
// The receiving stage converts each reassembled micro-batch as a worker does (service::FromProto:
// F32 read in place, BF16 widened).
// Printed per micro-batch: the wall time from Send to its answer, and the CPU time of the whole
// process (sender, gRPC and the receiving stage's parse; medians of --rounds rounds), with the
// copy's rate (memcpy GB/s, measured here) for scale. --keep_heap_blocks (default true) sets the
// allocator as shardserve-worker does (common/memory/malloc_tuning.h).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/concurrency/mutex.h"
#include "common/memory/malloc_tuning.h"
#include "common/rpc/message_pool.h"
#include "common/rpc/stage_stream_client.h"
#include "shardserve/v1/stage.grpc.pb.h"
#include "common/tensor/dtype.h"
#include "worker/service/convert.h"

ABSL_FLAG(int32_t, tokens, 2048, "tokens of the prefill chunk");
ABSL_FLAG(int32_t, hidden, 4096, "hidden size (floats per token)");
ABSL_FLAG(int32_t, iters, 20, "micro-batches per round and way");
ABSL_FLAG(int32_t, rounds, 5, "rounds (the two ways take turns)");
ABSL_FLAG(bool, keep_heap_blocks, true, "the allocator settings of shardserve-worker --keep_heap_blocks");

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWays = 3;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Reads micro-batches as a worker does (each message parsed, chunks reassembled) and answers each
// once its last chunk is in.
class ReceivingStage final : public v1::Stage::CallbackService {
  class Reactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
   public:
    explicit Reactor(int64_t hidden) : hidden_(hidden), assembler_(size_t{1} << 31) { ReadNext(); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      absl::StatusOr<bool> complete = assembler_.Add(std::move(reading_));
      if (!complete.ok()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, std::string(complete.status().message())));
        return;
      }
      if (!*complete) {
        ReadNext();
        return;
      }
      const service::PooledStepRequest whole = assembler_.Take();
      resp_.set_step_id(whole->step_id());
      if (absl::Status st = service::FromProto(*whole, hidden_, &batch_); !st.ok()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, std::string(st.message())));
        return;
      }
      resp_.set_compute_us(batch_.input().size());  // the floats it got, for the check
      StartWrite(&resp_);
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        ReadNext();
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnDone() override { delete this; }

   private:
    void ReadNext() {  // into a pooled message, as a worker reads
      reading_ = pool_->Take();
      StartRead(reading_.get());
    }
    const std::shared_ptr<rpc::MessagePool<v1::StepRequest>> pool_ = rpc::MessagePool<v1::StepRequest>::Create(4096, 4);
    const int64_t hidden_;
    service::ChunkAssembler assembler_;
    service::StageBatch batch_;
    service::PooledStepRequest reading_;
    v1::StepResponse resp_;
  };

 public:
  explicit ReceivingStage(int64_t hidden) : hidden_(hidden) {}
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* StepStream(grpc::CallbackServerContext*) override {
    return new Reactor(hidden_);
  }

 private:
  const int64_t hidden_;
};

// The micro-batch as ToNextStage built it before: each chunk's bytes copied into its message.
rpc::StageStreamClient::Messages Copied(const service::StageBatch& batch, const std::vector<float>& hidden,
                                        int64_t hidden_size, rpc::MessagePool<v1::StepRequest>& pool) {
  rpc::StageStreamClient::Messages slices = service::ToNextStage(batch, {}, hidden_size, pool);
  const char* bytes = reinterpret_cast<const char*>(hidden.data());
  const size_t size = hidden.size() * sizeof(float);
  const size_t chunks = (size + service::kMaxChunkBytes - 1) / service::kMaxChunkBytes;
  rpc::StageStreamClient::Messages out;
  for (size_t c = 0; c < chunks; ++c) {
    rpc::StageStreamClient::Message m = c == 0 ? std::move(slices[0]) : pool.Take();
    const size_t begin = c * service::kMaxChunkBytes;
    const size_t end = std::min(size, begin + service::kMaxChunkBytes);
    m->set_step_id(batch.step_id);
    m->set_chunk_index(static_cast<uint32_t>(c));
    m->set_chunk_count(static_cast<uint32_t>(chunks));
    m->mutable_hidden()->set_data(bytes + begin, end - begin);
    out.push_back(std::move(m));
  }
  return out;
}

int Run() {
  const int64_t tokens = absl::GetFlag(FLAGS_tokens), hidden = absl::GetFlag(FLAGS_hidden);
  const int iters = absl::GetFlag(FLAGS_iters), rounds = absl::GetFlag(FLAGS_rounds);
  if (tokens < 1 || hidden < 1 || iters < 1 || rounds < 1 || tokens * hidden > (int64_t{1} << 29)) {
    std::fprintf(stderr, "--tokens, --hidden, --iters and --rounds must be >= 1, tokens x hidden <= 2^29\n");
    return 1;
  }
  ReceivingStage stage(hidden);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(service::kMaxMessageBytes);
  builder.RegisterService(&stage);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(service::kMaxMessageBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 1;
  std::shared_ptr<rpc::StageStreamClient> client = rpc::StageStreamClient::Open(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args),
      {.peer = "bench stage"});
  const auto pool = rpc::MessagePool<v1::StepRequest>::Create(4096, 16);

  service::StageBatch batch;
  batch.sequences.resize(1);
  batch.sequences[0].step.num_tokens = static_cast<int32_t>(tokens);
  batch.sequences[0].step.block_ids.assign(static_cast<size_t>((tokens + 15) / 16), 1);
  std::vector<float> output(static_cast<size_t>(tokens * hidden));
  for (size_t i = 0; i < output.size(); ++i) output[i] = static_cast<float>(i % 1000) * 0.001f;
  const size_t bytes = output.size() * sizeof(float);

  Mutex mu;
  CondVar cv;
  uint64_t answered = 0;
  uint64_t step_id = 0;
  bool failed = false;
  // One micro-batch the way `way` (0 copied, 1 slices, 2 bf16): {wall s, process CPU s}, or {-1, -1}
  // when it failed.
  auto send = [&](int way) -> std::pair<double, double> {
    batch.step_id = ++step_id;
    std::vector<float> engine_output = output;  // as the engine hands it over (not timed)
    const double cpu0 = ProcessCpuSeconds();
    const Clock::time_point t0 = Clock::now();
    rpc::StageStreamClient::Messages messages =
        way == 0 ? Copied(batch, engine_output, hidden, *pool)
                 : service::ToNextStage(batch, std::move(engine_output), hidden, *pool,
                                        way == 2 ? DType::kBF16 : DType::kF32);
    engine_output = std::vector<float>();  // freed in the timed part either way (by gRPC for slices)
    rpc::StageStreamClient::Answer answer = [&, id = batch.step_id](absl::StatusOr<v1::StepResponse> r) {
      MutexLock lock(&mu);
      failed = failed || !r.ok() || r->compute_us() != output.size();
      if (!r.ok()) {
        std::fprintf(stderr, "step %llu: %s\n", static_cast<unsigned long long>(id), r.status().ToString().c_str());
      }
      answered = id;
      cv.SignalAll();
    };
    if (!client->Send(batch.step_id, std::move(messages), answer).ok()) return {-1, -1};
    {
      MutexLock lock(&mu);
      while (answered != batch.step_id) cv.Wait(&mu);
      if (failed) return {-1, -1};
    }
    return {Seconds(Clock::now() - t0), ProcessCpuSeconds() - cpu0};
  };
  // Warm-up, then rounds.
  for (int i = 0; i < 3; ++i) {
    for (int way = 0; way < kWays; ++way) {
      if (send(way).first < 0) return 1;
    }
  }
  std::vector<double> wall[kWays], cpu[kWays];
  for (int r = 0; r < rounds; ++r) {
    for (int way = 0; way < kWays; ++way) {
      double w = 0, c = 0;
      for (int i = 0; i < iters; ++i) {
        const auto [wi, ci] = send(way);
        if (wi < 0) return 1;
        w += wi;
        c += ci;
      }
      wall[way].push_back(w / iters);
      cpu[way].push_back(c / iters);
    }
  }
  client->Close("bench over");
  client->WaitDone(absl::Seconds(10));
  server->Shutdown();

  // memcpy's rate on this machine, for scale (best of 5 copies of the same bytes).
  std::vector<float> to(output.size());
  double best = 1e9;
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point t0 = Clock::now();
    std::memcpy(to.data(), output.data(), bytes);
    best = std::min(best, Seconds(Clock::now() - t0));
  }
  const double mib = static_cast<double>(bytes) / (1 << 20);
  std::printf("micro-batch of %lld tokens x %lld floats = %.1f MiB in %zu chunks of <= %zu MiB; memcpy %.1f GB/s "
              "(one copy %.2f ms); large heap blocks kept: %s\n",
              static_cast<long long>(tokens), static_cast<long long>(hidden), mib,
              (bytes + service::kMaxChunkBytes - 1) / service::kMaxChunkBytes, service::kMaxChunkBytes >> 20,
              static_cast<double>(bytes) / best / 1e9, best * 1e3,
              absl::GetFlag(FLAGS_keep_heap_blocks) ? "yes" : "no");
  const char* names[kWays] = {"copied", "slices", "bf16"};
  for (int way = 0; way < kWays; ++way) {
    std::printf("%-7s Send to answer %.2f ms (%.2f GB/s of f32 states), process CPU %.2f ms per micro-batch (medians "
                "of %d rounds of %d)\n",
                names[way], Median(wall[way]) * 1e3, static_cast<double>(bytes) / Median(wall[way]) / 1e9,
                Median(cpu[way]) * 1e3, rounds, iters);
  }
  std::printf("slices / copied: wall %.2f, CPU %.2f\n", Median(wall[1]) / Median(wall[0]),
              Median(cpu[1]) / Median(cpu[0]));
  std::printf("bf16 / slices: wall %.2f, CPU %.2f\n", Median(wall[2]) / Median(wall[1]),
              Median(cpu[2]) / Median(cpu[1]));
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_keep_heap_blocks) && !shardserve::KeepLargeBlocksInTheHeap()) {
    std::fprintf(stderr, "--keep_heap_blocks: the allocator refused\n");
  }
  return shardserve::Run();
}

