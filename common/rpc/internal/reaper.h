// DisposeOffGrpcThreads: drops a finished call's last reference on a thread of its own.
//
// A client reactor's ClientContext holds a reference to its channel, and dropping the last
// reference to a channel on one of gRPC's callback threads (as destroying the client inside its
// OnDone could) releases the callback completion queue from its own thread, which gRPC's C++
// library does not survive. So a reactor's OnDone hands its self-reference here, and one
// long-lived thread (started on first use, never joined: it may outlive main()) drops it.
//
// Thread-safety: may be called from any thread.
#ifndef SHARDSERVE_COMMON_RPC_INTERNAL_REAPER_H_
#define SHARDSERVE_COMMON_RPC_INTERNAL_REAPER_H_

#include <memory>

namespace shardserve::rpc::internal {

void DisposeOffGrpcThreads(std::shared_ptr<void> object);

}  // namespace shardserve::rpc::internal

#endif  // SHARDSERVE_COMMON_RPC_INTERNAL_REAPER_H_
