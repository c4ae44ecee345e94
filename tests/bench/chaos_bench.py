#!/usr/bin/env python3
"""Chaos benchmark: a steady load on a local cluster while workers and the coordinator are killed,
stopped and restarted. Not part of the test suite (it runs for minutes); figures only.

A coordinator and --workers workers run as separate processes on 127.0.0.1 with fixed ports, so a
restarted process comes back at the same address. --clients threads send greedy requests without
pause (`shardserve generate --print_ids`, prompts drawn from a fixed set) and check every answer
against the single-process engine's tokens (`shardserve-run`, computed once per prompt). Meanwhile
--faults faults are injected one after another, each followed by --settle_s seconds of load:

  kill-worker    SIGKILL a random worker, start it again after --downtime_s
  stop-worker    SIGSTOP a random worker (a hung process), SIGCONT after --downtime_s
  kill-coord     SIGKILL the coordinator, start it again after --downtime_s

Printed (and with --json, one JSON object): requests sent, completed with the right tokens,
completed with wrong tokens, failed by status code, and per fault what it was and how many requests
failed while it lasted. The aim (issue 20): 0 failed and 0 wrong with --replicas >= 2, and with one
replica when a spare worker exists (--workers > --pp * --replicas).

    python3 tests/bench/chaos_bench.py build/bin [--workers=3 --pp=1 --replicas=2 --faults=10 ...]

Run from the repository root with ../shared beside it.
"""
import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402

STORIES = "../shared/models/stories260K"
PROMPTS = [[1, 45, 371, 33], [1, 403, 29, 102, 11], [1, 9, 77], [1, 250, 251, 252, 253, 254],
           [1, 88], [1, 300, 17, 17, 4]]


class Cluster:
    def __init__(self, args, tmp):
        self.args = args
        self.tmp = tmp
        self.api = f"127.0.0.1:{free_port()}"
        self.control = f"127.0.0.1:{free_port()}"
        self.worker_listen = [f"127.0.0.1:{free_port()}" for _ in range(args.workers)]
        self.coordinator = None
        self.workers = [None] * args.workers
        self.starts = collections.Counter()

    def _log(self, name):
        self.starts[name] += 1
        return open(os.path.join(self.tmp, f"{name}-{self.starts[name]}.log"), "w")

    def start_coordinator(self):
        a = self.args
        self.coordinator = subprocess.Popen(
            [os.path.join(a.bin, "shardserve-coordinator"), f"--listen={self.api}", f"--control_listen={self.control}",
             f"--model={a.model}", f"--expected_workers={a.pp * a.replicas}", f"--pp={a.pp}", "--tp=1",
             f"--replicas={a.replicas}", "--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=2000",
             *a.coordinator_flag],
            stdout=subprocess.DEVNULL, stderr=self._log("coordinator"))

    def start_worker(self, i):
        a = self.args
        self.workers[i] = subprocess.Popen(
            [os.path.join(a.bin, "shardserve-worker"), f"--coordinator={self.control}",
             f"--listen={self.worker_listen[i]}", "--devices=cpu:1", f"--node_name=chaos-{i}"],
            stdout=subprocess.DEVNULL, stderr=self._log(f"worker-{i}"))

    def stop(self):
        for p in [self.coordinator, *self.workers]:
            if p is not None and p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
                p.wait()


def generate(args, api, prompt):
    return subprocess.run(
        [os.path.join(args.bin, "shardserve"), "generate", f"--server={api}", "--prompt_ids",
         ",".join(map(str, prompt)), "--max_tokens", str(args.max_tokens), "--print_ids",
         f"--timeout_s={args.request_timeout_s}"],
        capture_output=True, text=True)


def reference(args, prompt):
    p = subprocess.run(
        [os.path.join(args.bin, "shardserve-run"), f"--model={args.model}", "--prompt_ids",
         ",".join(map(str, prompt)), "--max_tokens", str(args.max_tokens), "--print_ids"],
        capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"shardserve-run failed: {p.stderr}")
    return [int(x) for x in p.stdout.strip().split(",") if x]


CODE = re.compile(r"\b(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
                  r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|"
                  r"INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED)\b")


