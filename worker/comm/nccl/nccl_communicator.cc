#include "worker/comm/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardserve::comm {
namespace {

absl::Status NcclError(const char* call, ncclResult_t r, ncclComm_t comm) {
  std::string detail = ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') detail = absl::StrCat(detail, ": ", last);
  }
  return absl::InternalError(absl::StrCat(call, " failed: ", detail));
}

absl::Status CudaError(const char* call, cudaError_t e) {
  return absl::InternalError(absl::StrCat(call, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, int device, int rank, int size)
      : comm_(comm), own_stream_(stream), stream_(stream), device_(device), rank_(rank), size_(size) {}
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(own_stream_);  // a bound stream belongs to its backend
  }

  bool OrderOnStream(void* stream) override {
    if (stream == nullptr) return false;
    stream_ = static_cast<cudaStream_t>(stream);
    bound_ = true;
    return true;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(float* data, size_t count) override {
    return Run("ncclAllReduce", [&] { return ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, stream_); });
  }
  absl::Status AllGather(const float* send, float* recv, size_t count) override {
    return Run("ncclAllGather", [&] { return ncclAllGather(send, recv, count, ncclFloat, comm_, stream_); });
  }
  absl::Status ReduceScatterSum(const float* send, float* recv, size_t count) override {
    return Run("ncclReduceScatter",
               [&] { return ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm_, stream_); });
  }
  absl::Status Broadcast(float* data, size_t count, int root) override {
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " outside [0, ", size_, ")"));
    }
    return Run("ncclBroadcast", [&] { return ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_); });
  }
  absl::Status Barrier() override {
    // An all-reduce of one element is NCCL's barrier.
    float* one = nullptr;
    if (cudaError_t e = cudaMalloc(&one, sizeof(float)); e != cudaSuccess) return CudaError("cudaMalloc", e);
    absl::Status st = AllReduceSum(one, 1);
    if (st.ok()) {
      if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) st = CudaError("cudaStreamSynchronize", e);
    }
    cudaFree(one);
    return st;
  }
  void Abort(const absl::Status& /*reason*/) override {
    aborted_.store(true);
    ncclCommAbort(comm_);
  }

 private:
  template <typename F>
  absl::Status Run(const char* call, F enqueue) {
    if (aborted_.load()) return absl::AbortedError("NCCL communicator aborted");
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError("cudaSetDevice", e);
    if (ncclResult_t r = enqueue(); r != ncclSuccess) return NcclError(call, r, comm_);
    // On the backend's stream the collective is ordered with the ops around it: no host wait. On
    // our own stream the caller synchronized its backend before the call, and waits here.
    if (bound_) return absl::OkStatus();
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return CudaError("cudaStreamSynchronize", e);
    return absl::OkStatus();
  }

  ncclComm_t comm_;
  const cudaStream_t own_stream_;
  cudaStream_t stream_;  // own_stream_, or the backend's after OrderOnStream
  bool bound_ = false;
  const int device_;
  const int rank_;
  const int size_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(const std::vector<int>& devices) {
  if (devices.empty()) return absl::InvalidArgumentError("NCCL group needs at least one device");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA device ", d, " requested for NCCL but this machine has ", count, " CUDA device(s)"));
    }
  }
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size());
  if (ncclResult_t r = ncclCommInitAll(comms.data(), n, devices.data()); r != ncclSuccess) {
    return NcclError("ncclCommInitAll", r, nullptr);
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) {
    cudaStream_t stream = nullptr;
    cudaSetDevice(devices[static_cast<size_t>(i)]);
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
      for (int j = i; j < n; ++j) ncclCommDestroy(comms[static_cast<size_t>(j)]);
      return CudaError("cudaStreamCreate", e);
    }
    out.push_back(std::make_unique<NcclCommunicator>(comms[static_cast<size_t>(i)], stream,
                                                     devices[static_cast<size_t>(i)], i, n));
  }
  return out;
}

}  // namespace shardserve::comm
