// Collectives among the ranks of one worker (the devices of one node), as NCCL defines them.
//
// Every rank of a group calls the same collectives in the same order with the same counts; a
// collective returns when this rank's part is complete. Buffers are device memory of the calling
// rank's backend (host memory for CPU ranks). Results are deterministic: reductions add the ranks'
// contributions in rank order, so every rank receives bit-identical sums and the result does not
// depend on thread timing.
//
// Errors: when one rank fails (its backend, or Abort()), every rank's pending and later
// collectives return Aborted carrying the first error, so no rank waits forever for a peer.
// A Communicator object is used by its own rank's thread only.
#ifndef SHARDSERVE_WORKER_COMM_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_COMMUNICATOR_H_

#include <cstddef>

#include "absl/status/status.h"

namespace shardserve::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = sum over ranks of data[i], in place. data: [count].
  virtual absl::Status AllReduceSum(float* data, size_t count) = 0;
  // recv[r * count + i] = send_r[i]. send: [count]; recv: [size * count]; must not alias.
  virtual absl::Status AllGather(const float* send, float* recv, size_t count) = 0;
  // recv[i] = sum over ranks of send_r[rank * count + i]. send: [size * count]; recv: [count].
  virtual absl::Status ReduceScatterSum(const float* send, float* recv, size_t count) = 0;
  // data = data of `root`, in place. data: [count].
  virtual absl::Status Broadcast(float* data, size_t count, int root) = 0;
  virtual absl::Status Barrier() = 0;
  // Orders this rank's collectives on `stream`, the opaque queue of the rank's backend
  // (kernels::Backend::stream_handle(); it must outlive every later collective). Returns true when
  // the communicator does so (NCCL given a CUDA stream): a collective then returns once enqueued,
  // after the ops enqueued before it and before those enqueued after it, with no host wait, and
  // the host sees its result after the backend synchronizes. Returns false when it ignores the
  // stream (a null one, or the host communicator, whose collectives complete before returning).
  // Call before the first collective.
  virtual bool OrderOnStream(void* stream) = 0;
  // Marks the group failed with `reason`: every rank's collectives then return Aborted.
  virtual void Abort(const absl::Status& reason) = 0;
};

}  // namespace shardserve::comm

#endif  // SHARDSERVE_WORKER_COMM_COMMUNICATOR_H_