class Load:
    """Client threads sending requests until stop(); counts outcomes, globally and per window."""

    def __init__(self, args, api, want):
        self.args, self.api, self.want = args, api, want
        self.lock = threading.Lock()
        self.sent = self.ok = self.wrong = 0
        self.failed = collections.Counter()
        self.window_failed = 0
        self.errors = []
        self.running = True
        self.threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(args.clients)]

    def start(self):
        for t in self.threads:
            t.start()

    def stop(self):
        self.running = False
        for t in self.threads:
            t.join()

    def take_window(self):
        with self.lock:
            n, self.window_failed = self.window_failed, 0
            return n

    def _client(self, c):
        rng = random.Random(self.args.seed * 1000 + c)
        while self.running:
            i = rng.randrange(len(PROMPTS))
            with self.lock:
                self.sent += 1
            p = generate(self.args, self.api, PROMPTS[i])
            with self.lock:
                if p.returncode == 0:
                    got = [int(x) for x in p.stdout.strip().split(",") if x]
                    if got == self.want[i]:
                        self.ok += 1
                    else:
                        self.wrong += 1
                        self.errors.append(f"prompt {i}: got {got}, want {self.want[i]}")
                else:
                    m = CODE.search(p.stderr)
                    self.failed[m.group(1) if m else "OTHER"] += 1
                    self.window_failed += 1
                    if len(self.errors) < 20:
                        self.errors.append(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "no output")


def wait_ready(args, cluster, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if generate(args, cluster.api, PROMPTS[0]).returncode == 0:
            return True
        time.sleep(0.5)
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin", help="directory of the shardserve binaries (build/bin)")
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--workers", type=int, default=3, help="worker processes (more than pp x replicas: spares)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=48)
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--kinds", default="kill-worker,stop-worker,kill-coord",
                    help="comma-separated fault kinds to draw from")
    ap.add_argument("--downtime_s", type=float, default=3.0)
    ap.add_argument("--settle_s", type=float, default=8.0, help="load after each fault ends")
    ap.add_argument("--request_timeout_s", type=int, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--coordinator_flag", action="append", default=[],
                    help="an extra coordinator flag (repeatable), e.g. --coordinator_flag=--recovery_timeout=60s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in ("kill-worker", "stop-worker", "kill-coord"):
            ap.error(f"unknown fault kind {k!r}")
    if args.workers < args.pp * args.replicas:
        ap.error("--workers must be at least --pp x --replicas")

    want = [reference(args, p) for p in PROMPTS]
    tmp = tempfile.mkdtemp(prefix="shardserve-chaos-")
    cluster = Cluster(args, tmp)
    rng = random.Random(args.seed)
    faults = []
    try:
        cluster.start_coordinator()
        for i in range(args.workers):
            cluster.start_worker(i)
        if not wait_ready(args, cluster):
            sys.exit(f"the cluster did not answer within 120 s; logs in {tmp}")
        load = Load(args, cluster.api, want)
        load.start()
        time.sleep(args.settle_s)
        load.take_window()
        for n in range(args.faults):
            kind = rng.choice(kinds)
            target = rng.randrange(args.workers)
            started = time.time()
            if kind == "kill-worker":
                cluster.workers[target].kill()
                cluster.workers[target].wait()
                time.sleep(args.downtime_s)
                cluster.start_worker(target)
            elif kind == "stop-worker":
                cluster.workers[target].send_signal(signal.SIGSTOP)
                time.sleep(args.downtime_s)
                cluster.workers[target].send_signal(signal.SIGCONT)
            else:
                target = None
                cluster.coordinator.kill()
                cluster.coordinator.wait()
                time.sleep(args.downtime_s)
                cluster.start_coordinator()
            time.sleep(args.settle_s)
            faults.append({"fault": n + 1, "kind": kind, "worker": target,
                           "failed_during": load.take_window(), "seconds": round(time.time() - started, 1)})
            if not args.json:
                print(f"fault {n + 1}: {kind}{'' if target is None else f' worker {target}'}: "
                      f"{faults[-1]['failed_during']} request(s) failed", file=sys.stderr)
        load.stop()
    finally:
        cluster.stop()
    result = {"workers": args.workers, "pp": args.pp, "replicas": args.replicas, "clients": args.clients,
              "faults": faults, "sent": load.sent, "completed_right": load.ok, "completed_wrong": load.wrong,
              "failed": dict(load.failed), "errors": load.errors[:20], "logs": tmp}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"chaos: {args.workers} workers (pp {args.pp} x {args.replicas} replicas), {args.clients} clients, "
              f"{len(faults)} faults ({args.kinds}), downtime {args.downtime_s} s")
        print(f"requests: {load.sent} sent, {load.ok} right, {load.wrong} wrong, "
              f"{sum(load.failed.values())} failed {dict(load.failed)}")
        for e in load.errors[:10]:
            print(f"  {e}")
        print(f"logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
