// The simulator end to end: the real planner and scheduler on virtual time over cost-model
// workers. Each test checks one behaviour a capacity planner relies on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include <string>
#include <vector>

#include "common/log/log.h"
#include "common/model_spec/model_spec.h"
#include "common/plan/plan.h"
#include "coordinator/scheduler/decode_steps.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/sim/cost_model.h"
#include "coordinator/sim/report.h"
#include "coordinator/sim/simulator.h"
#include "coordinator/sim/sweep.h"
#include "coordinator/sim/workload.h"
#include "tests/coordinator/sim/llama_70b.h"
#include "tests/testing/status_matchers.h"

namespace shardserve::sim {
namespace {

using ::shardserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A Llama of about 1.1B parameters in bf16 (TinyLlama's shape).
ModelSpec SmallModel() {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "hidden_act": "silu"})",
                                                  "small");
  CHECK(spec.ok()) << spec.status();
  return *spec;
}

WorkerInventory GpuWorker(const std::string& name, int devices) {
  WorkerInventory w{.worker_id = name, .node_name = name};
  for (int i = 0; i < devices; ++i) {
    w.devices.push_back({.kind = DeviceKind::kCuda, .index = i, .total_bytes = int64_t{80} << 30,
                         .free_bytes = int64_t{80} << 30});
  }
  return w;
}

SimOptions H100Options() {
  SimOptions o;
  o.gpu = *GpuProfile("h100");
  o.network = *NetworkProfile("ib");
  o.max_slots = 64;
  o.policy.max_seq_len = 1024;
  return o;
}

std::vector<SimRequest> Poisson(double rate, int64_t requests, int32_t prompt, int32_t output, uint64_t seed = 1) {
  absl::StatusOr<std::vector<SimRequest>> w = MakePoissonWorkload(
      {.rate = rate, .requests = requests, .prompt_tokens = {prompt, prompt}, .output_tokens = {output, output},
       .seed = seed});
  CHECK(w.ok()) << w.status();
  return *w;
}

TEST(SimulatorTest, AnIdleClusterAnswersInOnePrefillStep) {
  const ModelSpec spec = SmallModel();
  const std::vector<WorkerInventory> workers = {GpuWorker("a", 1)};
  const SimOptions o = H100Options();
  // One request every 10 s: nothing ever waits.
  ASSERT_OK_AND_ASSIGN(SimResult r, Simulate(spec, workers, Poisson(0.1, 20, 128, 8), o));
  ASSERT_EQ(r.completed, 20);
  // What one prefill of 128 tokens costs on the plan's single stage, plus the two hops.
  const StageSpec& stage = r.plan.replicas[0].stages[0];
  const StageCostModel model(spec, stage, o.gpu, 2, 2);
  const SequenceWork prefill{.pos_begin = 0, .tokens = 128, .sample = true};
  const double hops = 2 * HopSeconds(0, spec.hidden_size, 4, o.network, o.hop_overhead_s);
  const double expected = model.Cost({&prefill, 1}).Total() + hops;
  EXPECT_NEAR(r.ttft_s.p50, expected, expected * 0.01);
  EXPECT_NEAR(r.ttft_s.p99, expected, expected * 0.01);
  EXPECT_EQ(r.preemptions, 0);
}

TEST(SimulatorTest, DoublingTheRatePastSaturationGrowsQueueing) {
  const ModelSpec spec = SmallModel();
  const std::vector<WorkerInventory> workers = {GpuWorker("a", 1)};
  SimOptions o = H100Options();
  o.max_slots = 8;  // a small batch makes the replica saturate at a modest rate
  ASSERT_OK_AND_ASSIGN(SimResult light, Simulate(spec, workers, Poisson(5, 400, 128, 128), o));
  ASSERT_OK_AND_ASSIGN(SimResult busy, Simulate(spec, workers, Poisson(40, 400, 128, 128), o));
  ASSERT_OK_AND_ASSIGN(SimResult overload, Simulate(spec, workers, Poisson(80, 400, 128, 128), o));
  // Saturated: throughput stops growing with the rate...
  EXPECT_NEAR(overload.output_tokens_per_s, busy.output_tokens_per_s, busy.output_tokens_per_s * 0.15);
  // ...and the excess waits: TTFT grows far beyond the light load's.
  EXPECT_GT(busy.ttft_s.p50, 10 * light.ttft_s.p50);
  EXPECT_GT(overload.ttft_s.p50, 1.5 * busy.ttft_s.p50);
}

