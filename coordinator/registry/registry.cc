#include "coordinator/registry/registry.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log/log.h"
#include "common/status/macros.h"

namespace shardserve::coordinator {

absl::string_view WorkerStateName(WorkerState state) {
  switch (state) {
    case WorkerState::kIdle: return "idle";
    case WorkerState::kLoading: return "loading";
    case WorkerState::kReady: return "ready";
    case WorkerState::kFailed: return "failed";
    case WorkerState::kDead: return "dead";
  }
  return "?";
}

absl::Status WorkerRegistry::Options::Validate() const {
  if (heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_interval must be > 0, got ", absl::FormatDuration(heartbeat_interval)));
  }
  if (heartbeat_timeout <= heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_timeout (", absl::FormatDuration(heartbeat_timeout),
                                                   ") must exceed heartbeat_interval (",
                                                   absl::FormatDuration(heartbeat_interval), ")"));
  }
  if (dead_retention <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dead_retention (", absl::FormatDuration(dead_retention), ") must be > 0"));
  }
  if (incarnation.size() > 16 ||
      !std::all_of(incarnation.begin(), incarnation.end(), [](char c) { return absl::ascii_isalnum(c); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("incarnation \"", incarnation, "\" must be at most 16 letters and digits"));
  }
  return absl::OkStatus();
}

namespace {

std::string NewIncarnation() {
  absl::BitGen gen;
  return absl::StrFormat("%08x", absl::Uniform<uint32_t>(gen));
}

}  // namespace

WorkerRegistry::WorkerRegistry(const Options& options, const Clock* clock)
    : options_(options),
      incarnation_(options.incarnation.empty() ? NewIncarnation() : options.incarnation),
      clock_(clock) {
  CHECK(options_.Validate().ok()) << options_.Validate();
  CHECK(clock_ != nullptr);
}

namespace {

absl::Status ValidateRegistration(const WorkerRegistration& r) {
  if (r.node_name.empty()) return absl::InvalidArgumentError("node_name is empty");
  if (r.address.empty()) return absl::InvalidArgumentError("address is empty");
  if (!r.instance_id.empty() &&
      (r.instance_id.size() < 8 || r.instance_id.size() > 64 ||
       !std::all_of(r.instance_id.begin(), r.instance_id.end(),
                    [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_'; }))) {
    return absl::InvalidArgumentError(absl::StrCat("instance_id \"", absl::CHexEscape(r.instance_id),
                                                   "\" must be 8 to 64 letters, digits, '-' or '_'"));
  }
  if (r.state == WorkerState::kDead) return absl::InvalidArgumentError("state: a worker cannot register dead");
  if (r.held.has_value() != (r.state != WorkerState::kIdle)) {
    return absl::InvalidArgumentError(absl::StrCat("held: a worker in state ", WorkerStateName(r.state),
                                                   r.held.has_value() ? " holds no assignment" : " must say what it holds"));
  }
  if (r.held.has_value() && r.held->assignment_id.empty()) {
    return absl::InvalidArgumentError("held.assignment_id is empty");
  }
  std::set<std::pair<DeviceKind, int>> seen;
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const Device& d = r.devices[i];
    const std::string field = absl::StrCat("devices[", i, "]");
    if (!seen.insert({d.kind, d.index}).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": duplicate device ", DeviceKindName(d.kind), ":", d.index));
    }
    if (d.index < 0) return absl::InvalidArgumentError(absl::StrCat(field, ".index is negative: ", d.index));
    if (d.total_bytes < 0 || d.free_bytes < 0 || d.free_bytes > d.total_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": free_bytes (", d.free_bytes,
                                                     ") must be in [0, total_bytes (", d.total_bytes, ")]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WorkerRegistry::CheckClaimLocked(const std::string& id, const WorkerRegistration& reg, absl::Time now) {
  for (auto& [other_id, e] : workers_) {
    WorkerRecord& r = e.record;
    const bool same_worker = other_id == id;
    if (same_worker ? r.registration.address == reg.address : r.registration.address != reg.address) continue;
    if (ExpireLocked(other_id, r, now)) ++version_;
    if (r.state == WorkerState::kDead) continue;
    const std::string claimant =
        absl::StrCat("node ", reg.node_name, ", address ", reg.address, ", instance \"", reg.instance_id, "\"",
                     reg.peer.empty() ? "" : absl::StrCat(", from ", reg.peer));
    const std::string holder = absl::StrCat(
        "worker ", other_id, " (node ", r.registration.node_name, ", address ", r.registration.address,
        ", instance \"", r.registration.instance_id, "\", last heard ",
        absl::FormatDuration(absl::Trunc(now - r.last_heartbeat, absl::Milliseconds(1))), " ago)");
    LOG(WARNING) << "refused a registration (" << claimant << "): it claims the "
                 << (same_worker ? "instance" : "address") << " of live " << holder;
    return absl::AlreadyExistsError(absl::StrCat(
        same_worker ? "instance \"" : "address ", same_worker ? reg.instance_id : reg.address,
        same_worker ? "\" is" : " is", " held by live ", holder,
        "; a restarted worker is accepted once the old one has been silent for ",
        absl::FormatDuration(options_.heartbeat_timeout)));
  }
  return absl::OkStatus();
}

void WorkerRegistry::DropDeadAtLocked(const std::string& id, const std::string& address) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    const WorkerRecord& r = it->second.record;
    if (it->first != id && r.registration.address == address && r.state == WorkerState::kDead) {
      LOG(INFO) << "worker " << it->first << " (" << address << ") is back as another instance; dropping the old record";
      it = workers_.erase(it);
      ++version_;
    } else {
      ++it;
    }
  }
}

absl::StatusOr<std::string> WorkerRegistry::Register(WorkerRegistration registration) {
  if (absl::Status st = ValidateRegistration(registration); !st.ok()) return st;
  const WorkerState state = registration.state;
  const std::string assignment_id = registration.held.has_value() ? registration.held->assignment_id : "";
  const std::string error = state == WorkerState::kFailed ? registration.error : "";
  const int64_t kv_blocks = state == WorkerState::kReady ? registration.kv_blocks : 0;
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::string id;
  if (!registration.instance_id.empty()) {
    id = absl::StrCat("w-", registration.instance_id);
    RETURN_IF_ERROR(CheckClaimLocked(id, registration, now));
    DropDeadAtLocked(id, registration.address);
    if (auto it = workers_.find(id); it != workers_.end()) {
      // The same process again: same id, same record. A live record keeps its state (heartbeats
      // own it); a dead one comes back in the state the worker reports.
      WorkerRecord& r = it->second.record;
      LOG(INFO) << "worker " << id << " (" << registration.address << ") registered again"
                << (r.state == WorkerState::kDead ? " after it was declared dead" : "");
      if (r.state == WorkerState::kDead) {
        r.state = state;
        r.assignment_id = assignment_id;
        r.error = error;
        r.kv_blocks = kv_blocks;
      }
      r.registration = std::move(registration);
      r.last_heartbeat = now;
      it->second.stream = 0;  // its old stream, if still open, no longer speaks for it
      ++version_;
      return id;
    }
  } else {
    // No identity: nobody may claim the address of a live worker that has one (from any node
    // name); a restart at the same (node_name, address) replaces an old record without one.
    bool held_by_identity = false;
    for (auto& [other_id, e] : workers_) {
      WorkerRecord& r = e.record;
      if (r.registration.address != registration.address || r.registration.instance_id.empty()) continue;
      if (ExpireLocked(other_id, r, now)) ++version_;
      held_by_identity |= r.state != WorkerState::kDead;
    }
    if (held_by_identity) RETURN_IF_ERROR(CheckClaimLocked("", registration, now));
    for (auto it = workers_.begin(); it != workers_.end();) {
      const WorkerRecord& old = it->second.record;
      if (old.registration.node_name != registration.node_name || old.registration.address != registration.address) {
        ++it;
        continue;
      }
      LOG(INFO) << "worker " << it->first << " (" << old.registration.address
                << ") registered again; dropping the old record";
      it = workers_.erase(it);
    }
  }
  const uint64_t order = next_id_++;
  if (id.empty()) id = absl::StrCat("w-", incarnation_, "-", order);
  Entry e;
  e.order = order;
  e.record.worker_id = id;
  e.record.registration = std::move(registration);
  e.record.state = state;
  e.record.assignment_id = assignment_id;
  e.record.error = error;
  e.record.kv_blocks = kv_blocks;
  e.record.registered_at = now;
  e.record.last_heartbeat = now;
  LOG(INFO) << "worker " << id << " registered: node " << e.record.registration.node_name << ", address "
            << e.record.registration.address << ", " << e.record.registration.devices.size() << " device(s), "
            << WorkerStateName(state) << (assignment_id.empty() ? "" : absl::StrCat(" holding ", assignment_id));
  workers_.emplace(id, std::move(e));
  ++version_;
  return id;
}

absl::Status WorkerRegistry::Heartbeat(const WorkerHeartbeat& hb) {
  if (hb.state == WorkerState::kDead) {
    return absl::InvalidArgumentError("state: a worker cannot report itself dead");
  }
  absl::MutexLock lock(&mu_);
  // Only this worker's own liveness is evaluated here: a sweep of every worker on every heartbeat
  // made a round of N heartbeats cost O(N^2) (at 1,000 workers, ~25 us per heartbeat under the
  // lock; shardserve-bench-registry). The others are swept by SweepDead and by every read, which
  // the coordinator's control loop does at least every poll interval.
  auto it = workers_.find(hb.worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker_id \"", hb.worker_id, "\"; register again"));
  }
  WorkerRecord& r = it->second.record;
  if (ExpireLocked(it->first, r, clock_->Now())) ++version_;
  if (r.state == WorkerState::kDead) {
    return absl::NotFoundError(absl::StrCat("worker ", hb.worker_id, " was declared dead (", r.error,
                                            "); register again"));
  }
  r.last_heartbeat = clock_->Now();
  if (hb.stream != 0) it->second.stream = hb.stream;
  const std::string error = hb.state == WorkerState::kFailed ? hb.error : std::string();
  const int64_t kv_blocks = hb.state == WorkerState::kReady ? hb.kv_blocks : 0;
  if (r.state != hb.state || r.assignment_id != hb.assignment_id || r.error != error || r.kv_blocks != kv_blocks) {
    if (r.state != hb.state) {
      LOG(INFO) << "worker " << hb.worker_id << ": " << WorkerStateName(r.state) << " -> "
                << WorkerStateName(hb.state) << (hb.assignment_id.empty() ? "" : " (assignment ")
                << hb.assignment_id << (hb.assignment_id.empty() ? "" : ")")
                << (error.empty() ? "" : ": ") << error;
    }
    r.state = hb.state;
    r.assignment_id = hb.assignment_id;
    r.error = error;
    r.kv_blocks = kv_blocks;
    ++version_;
  }
  return absl::OkStatus();
}

