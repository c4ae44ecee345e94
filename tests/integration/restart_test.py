"""Coordinator restarts: a coordinator and two workers (two pipeline stages) as separate processes;
the coordinator is killed (SIGKILL) and started again on the same ports, 20 times, with downtimes
from 1 s to 30 s (most short, a few long: 15 s and 30 s among them, so the test stays near two
minutes). After each restart both workers must register again under the ids they had, the new
coordinator must adopt the stages they hold (no worker loads its weights a second time), and the
cluster must answer with the single-process engine's greedy tokens within RESUME_LIMIT_S of the
coordinator's start, whatever the downtime. The resume times are printed.

Two workers are what once broke this: worker ids restarted at w-1 in every coordinator run, so a
worker still heartbeating under its old id could be taken for the worker that had just registered
under the same id, and was never told to register again (the cluster then waited forever for its
second worker).

    restart_test.py BIN_DIR     (run from the repository root, ../shared beside it)
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402
from local_cluster import STORIES  # noqa: E402
from process_logs import ProcessLogs  # noqa: E402

BIN = None
PROMPT = [1, 45, 371, 33]
MAX_TOKENS = 12
RESUME_LIMIT_S = 30  # generous for a loaded 2-core CI machine; the aim is a few seconds
# Seconds the coordinator stays down before each restart: 20 restarts over 1..30 s.
DOWNTIMES = [1, 1, 2, 1, 3, 1, 15, 1, 1, 2, 1, 5, 1, 1, 30, 1, 2, 1, 8, 1]


class CoordinatorRestartTest(ProcessLogs, unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="shardserve-restart-")
        self.api = f"127.0.0.1:{free_port()}"
        self.control = f"127.0.0.1:{free_port()}"
        self.logs = []
        self.coordinator = None
        self.workers = []

    def tearDown(self):
        for p in [self.coordinator, *self.workers]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()

    def start_coordinator(self, run):
        self.coordinator = subprocess.Popen(
            [os.path.join(BIN, "shardserve-coordinator"), f"--listen={self.api}", f"--control_listen={self.control}",
             f"--model={STORIES}", "--expected_workers=2", "--pp=2", "--tp=1", "--replicas=1",
             "--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=2000"],
            stdout=subprocess.DEVNULL, stderr=self._log(f"coordinator-{run}.log"))

    def generate(self):
        return subprocess.run(
            [os.path.join(BIN, "shardserve"), "generate", f"--server={self.api}", "--prompt_ids",
             ",".join(map(str, PROMPT)), "--max_tokens", str(MAX_TOKENS), "--print_ids"],
            capture_output=True, text=True, timeout=60)

    def worker_ids(self):
        """The worker ids the cluster status lists (sorted)."""
        p = subprocess.run([os.path.join(BIN, "shardserve"), "status", f"--server={self.api}"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        return sorted(set(re.findall(r"\bw-[0-9a-f]{16}\b", p.stdout)))

    def wait_for_answer(self, since):
        """Retries generate until it succeeds; returns (ids, seconds since `since`)."""
        last = None
        while time.time() - since < RESUME_LIMIT_S:
            p = self.generate()
            if p.returncode == 0:
                return [int(x) for x in p.stdout.strip().split(",") if x], time.time() - since
            last = p.stderr.strip()
            time.sleep(0.2)
        self.fail(f"no answer {RESUME_LIMIT_S} s after the coordinator started; last error: {last}\n"
                  f"{self._log_tail()}")

    def test_restarts_resume_with_both_workers(self):
        want = subprocess.run(
            [os.path.join(BIN, "shardserve-run"), f"--model={STORIES}", "--prompt_ids", ",".join(map(str, PROMPT)),
             "--max_tokens", str(MAX_TOKENS), "--print_ids"], capture_output=True, text=True, timeout=120)
        self.assertEqual(want.returncode, 0, want.stderr)
        want = [int(x) for x in want.stdout.strip().split(",") if x]

        self.start_coordinator(0)
        for i in range(2):
            self.workers.append(subprocess.Popen(
                [os.path.join(BIN, "shardserve-worker"), f"--coordinator={self.control}", "--listen=127.0.0.1:0",
                 "--devices=cpu:1", f"--node_name=node-{i}"],
                stdout=subprocess.DEVNULL, stderr=self._log(f"worker-{i}.log")))
        got, _ = self.wait_for_answer(time.time())
        self.assertEqual(got, want)

        # Downtimes shorter and longer than the workers' heartbeat timeout; the workers keep running.
        ids = self.worker_ids()
        resumed = []
        for run, downtime in enumerate(DOWNTIMES, start=1):
            self.coordinator.send_signal(signal.SIGKILL)
            self.coordinator.wait()
            time.sleep(downtime)
            started = time.time()
            self.start_coordinator(run)
            got, seconds = self.wait_for_answer(started)
            self.assertEqual(got, want, f"restart {run} (down {downtime} s)")
            resumed.append(round(seconds, 1))
            for w in self.workers:
                self.assertIsNone(w.poll(), f"a worker exited after restart {run}\n{self._log_tail()}")
            self.assertEqual(self.worker_ids(), ids, f"restart {run}: the workers' ids changed")
        print(f"serving resumed {resumed} s after each coordinator start (downtimes {DOWNTIMES} s; "
              f"max {max(resumed)} s)", file=sys.stderr)
        # The bound, on the median so that one slow start on a loaded CI machine does not fail it.
        self.assertLess(sorted(resumed)[len(resumed) // 2], 5.0, f"resume times {resumed}")
        # Adopted, never reloaded: each worker loaded its stage once, for the first coordinator.
        for i in range(2):
            with open(os.path.join(self.tmp, f"worker-{i}.log")) as f:
                loads = sum(1 for line in f if "loaded in" in line)
            self.assertEqual(loads, 1, f"worker {i} loaded its weights {loads} times\n{self._log_tail()}")


if __name__ == "__main__":
    BIN = sys.argv.pop(1)
    unittest.main()