TEST(SimulatorTest, MoreReplicasServeMoreThroughputWhenSaturated) {
  const ModelSpec spec = SmallModel();
  const std::vector<WorkerInventory> workers = {GpuWorker("a", 1), GpuWorker("b", 1)};
  SimOptions o = H100Options();
  o.max_slots = 8;
  o.policy.replicas = 1;
  ASSERT_OK_AND_ASSIGN(SimResult one, Simulate(spec, workers, Poisson(80, 400, 128, 128), o));
  o.policy.replicas = 2;
  ASSERT_OK_AND_ASSIGN(SimResult two, Simulate(spec, workers, Poisson(80, 400, 128, 128), o));
  EXPECT_EQ(one.layout, "tp=1 pp=1 replicas=1");
  EXPECT_EQ(two.layout, "tp=1 pp=1 replicas=2");
  EXPECT_GT(two.output_tokens_per_s, 1.7 * one.output_tokens_per_s);
}

TEST(SimulatorTest, AFaultRemovesTheReplicasThroughput) {
  const ModelSpec spec = SmallModel();
  const std::vector<WorkerInventory> workers = {GpuWorker("a", 1), GpuWorker("b", 1)};
  SimOptions o = H100Options();
  o.max_slots = 8;
  o.max_queued = 100000;
  o.faults = {{.worker = "b", .at_s = 5}};
  // Saturating both replicas for the whole run.
  ASSERT_OK_AND_ASSIGN(SimResult r, Simulate(spec, workers, Poisson(100, 1500, 128, 128), o));
  ASSERT_EQ(r.faults.size(), 1u);
  const FaultReport& f = r.faults[0];
  EXPECT_THAT(f.replicas_removed, ElementsAre(1));
  EXPECT_GT(f.failovers, 0);  // its running sequences moved to replica 0...
  EXPECT_EQ(f.failed, 0);     // ...so none failed
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(r.completed, 1500);
  EXPECT_EQ(f.replan, "tp=1 pp=1 replicas=1");
  // Half the replicas, about half the throughput.
  EXPECT_LT(f.after.output_tokens_per_s, 0.65 * f.before.output_tokens_per_s);
  EXPECT_GT(f.after.output_tokens_per_s, 0.35 * f.before.output_tokens_per_s);
}

TEST(SimulatorTest, WithoutAnotherReplicaAFaultFailsTheRequests) {
  const ModelSpec spec = SmallModel();
  SimOptions o = H100Options();
  o.faults = {{.worker = "a", .at_s = 1}};
  ASSERT_OK_AND_ASSIGN(SimResult r, Simulate(spec, {GpuWorker("a", 1)}, Poisson(20, 100, 64, 64), o));
  ASSERT_EQ(r.faults.size(), 1u);
  EXPECT_GT(r.faults[0].failed, 0);
  EXPECT_GT(r.rejected, 0);  // arrivals after the fault find no replica
  EXPECT_EQ(r.completed + r.failed + r.rejected, r.requests);
  EXPECT_THAT(r.faults[0].replan, HasSubstr("no worker has a device"));
}

// The 100M-parameter f32 Llama of the benchmarks on CPU ranks of two machines, where most of a
// decode micro-batch of several sequences is arithmetic: two stages working on two micro-batches
// at once serve well over the tokens of one micro-batch at a time (each micro-batch reads the
// weights again, so not twice).
TEST(SimulatorTest, PipelineStagesOverlapMicroBatches) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
    "max_position_embeddings": 1024, "torch_dtype": "float32", "hidden_act": "silu"})",
                                                  "100m");
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<WorkerInventory> workers;
  for (const char* n : {"a", "b"}) {
    workers.push_back({.worker_id = n, .node_name = n,
                       .devices = {{.kind = DeviceKind::kCpu, .total_bytes = int64_t{4} << 30,
                                    .free_bytes = int64_t{4} << 30}}});
  }
  SimOptions o;
  o.cpu = CpuProfile(30e9, 110e9, 20e-6, 200e-6);
  o.network = *NetworkProfile("loopback");
  o.max_slots = 16;
  o.policy.pp = 2;
  o.policy.max_seq_len = 256;
  ASSERT_OK_AND_ASSIGN(SimResult piped, Simulate(*spec, workers, Poisson(1000, 200, 32, 64), o));
  o.pipeline_depth = 1;
  ASSERT_OK_AND_ASSIGN(SimResult serial, Simulate(*spec, workers, Poisson(1000, 200, 32, 64), o));
  EXPECT_EQ(piped.layout, "tp=1 pp=2 replicas=1");
  EXPECT_GT(piped.output_tokens_per_s, 1.3 * serial.output_tokens_per_s);
  ASSERT_EQ(piped.stages.size(), 2u);
  EXPECT_GT(piped.stages[0].busy_fraction, 0.6);
  EXPECT_GT(piped.stages[1].busy_fraction, 0.6);
}

