#include "coordinator/sim/device_profile.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve::sim {
namespace {

constexpr double kGB = 1e9;
constexpr double kTFlop = 1e12;
constexpr int64_t kGiB = int64_t{1} << 30;

// Assumed achievable fractions of the peaks (see device_profile.h).
constexpr double kGpuMemoryEfficiency = 0.80;
constexpr double kGpuComputeEfficiency = 0.65;
// Per layer: about ten kernel launches of a few microseconds each (CUDA graphs hide part of it);
// per step: host-side batch assembly, the copy of the sampled ids and sampling.
constexpr double kGpuLayerOverhead = 20e-6;
constexpr double kGpuStepOverhead = 300e-6;

// NVLink: the figures are the vendors' total per GPU (both directions); a ring all-reduce moves
// data one way per link, so half of it. About 1 us per ring step, so that a small all-reduce over
// 8 GPUs (14 steps) costs ~15 us, the order NCCL reaches on one NVSwitch node.
LinkProfile NvLink(double total_gb_per_s) {
  return {.name = "nvlink", .bytes_per_s = total_gb_per_s / 2 * kGB, .latency_s = 1e-6};
}

DeviceProfile Gpu(std::string name, int64_t memory, double bandwidth, double flops, LinkProfile link) {
  return {.name = std::move(name),
          .memory_bytes = memory,
          .memory_bytes_per_s = bandwidth,
          .flops_per_s = flops,
          .memory_efficiency = kGpuMemoryEfficiency,
          .compute_efficiency = kGpuComputeEfficiency,
          .layer_overhead_s = kGpuLayerOverhead,
          .step_overhead_s = kGpuStepOverhead,
          .intra_node = std::move(link),
          .activation_bytes = 4};
}

}  // namespace

absl::StatusOr<DeviceProfile> GpuProfile(absl::string_view raw) {
  const std::string name = absl::AsciiStrToLower(raw);
  // NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense BF16 (1,979 with
  // sparsity), NVLink 4 at 900 GB/s per GPU.
  if (name == "h100") return Gpu("h100", 80 * kGiB, 3350 * kGB, 989 * kTFlop, NvLink(900));
  // NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; the same compute and NVLink as H100.
  if (name == "h200") return Gpu("h200", 141 * kGiB, 4800 * kGB, 989 * kTFlop, NvLink(900));
  // NVIDIA A100 SXM4 80 GB datasheet: HBM2e at 2,039 GB/s, 312 TFLOP/s dense BF16, NVLink 3 at
  // 600 GB/s per GPU.
  if (name == "a100") return Gpu("a100", 80 * kGiB, 2039 * kGB, 312 * kTFlop, NvLink(600));
  // NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TFLOP/s dense BF16 (733 with sparsity),
  // no NVLink: PCIe Gen4 x16, 64 GB/s both ways, 32 GB/s each way, through the host.
  if (name == "l40s") {
    return Gpu("l40s", 48 * kGiB, 864 * kGB, 362 * kTFlop,
               LinkProfile{.name = "pcie4", .bytes_per_s = 32 * kGB * 0.8, .latency_s = 10e-6});
  }
  return absl::NotFoundError(absl::StrCat("unknown GPU profile \"", raw, "\"; known: ",
                                          absl::StrJoin(GpuProfileNames(), ", ")));
}

std::vector<std::string> GpuProfileNames() { return {"h100", "h200", "a100", "l40s"}; }

absl::StatusOr<LinkProfile> NetworkProfile(absl::string_view raw) {
  const std::string name = absl::AsciiStrToLower(raw);
  // InfiniBand NDR: 400 Gb/s = 50 GB/s per port; a few microseconds of wire and switch latency.
  // shardserve's hops are gRPC streams, whose software cost is DeviceProfile-independent and is
  // added by the cost model as SimOptions::hop_overhead_s.
  if (name == "ib") return LinkProfile{.name = "ib", .bytes_per_s = 50 * kGB * 0.8, .latency_s = 5e-6};
  // 100 Gb Ethernet: 12.5 GB/s.
  if (name == "eth") return LinkProfile{.name = "eth", .bytes_per_s = 12.5 * kGB * 0.8, .latency_s = 20e-6};
  // TCP loopback on the development machines (ARCHITECTURE.md): gRPC one-way stream throughput
  // 1.0-1.45 GB/s, round trip 70 microseconds.
  if (name == "loopback") return LinkProfile{.name = "loopback", .bytes_per_s = 1.2 * kGB, .latency_s = 35e-6};
  return absl::NotFoundError(absl::StrCat("unknown network \"", raw, "\"; known: ib, eth, loopback"));
}

DeviceProfile CpuProfile(double memory_bytes_per_s, double flops_per_s, double layer_overhead_s,
                         double step_overhead_s) {
  // Host shared-memory communicator: a copy through memory and a spinning barrier (~0.14 us,
  // ARCHITECTURE.md); the copy is charged at the read bandwidth.
  return {.name = "cpu",
          .memory_bytes = 0,
          .memory_bytes_per_s = memory_bytes_per_s,
          .flops_per_s = flops_per_s,
          .memory_efficiency = 1.0,
          .compute_efficiency = 1.0,
          .layer_overhead_s = layer_overhead_s,
          .step_overhead_s = step_overhead_s,
          .overlap_memory_and_compute = false,
          .intra_node = {.name = "shm", .bytes_per_s = memory_bytes_per_s / 2, .latency_s = 1e-6},
          .activation_bytes = 4};
}

}  // namespace shardserve::sim