std::vector<std::string> WorkerRegistry::SweepLocked() {
  std::vector<std::string> dead;
  const absl::Time now = clock_->Now();
  bool forgot = false;
  for (auto it = workers_.begin(); it != workers_.end();) {
    const WorkerRecord& r = it->second.record;
    if (r.state == WorkerState::kDead && now - r.last_heartbeat > options_.heartbeat_timeout + options_.dead_retention) {
      LOG(INFO) << "forgetting worker " << it->first << " (" << r.registration.address << "), dead since "
                << absl::FormatTime(r.last_heartbeat + options_.heartbeat_timeout);
      it = workers_.erase(it);
      forgot = true;
    } else {
      ++it;
    }
  }
  if (forgot) ++version_;
  for (auto& [id, e] : workers_) {
    if (ExpireLocked(id, e.record, now)) dead.push_back(id);
  }
  if (!dead.empty()) ++version_;
  return dead;
}

bool WorkerRegistry::ExpireLocked(const std::string& id, WorkerRecord& r, absl::Time now) {
  if (r.state == WorkerState::kDead) return false;
  const absl::Duration silent = now - r.last_heartbeat;
  if (silent <= options_.heartbeat_timeout) return false;
  r.error = absl::StrCat("no heartbeat for ", absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))),
                         " (timeout ", absl::FormatDuration(options_.heartbeat_timeout), "), last state ",
                         WorkerStateName(r.state));
  LOG(WARNING) << "worker " << id << " (" << r.registration.address << ") is dead: " << r.error;
  r.state = WorkerState::kDead;
  r.kv_blocks = 0;
  return true;
}