// Two CPU stages of the 100M model on one machine: what a second micro-batch gains depends on
// what the machine gives two stages at once. On a machine that runs them no faster together than
// one after the other (parallelism 1: two stages on one core and one bus), the split gains nothing
// and each stage's decode micro-batch of half the sequences takes about as long as the whole one
// alone; with a bus and cores that double, it gains as on two machines.
TEST(SimulatorTest, CpuStagesOfOneMachineShareItsBusAndCores) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
    "max_position_embeddings": 1024, "torch_dtype": "float32", "hidden_act": "silu"})",
                                                  "100m");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto workers = [](const std::string& node_a, const std::string& node_b) {
    std::vector<WorkerInventory> w;
    for (const auto& [id, node] : {std::pair{"a", node_a}, std::pair{"b", node_b}}) {
      w.push_back({.worker_id = id, .node_name = node,
                   .devices = {{.kind = DeviceKind::kCpu, .total_bytes = int64_t{4} << 30,
                                .free_bytes = int64_t{4} << 30}}});
    }
    return w;
  };
  SimOptions o;
  o.cpu = CpuProfile(30e9, 110e9, 20e-6, 300e-6);
  o.network = *NetworkProfile("loopback");
  o.max_slots = 16;
  o.max_step_tokens = 64;
  o.policy.pp = 2;
  o.policy.max_seq_len = 256;
  o.closed_loop_clients = 16;
  auto run = [&](const std::vector<WorkerInventory>& w, int32_t depth, coordinator::HostParallelism p) {
    SimOptions d = o;
    d.pipeline_depth = depth;
    d.cpu_parallelism = p;
    absl::StatusOr<SimResult> r = Simulate(*spec, w, Poisson(1000, 64, 32, 64), d);
    CHECK(r.ok()) << r.status();
    return *r;
  };
  const coordinator::HostParallelism one_core{.memory = 1, .compute = 1}, two{.memory = 2, .compute = 2};
  const SimResult apart_one = run(workers("m0", "m1"), 1, one_core), apart_two = run(workers("m0", "m1"), 2, one_core);
  const SimResult shared_one = run(workers("m", "m"), 1, one_core), shared_two = run(workers("m", "m"), 2, one_core);
  const SimResult doubled_two = run(workers("m", "m"), 2, two);
  // One micro-batch at a time: the stages never overlap, so sharing changes nothing.
  EXPECT_DOUBLE_EQ(shared_one.output_tokens_per_s, apart_one.output_tokens_per_s);
  // Two micro-batches: on two machines they gain; on one that runs one stage at a time, not.
  EXPECT_GT(apart_two.output_tokens_per_s, 1.3 * apart_one.output_tokens_per_s);
  EXPECT_LT(shared_two.output_tokens_per_s, 1.1 * shared_one.output_tokens_per_s);
  ASSERT_EQ(shared_two.stages.size(), 2u);
  EXPECT_GT(shared_two.stages[0].mean_decode_step_s, 1.5 * apart_two.stages[0].mean_decode_step_s);
  // A machine that doubles both: as two machines.
  EXPECT_NEAR(doubled_two.output_tokens_per_s, apart_two.output_tokens_per_s, 1e-6 * apart_two.output_tokens_per_s);
  // A parallelism below 1 is refused, naming the field.
  SimOptions bad = o;
  bad.cpu_parallelism.memory = 0.9;
  EXPECT_THAT(Simulate(*spec, workers("m", "m"), Poisson(1000, 4, 32, 4), bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpu_parallelism")));
}

// The default pipelining (depth 0: the coordinator's policy, chosen per step) on a 70B model over
// two 8 x H100 nodes, simulated: with many long sequences it splits, and serves about as much as
// the better fixed depth; with a few short ones, a step is its weight reads and it does not.
TEST(SimulatorTest, AutoPipeliningServesAsMuchAsTheBetterFixedDepthAcrossGpuNodes) {
  const ModelSpec spec = testing::Llama70B();
  SimOptions o = H100Options();
  o.policy.tp = 8;
  o.policy.pp = 2;
  o.policy.max_seq_len = 4096;
  o.max_slots = 256;
  o.max_step_tokens = 2048;
  auto run = [&](int32_t depth, int32_t clients, int32_t prompt, int32_t output) {
    SimOptions d = o;
    d.pipeline_depth = depth;
    d.closed_loop_clients = clients;
    absl::StatusOr<SimResult> r =
        Simulate(spec, {GpuWorker("n0", 8), GpuWorker("n1", 8)}, Poisson(1000, 2 * clients, prompt, output), d);
    CHECK(r.ok()) << r.status();
    return r->output_tokens_per_s;
  };
  const double many_auto = run(0, 256, 2048, 128), many_one = run(1, 256, 2048, 128), many_two = run(2, 256, 2048, 128);
  EXPECT_GT(many_two, 1.2 * many_one);
  EXPECT_GE(many_auto, 0.95 * std::max(many_one, many_two));
  const double few_auto = run(0, 4, 64, 128), few_one = run(1, 4, 64, 128), few_two = run(2, 4, 64, 128);
  EXPECT_GE(few_auto, 0.95 * std::max(few_one, few_two));
  EXPECT_NEAR(few_auto, few_one, 0.02 * few_one);  // one micro-batch, as depth 1
}

TEST(SimulatorTest, ASmallKvCachePreempts) {
  const ModelSpec spec = SmallModel();
  SimOptions o = H100Options();
  o.policy.kv_tokens = 1024;  // one whole sequence of max_seq_len
  o.max_slots = 16;
  ASSERT_OK_AND_ASSIGN(SimResult r, Simulate(spec, {GpuWorker("a", 1)}, Poisson(50, 200, 200, 200), o));
  EXPECT_EQ(r.kv_blocks, std::vector<int64_t>{64});
  EXPECT_GT(r.preemptions, 0);
  EXPECT_EQ(r.completed, 200);
  EXPECT_GT(r.kv_use_peak, 0.9);
}

TEST(SimulatorTest, TheSameSeedGivesTheSameResult) {
  const ModelSpec spec = SmallModel();
  const std::vector<WorkerInventory> workers = {GpuWorker("a", 2), GpuWorker("b", 2)};
  SimOptions o = H100Options();
  o.max_slots = 8;
  o.policy.pp = 2;
  o.faults = {{.worker = "a", .at_s = 2}};
  ASSERT_OK_AND_ASSIGN(SimResult a, Simulate(spec, workers, Poisson(60, 300, 100, 50, 7), o));
  ASSERT_OK_AND_ASSIGN(SimResult b, Simulate(spec, workers, Poisson(60, 300, 100, 50, 7), o));
  EXPECT_EQ(ResultToJson(a), ResultToJson(b));
  ASSERT_OK_AND_ASSIGN(SimResult c, Simulate(spec, workers, Poisson(60, 300, 100, 50, 8), o));
  EXPECT_NE(ResultToJson(a), ResultToJson(c));
}

TEST(SimulatorTest, ClosedLoopClientsSendBackToBack) {
  const ModelSpec spec = SmallModel();
  SimOptions o = H100Options();
  o.closed_loop_clients = 1;
  // Arrival times are ignored: one client sends each request when the previous one ends.
  ASSERT_OK_AND_ASSIGN(SimResult one, Simulate(spec, {GpuWorker("a", 1)}, Poisson(1000, 10, 64, 16), o));
  EXPECT_EQ(one.completed, 10);
  EXPECT_NEAR(one.duration_s, 10 * one.e2e_s.mean, one.duration_s * 1e-6);
  o.closed_loop_clients = 8;
  ASSERT_OK_AND_ASSIGN(SimResult eight, Simulate(spec, {GpuWorker("a", 1)}, Poisson(1000, 80, 64, 16), o));
  EXPECT_EQ(eight.completed, 80);
  // Eight sequences share each memory-bound decode step: far more than 2x the tokens per second.
  EXPECT_GT(eight.output_tokens_per_s, 4 * one.output_tokens_per_s);
}

// Multi-step decoding as the coordinator chooses it: from the simulated serving overhead per call
// (here a slow serving path, 1 ms a hop) and the stage's simulated compute per decode step.
TEST(SimulatorTest, AutoDecodeStepsPerCallHideASlowServingPath) {
  const ModelSpec spec = SmallModel();
  SimOptions o = H100Options();
  o.closed_loop_clients = 1;
  o.hop_overhead_s = 1e-3;
  o.decode_steps_per_call = 1;
  ASSERT_OK_AND_ASSIGN(SimResult one, Simulate(spec, {GpuWorker("a", 1)}, Poisson(1000, 4, 16, 256), o));
  o.decode_steps_per_call = 0;
  ASSERT_OK_AND_ASSIGN(SimResult automatic, Simulate(spec, {GpuWorker("a", 1)}, Poisson(1000, 4, 16, 256), o));
  ASSERT_EQ(one.completed, 4);
  ASSERT_EQ(automatic.completed, 4);
  ASSERT_THAT(one.decode_steps, ElementsAre(::testing::StartsWith("replica 0: 1 (fixed by --decode_steps_per_call")));
  ASSERT_EQ(automatic.decode_steps.size(), 1u);
  int k = 0;
  ASSERT_EQ(std::sscanf(automatic.decode_steps[0].c_str(), "replica 0: %d (auto: serving overhead", &k), 1)
      << automatic.decode_steps[0];
  // The compute per step is the same either way; the rule's choice for the simulated overhead (the
  // two hops of a call) against it.
  ASSERT_GT(one.stages[0].mean_decode_step_s, 0);
  EXPECT_NEAR(automatic.stages[0].mean_decode_step_s, one.stages[0].mean_decode_step_s,
              one.stages[0].mean_decode_step_s * 0.02);
  const double hops = 2 * HopSeconds(0, spec.hidden_size, 4, o.network, o.hop_overhead_s);
  EXPECT_EQ(k, coordinator::AutoDecodeSteps(absl::Seconds(hops), absl::Seconds(one.stages[0].mean_decode_step_s)));
  EXPECT_GT(k, 1);
  // k steps per call pay the two hops once: the client's tokens per second rise accordingly.
  const double per_token_one = hops + one.stages[0].mean_decode_step_s;
  const double per_token_auto = hops / k + one.stages[0].mean_decode_step_s;
  EXPECT_GT(automatic.output_tokens_per_s, one.output_tokens_per_s * (per_token_one / per_token_auto) * 0.9);
  // And the report says so.
  EXPECT_THAT(ResultToTable(automatic), HasSubstr("decode steps per call: replica 0: "));
}

TEST(SimulatorTest, DecodeStepsPerCallIsValidated) {
  SimOptions o = H100Options();
  o.decode_steps_per_call = -1;
  EXPECT_THAT(Simulate(SmallModel(), {GpuWorker("a", 1)}, Poisson(1, 1, 16, 16), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decode_steps_per_call must be in [0, ")));
  o.decode_steps_per_call = coordinator::kMaxDecodeStepsPerCall + 1;
  EXPECT_THAT(Simulate(SmallModel(), {GpuWorker("a", 1)}, Poisson(1, 1, 16, 16), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decode_steps_per_call")));
}

TEST(SimulatorTest, PlannerErrorsComeThrough) {
  const ModelSpec spec = SmallModel();
  SimOptions o = H100Options();
  o.policy.tp = 3;
  EXPECT_THAT(Simulate(spec, {GpuWorker("a", 4)}, Poisson(1, 10, 8, 8), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_attention_heads")));
  o.policy.tp = 0;
  EXPECT_THAT(Simulate(spec, {GpuWorker("a", 1)}, {}, o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no requests")));
}

TEST(SweepTest, FindsTheFewestDevicesThatMeetTheSlo) {
  const ModelSpec spec = SmallModel();
  std::vector<WorkerInventory> workers;
  for (const char* n : {"a", "b", "c", "d"}) workers.push_back(GpuWorker(n, 1));
  SimOptions o = H100Options();
  o.max_slots = 8;
  const std::vector<SimRequest> load = Poisson(60, 400, 128, 64);
  ASSERT_OK_AND_ASSIGN(Slo slo, ParseSlo("ttft_p99=200ms"));
  ASSERT_OK_AND_ASSIGN(SweepResult s, Sweep(spec, workers, load, o, slo, {.max_pp = 2}));
  ASSERT_TRUE(s.best.has_value());
  const SweepCandidate& best = s.tried[*s.best];
  EXPECT_TRUE(best.meets);
  EXPECT_LE(best.result.ttft_s.p99, 0.2);
  // Nothing cheaper met it.
  for (const SweepCandidate& c : s.tried) {
    if (c.workers < best.workers) {
      EXPECT_FALSE(c.meets) << c.tp << "x" << c.pp << "x" << c.replicas;
    }
  }
  EXPECT_THAT(SweepToTable(s, slo), HasSubstr("cheapest layout meeting the SLO"));
}

TEST(SweepTest, ParsesSlos) {
  ASSERT_OK_AND_ASSIGN(Slo slo, ParseSlo("ttft_p99=500ms,itl_p99=0.05,e2e_p99=20s"));
  EXPECT_DOUBLE_EQ(slo.ttft_p99_s, 0.5);
  EXPECT_DOUBLE_EQ(slo.itl_p99_s, 0.05);
  EXPECT_DOUBLE_EQ(slo.e2e_p99_s, 20);
  EXPECT_THAT(ParseSlo("ttft=1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown bound")));
  EXPECT_THAT(ParseSlo("ttft_p99=-1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive")));
}

}  // namespace
}  // namespace shardserve::sim
