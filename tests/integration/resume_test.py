"""A client resumes across a coordinator restart: a coordinator and one worker as separate
processes; the CLI streams a long seeded (temperature) generation; after its first tokens the
worker is paused (SIGSTOP, so the generation is surely mid-way), the coordinator is killed
(SIGKILL) and started again on the same ports, and the worker goes on (SIGCONT) and registers with
the new coordinator. The CLI's stream breaks with UNAVAILABLE; it resumes with the tokens it has
(GenerateRequest.resume), and must end with exactly `shardserve-run`'s tokens, each once.

    resume_test.py BIN_DIR     (run from the repository root, ../shared beside it)
"""
import os
import select
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
MAX_TOKENS = 400  # the context is 512; long enough to be cut mid-way
SAMPLING = ["--temperature=0.8", "--seed=5"]
LIMIT_S = 45  # the whole test, on a loaded 2-core CI machine; a few seconds normally


class ResumeAcrossACoordinatorRestartTest(ProcessLogs, unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="shardserve-resume-")
        self.api = f"127.0.0.1:{free_port()}"
        self.control = f"127.0.0.1:{free_port()}"
        self.logs = []
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()

    def start(self, args, log):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log(log))
        self.procs.append(p)
        return p

    def start_coordinator(self, run):
        return self.start(
            [os.path.join(BIN, "shardserve-coordinator"), f"--listen={self.api}", f"--control_listen={self.control}",
             f"--model={STORIES}", "--expected_workers=1", "--pp=1", "--tp=1", "--replicas=1",
             "--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=2000"], f"coordinator-{run}.log")

    def cli(self, max_tokens):
        return [os.path.join(BIN, "shardserve"), "generate", f"--server={self.api}", "--prompt_ids",
                ",".join(map(str, PROMPT)), "--max_tokens", str(max_tokens), "--ignore_eos", "--print_ids",
                "--max_resumes=30", *SAMPLING]

    def test_a_streaming_client_gets_the_reference_tokens_across_a_restart(self):
        started = time.time()
        want = subprocess.run(
            [os.path.join(BIN, "shardserve-run"), f"--model={STORIES}", "--prompt_ids", ",".join(map(str, PROMPT)),
             "--max_tokens", str(MAX_TOKENS), "--stop_at_eos=false", "--print_ids", *SAMPLING],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(want.returncode, 0, want.stderr)
        want = [int(x) for x in want.stdout.strip().split(",") if x]
        self.assertEqual(len(want), MAX_TOKENS)

        coordinator = self.start_coordinator(0)
        worker = self.start([os.path.join(BIN, "shardserve-worker"), f"--coordinator={self.control}",
                             "--listen=127.0.0.1:0", "--devices=cpu:1", "--node_name=node-0"], "worker.log")
        while True:  # serving (retries before the first token cover the start-up)
            p = subprocess.run(self.cli(1), capture_output=True, text=True, timeout=60)
            if p.returncode == 0:
                break
            self.assertLess(time.time() - started, LIMIT_S, f"never served: {p.stderr}\n{self._log_tail()}")
            time.sleep(0.2)

        client = subprocess.Popen(self.cli(MAX_TOKENS), stdout=subprocess.PIPE, stderr=self._log("cli.log"))
        self.procs.append(client)
        seen = b""
        while b"," not in seen:  # at least one whole token
            ready, _, _ = select.select([client.stdout], [], [], LIMIT_S)
            self.assertTrue(ready, f"no token streamed\n{self._log_tail()}")
            chunk = os.read(client.stdout.fileno(), 4096)
            self.assertTrue(chunk, f"the CLI ended before its first token\n{self._log_tail()}")
            seen += chunk
        worker.send_signal(signal.SIGSTOP)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        time.sleep(0.1)  # let the last bytes in flight reach the pipe
        ready, _, _ = select.select([client.stdout], [], [], 0)
        if ready:
            seen += os.read(client.stdout.fileno(), 1 << 16)
        before = len([x for x in seen.decode().split(",") if x.strip()])
        self.assertLess(before, MAX_TOKENS, "the generation ended before the restart: nothing was resumed")
        time.sleep(0.5)
        self.start_coordinator(1)
        worker.send_signal(signal.SIGCONT)

        rest, _ = client.communicate(timeout=max(5, LIMIT_S - (time.time() - started)))
        self.assertEqual(client.returncode, 0, self._log_tail())
        got = [int(x) for x in (seen + rest).decode().strip().split(",") if x]
        self.assertEqual(got, want, f"cut after about {before} tokens")
        self.assertIsNone(worker.poll(), f"the worker exited\n{self._log_tail()}")
        with open(os.path.join(self.tmp, "coordinator-1.log")) as f:  # the new coordinator took the resume
            self.assertIn("resumed_tokens=", f.read())
        print(f"resumed after {before} of {MAX_TOKENS} tokens; {time.time() - started:.1f} s in all", file=sys.stderr)


if __name__ == "__main__":
    BIN = sys.argv.pop(1)
    unittest.main()
