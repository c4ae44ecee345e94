"""One replica, no lost request: a coordinator and one stage worker as separate processes, with
greedy requests in flight when the worker is killed (SIGKILL).

  - the worker is started again on the same address: the requests wait (--recovery_timeout_ms),
    its stage comes back, and each request finishes with exactly the tokens shardserve-run gives;
  - a spare worker (registered after the plan, idle) is there and the stage's worker never comes
    back: the spare takes the stage and the requests finish the same way;
  - the stage's worker is drained (`shardserve drain`) with requests running: they finish, the
    spare takes the stage; the spare, serving, drains itself on SIGTERM and exits.

Each test checks in the coordinator's log that the requests did wait (event=park), so that a run
where they finished before the kill cannot pass unnoticed.

    recovery_test.py BIN_DIR     (run from the repository root, ../shared beside it)
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402
from local_cluster import STORIES  # noqa: E402

BIN = None
TOKENS = 300
CLIENTS = 6
WAIT_S = 120  # bound on every wait; a run takes seconds


def prompts():
    return [[1] + [260 + (13 * i + j) % 100 for j in range(2 + i % 4)] for i in range(CLIENTS)]


def run_alone(prompt):
    p = subprocess.run([os.path.join(BIN, "shardserve-run"), f"--model={STORIES}", "--prompt_ids",
                        ",".join(map(str, prompt)), "--max_tokens", str(TOKENS), "--print_ids"],
                       capture_output=True, text=True, timeout=WAIT_S)
    assert p.returncode == 0, p.stderr
    return [int(x) for x in p.stdout.strip().split(",") if x]


class RecoveryTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="shardserve-recovery-")
        self.api = f"127.0.0.1:{free_port()}"
        self.control = f"127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        self.logs = {}
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            f.close()

    def _log(self, name):
        f = open(os.path.join(self.tmp, name), "w")
        self.logs[name] = f
        return f

    def read_log(self, name):
        self.logs[name].flush()
        with open(self.logs[name].name) as r:
            return r.read()

    def log_tail(self):
        return "\n".join(f"--- {n}\n" + "".join(self.read_log(n).splitlines(True)[-15:]) for n in self.logs)

    def start_coordinator(self):
        self.procs.append(subprocess.Popen(
            [os.path.join(BIN, "shardserve-coordinator"), f"--listen={self.api}", f"--control_listen={self.control}",
             f"--metrics_listen={self.metrics}", f"--model={STORIES}", "--expected_workers=1", "--replicas=1",
             "--pp=1", "--tp=1", "--max_seq_len=320", "--max_slots=8", "--heartbeat_interval_ms=200",
             "--heartbeat_timeout_ms=1000", "--recovery_timeout_ms=60000"],
            stdout=subprocess.DEVNULL, stderr=self._log("coordinator.log")))

    def start_worker(self, name, port):
        p = subprocess.Popen(
            [os.path.join(BIN, "shardserve-worker"), f"--coordinator={self.control}", f"--listen=127.0.0.1:{port}",
             "--devices=cpu:1", f"--node_name={name}"],
            stdout=subprocess.DEVNULL, stderr=self._log(f"{name}-{len(self.procs)}.log"))
        self.procs.append(p)
        return p

    def generate(self, prompt, max_tokens):
        p = subprocess.run(
            [os.path.join(BIN, "shardserve"), "generate", f"--server={self.api}", "--prompt_ids",
             ",".join(map(str, prompt)), "--max_tokens", str(max_tokens), "--print_ids", "--timeout_s=120"],
            capture_output=True, text=True, timeout=WAIT_S + 30)
        if p.returncode != 0:
            return p.stderr.strip()
        return [int(x) for x in p.stdout.strip().split(",") if x]

    def wait_until_serving(self):
        deadline = time.time() + WAIT_S
        last = None
        while time.time() < deadline:
            got = self.generate([1, 2], 2)
            if isinstance(got, list):
                return
            last = got
            time.sleep(0.2)
        self.fail(f"the cluster did not serve: {last}\n{self.log_tail()}")

    def running(self):
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("shardserve_coordinator_running_sequences{"))

    def start_clients(self):
        ps = prompts()
        results = [None] * len(ps)

        def client(i):
            results[i] = self.generate(ps[i], TOKENS)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        deadline = time.time() + WAIT_S
        while time.time() < deadline and self.running() < 1:
            time.sleep(0.01)
        return threads, results

    def check(self, threads, results, expected):
        for t in threads:
            t.join()
        for i, want in enumerate(expected):
            self.assertEqual(results[i], want, f"client {i}\n{self.log_tail()}")
        self.assertIn("event=park", self.read_log("coordinator.log"),
                      "the requests did not wait: they ended before the worker was killed?")

    def test_requests_wait_for_the_killed_worker_to_restart(self):
        expected = [run_alone(p) for p in prompts()]
        self.start_coordinator()
        port = free_port()
        worker = self.start_worker("node-a", port)
        self.wait_until_serving()
        threads, results = self.start_clients()
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        time.sleep(0.5)
        self.start_worker("node-a", port)
        self.check(threads, results, expected)
        log = self.read_log("coordinator.log")
        self.assertRegex(log, r"worker \S+ \(restarted\) replaces")
        self.assertEqual(self.generate(prompts()[0], 8), expected[0][:8], "the cluster serves on")

    def test_a_spare_worker_takes_the_stage_of_a_worker_killed_for_good(self):
        expected = [run_alone(p) for p in prompts()]
        self.start_coordinator()
        worker = self.start_worker("node-a", free_port())
        self.wait_until_serving()
        spare = self.start_worker("node-b", free_port())
        deadline = time.time() + WAIT_S
        spare_log = [n for n in self.logs if n.startswith("node-b")][0]
        while time.time() < deadline and "registered with the coordinator" not in self.read_log(spare_log):
            time.sleep(0.05)
        threads, results = self.start_clients()
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        self.check(threads, results, expected)
        log = self.read_log("coordinator.log")
        self.assertRegex(log, r"worker \S+ \(a spare\) replaces")
        self.assertIsNone(spare.poll())
        self.assertEqual(self.generate(prompts()[1], 8), expected[1][:8], "the cluster serves on")
        self.assertTrue(re.search(r"replica 0 serving", log))

    def test_drain_from_the_cli_and_on_sigterm(self):
        # `shardserve drain` of the only replica's worker while requests run: they finish on it
        # (no other replica), its stage goes to the spare, and the worker is released. Then the
        # spare, now serving, gets SIGTERM: it drains itself and exits on its own.
        expected = [run_alone(p) for p in prompts()]
        self.start_coordinator()
        worker = self.start_worker("node-a", free_port())
        self.wait_until_serving()
        worker_log = [n for n in self.logs if n.startswith("node-a")][0]
        worker_id = re.search(r"registered with the coordinator at \S+ as (\S+)", self.read_log(worker_log)).group(1)
        spare = self.start_worker("node-b", free_port())
        spare_log = [n for n in self.logs if n.startswith("node-b")][0]
        deadline = time.time() + WAIT_S
        while time.time() < deadline and "registered with the coordinator" not in self.read_log(spare_log):
            time.sleep(0.05)
        threads, results = self.start_clients()
        p = subprocess.run([os.path.join(BIN, "shardserve"), "drain", worker_id, f"--server={self.api}",
                            "--drain_timeout_s=60"], capture_output=True, text=True, timeout=WAIT_S)
        self.assertEqual(p.returncode, 0, p.stderr + self.log_tail())
        self.assertIn("drained", p.stdout)
        for t in threads:
            t.join()
        for i, want in enumerate(expected):
            self.assertEqual(results[i], want, f"client {i}\n{self.log_tail()}")
        log = self.read_log("coordinator.log")
        self.assertIn(f"event=drained worker={worker_id}", log)
        self.assertRegex(log, r"worker \S+ \(a spare\) replaces")
        self.assertEqual(self.generate(prompts()[0], 8), expected[0][:8], "the spare serves")
        # Unknown workers are refused.
        p = subprocess.run([os.path.join(BIN, "shardserve"), "drain", "w-nobody", f"--server={self.api}"],
                           capture_output=True, text=True, timeout=WAIT_S)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("NOT_FOUND", p.stderr)
        # SIGTERM: the serving spare drains itself (nothing runs: at once) and exits 0.
        spare.send_signal(signal.SIGTERM)
        self.assertEqual(spare.wait(timeout=60), 0)
        self.assertIn("drained and released", self.read_log(spare_log))
        self.assertIsNone(worker.poll())


if __name__ == "__main__":
    BIN = sys.argv.pop(1)
    unittest.main()
