// Device and link profiles: the figures the simulator's cost model (cost_model.h) turns a
// micro-batch into time with. Plain values.
//
// GPU profiles carry the vendors' published peak figures (datasheets; dense, i.e. without
// structured sparsity) and an achievable fraction of each: a roofline at the peak would predict
// steps no real kernel reaches. The fractions are this project's assumptions, stated once here:
// 0.80 of HBM bandwidth (what well-written decode GEMVs and paged attention reach) and 0.65 of
// dense bf16 tensor-core throughput (large GEMMs). A CPU profile is measured on the machine
// (MeasureCpuProfile in cpu_profile.h) and used at face value (fractions 1.0): the measurement
// already is what our kernels get.
//
// Thread-safety: plain values; the functions are pure.
#ifndef SHARDSERVE_COORDINATOR_SIM_DEVICE_PROFILE_H_
#define SHARDSERVE_COORDINATOR_SIM_DEVICE_PROFILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::sim {

// A link between two ranks (tensor-parallel collectives) or two workers (a stage hop).
struct LinkProfile {
  std::string name;
  double bytes_per_s = 0;  // per direction, per device (ring collectives) or per hop
  double latency_s = 0;    // per message
};

struct DeviceProfile {
  std::string name;
  int64_t memory_bytes = 0;         // informational (the inventory gives what the planner sees)
  double memory_bytes_per_s = 0;    // peak read bandwidth
  double flops_per_s = 0;           // peak dense matrix FLOP/s at the weights' dtype
  double memory_efficiency = 1.0;   // achievable fraction of memory_bytes_per_s
  double compute_efficiency = 1.0;  // achievable fraction of flops_per_s
  // Fixed time per layer (kernel launches, norms, RoPE, small ops) and per step on a stage (host
  // work: batch assembly, sampling, scheduling).
  double layer_overhead_s = 0;
  double step_overhead_s = 0;
  // Whether an op's memory traffic hides under its arithmetic (a GPU's many warps in flight: the
  // op takes the larger of the two) or adds to it (a CPU core's small-batch products: one core
  // streams the weights and then computes on them, so the op takes the sum; measured on the 100M
  // model's stage with 1, 8 and 16 decoding sequences, tests/bench/sim_calibration.py).
  bool overlap_memory_and_compute = true;
  LinkProfile intra_node;  // between the ranks of one worker (NVLink, PCIe, shared memory)
  // Bytes of one activation element between layers and on the wire (the engine keeps f32).
  int64_t activation_bytes = 4;
};

// The built-in GPU profiles: "h100" (SXM5 80 GB), "h200" (SXM 141 GB), "a100" (SXM4 80 GB),
// "l40s" (48 GB, PCIe). NotFound naming the known ones otherwise.
absl::StatusOr<DeviceProfile> GpuProfile(absl::string_view name);
std::vector<std::string> GpuProfileNames();

// Links between workers (stage hops): "ib" (InfiniBand NDR, 400 Gb/s per node), "eth" (100 Gb
// Ethernet), "loopback" (TCP on one machine; the figures of ARCHITECTURE.md). NotFound otherwise.
absl::StatusOr<LinkProfile> NetworkProfile(absl::string_view name);

// A CPU profile from measured figures: read bandwidth (bytes/s), GEMM rate (FLOP/s) of products
// whose weights are already in cache, and the fixed costs; an op takes its reads plus its
// arithmetic (no overlap); ranks joined by the host shared-memory communicator.
DeviceProfile CpuProfile(double memory_bytes_per_s, double flops_per_s, double layer_overhead_s,
                         double step_overhead_s);

}  // namespace shardserve::sim

#endif  // SHARDSERVE_COORDINATOR_SIM_DEVICE_PROFILE_H_