bool WorkerRegistry::Disconnected(const std::string& worker_id, uint64_t stream, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || stream == 0 || it->second.stream != stream) return false;
  WorkerRecord& r = it->second.record;
  if (r.state == WorkerState::kDead) return false;
  r.error = absl::StrCat(reason, ", last state ", WorkerStateName(r.state));
  LOG(WARNING) << "worker " << worker_id << " (" << r.registration.address << ") is dead: " << r.error;
  r.state = WorkerState::kDead;
  r.kv_blocks = 0;
  it->second.stream = 0;
  ++version_;
  return true;
}

std::vector<std::string> WorkerRegistry::SweepDead() {
  absl::MutexLock lock(&mu_);
  return SweepLocked();
}

std::vector<WorkerRecord> WorkerRegistry::List() {
  absl::MutexLock lock(&mu_);
  SweepLocked();
  std::vector<const Entry*> entries;
  entries.reserve(workers_.size());
  for (const auto& [id, e] : workers_) entries.push_back(&e);
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) { return a->order < b->order; });
  std::vector<WorkerRecord> out;
  out.reserve(entries.size());
  for (const Entry* e : entries) out.push_back(e->record);
  return out;
}

std::optional<WorkerRecord> WorkerRegistry::Get(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  SweepLocked();
  auto it = workers_.find(std::string(worker_id));
  if (it == workers_.end()) return std::nullopt;
  return it->second.record;
}

int WorkerRegistry::NumAlive() {
  absl::MutexLock lock(&mu_);
  SweepLocked();
  int n = 0;
  for (const auto& [id, e] : workers_) n += e.record.state != WorkerState::kDead ? 1 : 0;
  return n;
}

uint64_t WorkerRegistry::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

bool WorkerRegistry::WaitForChange(uint64_t seen, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return version_ != seen; };
  return mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
}

}  // namespace shardserve::coordinator
