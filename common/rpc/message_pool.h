// MessagePool: protobuf messages on arenas that are reused, for the messages a stage stream
// receives or sends every step, so that parsing or building one allocates nothing from the heap in
// the steady state.
//
// A message parsed on the heap allocates every sub-message, repeated field and string of it (a
// decode micro-batch of one sequence: about ten allocations), and frees them all when it goes. A
// message on a protobuf arena takes them from the arena's blocks instead; the pool keeps each
// arena's first block (its own buffer, ArenaOptions::initial_block) across uses, so that a message
// that fits there costs no malloc at all. Only a bytes field longer than the small-string buffer
// (the hidden states) still takes one: protobuf keeps the std::string object on the arena but its
// characters on the heap.
//
// Take() leases a fresh, empty message; dropping the lease gives the arena back to the pool, and the
// next Take() resets it (running the destructors of what the last message held). An arena that outgrew its
// first block comes back with a first block twice what it used (up to kMaxBlockBytes), so that
// the next message of that size fits too. Leases may outlive the pool's owner (they keep the pool
// alive) and move freely between threads; a message must not be moved out of its lease into a
// message elsewhere (protobuf would copy it).
//
// Thread-safety: Take() from any thread; a lease is used by one thread at a time.
#ifndef SHARDSERVE_COMMON_RPC_MESSAGE_POOL_H_
#define SHARDSERVE_COMMON_RPC_MESSAGE_POOL_H_

#include <google/protobuf/arena.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "common/concurrency/mutex.h"

namespace shardserve::rpc {

template <typename M>
class MessagePool : public std::enable_shared_from_this<MessagePool<M>> {
  struct Slot;

 public:
  // The largest first block a pooled arena keeps (a larger message allocates beyond it every time).
  static constexpr size_t kMaxBlockBytes = size_t{1} << 20;

  // One message, on its arena; empty (null) when default-constructed or moved from.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        Release();
        pool_ = std::move(other.pool_);
        slot_ = std::move(other.slot_);
      }
      return *this;
    }
    ~Lease() { Release(); }

    M* get() const { return slot_ == nullptr ? nullptr : slot_->message; }
    M& operator*() const { return *slot_->message; }
    M* operator->() const { return slot_->message; }
    explicit operator bool() const { return slot_ != nullptr; }

   private:
    friend class MessagePool;
    Lease(std::shared_ptr<MessagePool> pool, std::unique_ptr<Slot> slot)
        : pool_(std::move(pool)), slot_(std::move(slot)) {}
    void Release() {
      if (slot_ != nullptr) pool_->Return(std::move(slot_));
      pool_.reset();
    }
    std::shared_ptr<MessagePool> pool_;
    std::unique_ptr<Slot> slot_;
  };

  // `block_bytes`: each arena's first block to begin with; at most `max_idle` arenas wait for reuse
  // (more are freed as they come back).
  static std::shared_ptr<MessagePool> Create(size_t block_bytes, size_t max_idle) {
    return std::shared_ptr<MessagePool>(new MessagePool(block_bytes, max_idle));
  }

  Lease Take() {
    std::unique_ptr<Slot> slot;
    {
      MutexLock lock(&mu_);
      if (!idle_.empty()) {
        slot = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    if (slot == nullptr) {
      slot = std::make_unique<Slot>(block_bytes_);
    } else {
      // Reset here, not as the lease came back: protobuf gives an arena's first block to the thread
      // that reset it last (another thread would allocate a block of its own), and the thread that
      // takes a message is usually the one that fills it.
      slot->arena.Reset();  // frees the blocks beyond the first, runs the last message's destructors
    }
    slot->message = google::protobuf::Arena::CreateMessage<M>(&slot->arena);
    return Lease(this->shared_from_this(), std::move(slot));
  }

  // Arenas waiting for reuse (tests).
  size_t idle() {
    MutexLock lock(&mu_);
    return idle_.size();
  }

 private:
  struct Slot {
    explicit Slot(size_t bytes) : block(new char[bytes]), block_bytes(bytes), arena(Options(block.get(), bytes)) {}
    static google::protobuf::ArenaOptions Options(char* block, size_t bytes) {
      google::protobuf::ArenaOptions options;
      options.initial_block = block;
      options.initial_block_size = bytes;
      return options;
    }
    std::unique_ptr<char[]> block;  // declared before the arena, which uses it until destroyed
    size_t block_bytes;
    google::protobuf::Arena arena;
    M* message = nullptr;  // on `arena`
  };

  MessagePool(size_t block_bytes, size_t max_idle) : block_bytes_(block_bytes), max_idle_(max_idle) {}

  void Return(std::unique_ptr<Slot> slot) {
    const size_t used = static_cast<size_t>(slot->arena.SpaceAllocated());
    slot->message = nullptr;
    {
      MutexLock lock(&mu_);
      if (idle_.size() >= max_idle_) return;  // freed here, unlocked
    }
    if (used > slot->block_bytes && slot->block_bytes < kMaxBlockBytes) {
      // It outgrew its first block: a new arena whose first block holds twice what this one used.
      slot = std::make_unique<Slot>(std::min(kMaxBlockBytes, 2 * used));
    }
    MutexLock lock(&mu_);
    if (idle_.size() < max_idle_) idle_.push_back(std::move(slot));
  }

  const size_t block_bytes_;
  const size_t max_idle_;
  Mutex mu_;
  std::vector<std::unique_ptr<Slot>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::rpc

#endif  // SHARDSERVE_COMMON_RPC_MESSAGE_POOL_H_
