// QueryHostMemory on a directory laid out as /proc and /sys/fs/cgroup are: no cgroup limit, a
// cgroup v2 limit (its own or an ancestor's, with page cache not counted as used), v1's limit and
// its "unlimited" value, and files that are missing or malformed.
#include "common/memory/host_memory.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kGiB = int64_t{1} << 30;

class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("host_memory_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "cgroup");
    paths_ = {.meminfo = (root_ / "meminfo").string(),
              .self_cgroup = (root_ / "self_cgroup").string(),
              .cgroup_root = (root_ / "cgroup").string()};
    // A 64 GiB machine with 48 GiB available.
    Write("meminfo", "MemTotal:       67108864 kB\nMemFree:        1000 kB\nMemAvailable:   50331648 kB\n");
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }

  HostMemory Query() {
    absl::StatusOr<HostMemory> m = QueryHostMemory(paths_);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : HostMemory();
  }

  fs::path root_;
  HostMemoryPaths paths_;
};

TEST_F(HostMemoryTest, WithoutACgroupLimitItIsMeminfo) {
  Write("self_cgroup", "0::/\n");
  HostMemory m = Query();
  EXPECT_EQ(m.total_bytes, 64 * kGiB);
  EXPECT_EQ(m.free_bytes, 48 * kGiB);
  EXPECT_EQ(m.cgroup_limit_bytes, 0);
  Write("cgroup/memory.max", "max\n");  // v2 "max" is no limit
  EXPECT_EQ(Query().total_bytes, 64 * kGiB);
  fs::remove(root_ / "self_cgroup");  // no /proc/self/cgroup at all
  EXPECT_EQ(Query().free_bytes, 48 * kGiB);
}

TEST_F(HostMemoryTest, ACgroupV2LimitCapsTotalAndFreeLessWhatTheCgroupUses) {
  // A pod limited to 16 GiB that uses 5 GiB, 2 GiB of it inactive page cache: 13 GiB free.
  Write("self_cgroup", "0::/kubepods/pod1/worker\n");
  Write("cgroup/kubepods/pod1/worker/memory.max", "17179869184\n");
  Write("cgroup/kubepods/pod1/worker/memory.current", std::to_string(5 * kGiB) + "\n");
  Write("cgroup/kubepods/pod1/worker/memory.stat", "anon 3\nfile 2\ninactive_file " + std::to_string(2 * kGiB) + "\n");
  HostMemory m = Query();
  EXPECT_EQ(m.cgroup_limit_bytes, 16 * kGiB);
  EXPECT_EQ(m.total_bytes, 16 * kGiB);
  EXPECT_EQ(m.free_bytes, 13 * kGiB);
  // An ancestor's tighter limit (the pod's 8 GiB over the container's 16) is the one that counts,
  // with the ancestor's use.
  Write("cgroup/kubepods/pod1/memory.max", std::to_string(8 * kGiB));
  Write("cgroup/kubepods/pod1/memory.current", std::to_string(6 * kGiB));
  m = Query();
  EXPECT_EQ(m.total_bytes, 8 * kGiB);
  EXPECT_EQ(m.free_bytes, 2 * kGiB);
  // A limit above the machine's memory is no limit.
  Write("cgroup/kubepods/pod1/memory.max", std::to_string(100 * kGiB));
  Write("cgroup/kubepods/pod1/worker/memory.max", "max");
  m = Query();
  EXPECT_EQ(m.cgroup_limit_bytes, 0);
  EXPECT_EQ(m.total_bytes, 64 * kGiB);
}

TEST_F(HostMemoryTest, ACgroupV1MemoryLimitCountsAndItsUnlimitedValueDoesNot) {
  Write("self_cgroup", "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n");
  Write("cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");  // unlimited
  EXPECT_EQ(Query().cgroup_limit_bytes, 0);
  Write("cgroup/memory/docker/abc/memory.limit_in_bytes", std::to_string(4 * kGiB));
  Write("cgroup/memory/docker/abc/memory.usage_in_bytes", std::to_string(3 * kGiB));
  Write("cgroup/memory/docker/abc/memory.stat", "cache 5\ntotal_inactive_file " + std::to_string(kGiB) + "\n");
  HostMemory m = Query();
  EXPECT_EQ(m.total_bytes, 4 * kGiB);
  EXPECT_EQ(m.free_bytes, 2 * kGiB);
  // Inside a container without a cgroup namespace the host's path does not exist under the
  // container's mount: its root holds the container's own limit.
  fs::remove_all(root_ / "cgroup/memory/docker");
  Write("cgroup/memory/memory.limit_in_bytes", std::to_string(2 * kGiB));
  EXPECT_EQ(Query().total_bytes, 2 * kGiB);
}

TEST_F(HostMemoryTest, MalformedFilesAreNoLimitAndAMissingMeminfoIsAnError) {
  Write("self_cgroup", "garbage\n0::/../../etc\n0::/a\n");
  Write("cgroup/a/memory.max", "lots\n");
  Write("cgroup/a/memory.current", "-5\n");
  HostMemory m = Query();
  EXPECT_EQ(m.cgroup_limit_bytes, 0);
  EXPECT_EQ(m.free_bytes, 48 * kGiB);
  // Usage above the limit leaves nothing free, not a negative figure.
  Write("cgroup/a/memory.max", std::to_string(kGiB));
  Write("cgroup/a/memory.current", std::to_string(3 * kGiB));
  EXPECT_EQ(Query().free_bytes, 0);
  fs::remove(root_ / "meminfo");
  absl::StatusOr<HostMemory> missing = QueryHostMemory(paths_);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("MemTotal"), absl::string_view::npos) << missing.status();
}

TEST(HostMemoryOfThisMachineTest, IsWithinMeminfo) {
  absl::StatusOr<HostMemory> m = QueryHostMemory();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->total_bytes, 0);
  EXPECT_LE(m->free_bytes, m->total_bytes);
}

}  // namespace
}  // namespace shardserve
