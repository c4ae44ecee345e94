// Multi-step decoding, chosen per replica: how many decode steps one worker call of an eligible
// decode batch asks for (scheduler.h "Multi-step decoding" says which batches are eligible).
//
// Why it matters. Every call costs the serving path a fixed amount on top of the worker's compute:
// the request and the answer cross gRPC, the coordinator applies the answer, streams the tokens
// and builds the next batch. With a small model on a CPU (a decode step of ~0.1 ms) that overhead
// is several steps' worth, and one step per call serves a third of the engine's own rate; with a
// large model on a GPU (a step of ~10 ms) it is a few percent. Running k steps per call divides the
// overhead by k, but a call of k steps makes new arrivals wait for it and delivers tokens in bursts
// of k, so k should be as small as makes the overhead negligible.
//
// The rule (AutoDecodeSteps). From the serving overhead per call o (the call's time as the
// scheduler sees it, including its own work between two calls, less the worker's compute for
// the call) and the worker's compute per decode step c, the smallest k in
// [1, kMaxAutoDecodeSteps] with
//     o <= kOverheadShare * k * c            (the overhead is at most a quarter of the compute)
// and never more than fit in kMaxCallCompute of compute (k * c <= 20 ms: bursts stay invisible
// and a new request waits at most that long for the call in flight); at least 1. So a 0.3 ms
// overhead against 10 ms steps gives k = 1, and 0.2 ms against 0.08 ms steps gives k = 10.
//
// DecodeStepsTuner applies the rule to moving averages (EWMA) of what a replica's calls measure:
// it stays at 1 until kMinTimedCalls calls of decode-only batches were timed (a worker that does
// not report its compute time, StepResponse.compute_us = 0, leaves it at 1 for good), and then
// moves only when the rule, with the averages moved kHysteresis against the move (more overhead
// and less compute to go down, less overhead and more compute to go up), still asks for another k,
// so that noise around a boundary does not make it flap. A fixed K (--decode_steps_per_call=K
// >= 1) bypasses all of this: the tuner then always answers K.
//
// Thread-safety: AutoDecodeSteps is pure. A DecodeStepsTuner is not thread-safe (the scheduler
// keeps one per replica under its lock).
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_DECODE_STEPS_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_DECODE_STEPS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace shardserve::coordinator {

// Most decode steps per call the automatic choice asks for.
inline constexpr int32_t kMaxAutoDecodeSteps = 16;
// The overhead per call may be at most this share of the call's compute.
inline constexpr double kOverheadShare = 0.25;
// The most compute one call of several decode steps may take.
inline constexpr absl::Duration kMaxCallCompute = absl::Milliseconds(20);

// The rule above: the decode steps per call for a serving overhead per call `overhead` and a
// compute per decode step `compute_per_step`. 1 when compute_per_step <= 0 (nothing measured).
int32_t AutoDecodeSteps(absl::Duration overhead, absl::Duration compute_per_step);

class DecodeStepsTuner {
 public:
  // Timed calls before the tuner moves off 1.
  static constexpr int kMinTimedCalls = 8;
  // Weight of a new measurement in the moving averages.
  static constexpr double kEwmaWeight = 0.1;
  // How far the averages must move past a boundary of the rule before k changes.
  static constexpr double kHysteresis = 0.15;

  // `fixed` >= 1: always that many steps (the measurements are still averaged, for Describe);
  // 0: automatic (the rule above). A negative value is a programmer error.
  explicit DecodeStepsTuner(int32_t fixed);

  // One answered call of a decode-only batch (every sequence decoding one token): `call` is its
  // time as the scheduler saw it (the step loop's own work before the call included), `compute`
  // the worker's compute for it (zero = not reported: the call is not counted), `steps` the
  // decode steps it ran (>= 1).
  void Observe(absl::Duration call, absl::Duration compute, int32_t steps);

  // The most decode steps an eligible batch asks for now, >= 1.
  int32_t steps() const { return steps_; }
  bool automatic() const { return fixed_ == 0; }
  // The moving averages (zero before the first timed call).
  absl::Duration overhead_per_call() const { return absl::Microseconds(overhead_us_); }
  absl::Duration compute_per_step() const { return absl::Microseconds(compute_us_); }
  int64_t timed_calls() const { return timed_calls_; }

  // One line: steps() and why, e.g. "8 (auto: serving overhead 0.21 ms per call against 0.08 ms of
  // compute per step)".
  std::string Describe() const;

 private:
  const int32_t fixed_;  // 0 = automatic
  int32_t steps_ = 1;
  int64_t timed_calls_ = 0;
  double overhead_us_ = 0;  // EWMA of the serving overhead per call
  double compute_us_ = 0;   // EWMA of the compute per decode step
};

}  // namespace shardserve::coordinator

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_DECODE_STEPS_H_
