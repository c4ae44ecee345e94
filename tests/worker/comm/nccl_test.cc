// NCCL collectives and CUDA tensor parallelism (label gpu): skipped without at least two GPUs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "common/model_spec/model_spec.h"
#include "common/safetensors/safetensors.h"
#include "tests/testing/golden.h"
#include "tests/testing/status_matchers.h"
#include "worker/comm/comm_registry.h"
#include "worker/engine/executor.h"
#include "worker/engine/generator.h"
#include "worker/kernels/registry.h"

namespace shardserve {
namespace {

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << kernels::CudaDeviceCount();
  }
};

TEST_F(NcclTest, AllReduceOverTwoGpusSumsInPlace) {
  ASSERT_OK_AND_ASSIGN(auto comms, comm::CreateCommGroup(comm::CommKind::kNccl, 2, {0, 1}));
  std::vector<std::vector<float>> host = {std::vector<float>(1000, 1.f), std::vector<float>(1000, 2.f)};
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto backend = kernels::CreateBackend({.kind = kernels::DeviceKind::kCuda, .device_index = r});
      if (!backend.ok()) {
        results[static_cast<size_t>(r)] = backend.status();
        return;
      }
      auto buf = (*backend)->Allocate(1000 * sizeof(float));
      if (!buf.ok()) {
        results[static_cast<size_t>(r)] = buf.status();
        return;
      }
      auto& h = host[static_cast<size_t>(r)];
      absl::Status st = (*backend)->CopyToDevice(buf->as<void>(), h.data(), h.size() * sizeof(float));
      if (st.ok()) st = comms[static_cast<size_t>(r)]->AllReduceSum(buf->as<float>(), h.size());
      if (st.ok()) st = (*backend)->CopyToHost(h.data(), buf->as<float>(), h.size() * sizeof(float));
      results[static_cast<size_t>(r)] = st;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)].ok()) << results[static_cast<size_t>(r)];
    EXPECT_EQ(host[static_cast<size_t>(r)][0], 3.f);
    EXPECT_EQ(host[static_cast<size_t>(r)][999], 3.f);
  }
}

TEST_F(NcclTest, TwoGpuTensorParallelGreedyMatchesTransformers) {
  ASSERT_OK_AND_ASSIGN(testing::GoldenModel golden, testing::LoadGoldenModel("mixtral"));
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, LoadModelSpec(golden.dir));
  ASSERT_OK_AND_ASSIGN(auto ckpt, Checkpoint::Open(golden.dir));
  engine::ExecutorOptions eo{.kind = kernels::DeviceKind::kCuda, .cuda_devices = {0, 1}};
  ASSERT_OK_AND_ASSIGN(auto ex, engine::TpExecutor::Create(spec, *ckpt, eo));
  std::vector<engine::GenerationRequest> reqs;
  for (const auto& c : golden.cases) {
    reqs.push_back({.prompt = c.prompt_ids, .max_tokens = static_cast<int32_t>(c.greedy_ids.size())});
  }
  ASSERT_OK_AND_ASSIGN(auto res, engine::Generate(*ex, reqs));
  for (size_t i = 0; i < res.size(); ++i) EXPECT_EQ(res[i].tokens, golden.cases[i].greedy_ids);
}

}  // namespace
}  // namespace shardserve
