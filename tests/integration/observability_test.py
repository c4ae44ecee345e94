#!/usr/bin/env python3
"""Observability end to end: a local cluster (shardserve-local: a coordinator and two workers,
pipeline-parallel and tensor-parallel over a tiny Mixture-of-Experts model) scraped every second by
a real Prometheus server (Debian's `prometheus`) on loopback. The test sends a known number of
requests with the `shardserve` CLI, then asks Prometheus's HTTP API that

  - every process was scraped and the coordinator's and workers' series exist;
  - the counters agree with what was sent (requests, one of them refused, prompt and generated
    tokens, first-token and latency observations, tokens through each stage, tokens routed to
    experts);
  - every metric name the Grafana dashboards (deploy/grafana/*.json) use is one the processes
    really export, and every dashboard query is valid PromQL;

and that the structured logs let one request be followed through the coordinator and both stages.

Usage: observability_test.py BIN_DIR   (run from the repository root; ctest does both)."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402
from local_cluster import LocalCluster  # noqa: E402

BIN = None
MODEL = "tests/golden/models/qwen2_moe"  # 3 layers (0 and 2 MoE, 8 experts, top-2), vocab 256
SCRAPE_INTERVAL_S = 1
# (prompt ids, max_tokens): each request generates exactly max_tokens tokens (--ignore_eos).
REQUESTS = [([1, 17, 42], 6), ([1, 5], 4), ([1, 9, 9, 9, 30, 31], 8), ([1, 2, 3, 4], 5), ([1], 7), ([1, 60, 61], 3)]
# Refused with INVALID_ARGUMENT (token 300 is outside the vocabulary).
BAD_REQUEST = ([1, 300], 4)


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Prometheus:
    """A Prometheus server on 127.0.0.1 with its own storage directory, stopped by stop()."""

    def __init__(self, workdir, coordinator, workers):
        binary = shutil.which("prometheus")
        if binary is None:
            raise AssertionError("the `prometheus` server is not installed (Debian package prometheus; "
                                 ".ci/install_deps.sh installs it with the test packages)")
        # Queries are evaluated at this Unix time once freeze() has set it, else at the server's now.
        self.at = None
        # The same jobs and labels as deploy/prometheus/prometheus.yml, with the ports of this run.
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {"job_name": "shardserve-coordinator",
                 "static_configs": [{"targets": [coordinator], "labels": {"component": "coordinator"}}]},
                {"job_name": "shardserve-worker",
                 "static_configs": [{"targets": workers, "labels": {"component": "worker",
                                                                    "worker_group": "default"}}]},
            ],
        }
        path = os.path.join(workdir, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.log = open(os.path.join(workdir, "prometheus.log"), "w+")
        # The port is free when picked, but another test running beside this one may take it before
        # the server binds it: then the server exits at once and a new port is tried.
        for attempt in range(5):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen(
                [binary, f"--config.file={path}", f"--storage.tsdb.path={os.path.join(workdir, f'data{attempt}')}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=self.log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return
            if self.proc.poll() is None or "address already in use" not in self.tail():
                break
        self.stop()
        raise AssertionError(f"prometheus did not become ready: {self.tail()}")

    def _wait_ready(self):
        """True once the server answers /-/ready; False when it exits or 30 s pass."""
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if "Ready" in get(f"{self.url}/-/ready", timeout=2):
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def tail(self):
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-20:])

    def api(self, path, **params):
        body = json.loads(get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr):
        """The instant vector of `expr` as {frozenset(labels): value}, at `self.at` when set."""
        data = self.api("query", query=expr, **({} if self.at is None else {"time": f"{self.at:.3f}"}))
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr}: {data['resultType']}, not a vector")
        return {frozenset(r["metric"].items()): float(r["value"][1]) for r in data["result"]}

    def scalar(self, expr):
        """The value of an expression that must give exactly one series."""
        v = self.query(expr)
        if len(v) != 1:
            raise AssertionError(f"{expr}: {len(v)} series, wanted 1: {v}")
        return next(iter(v.values()))

    def wait_for(self, expr, want, timeout=30):
        """Polls until `expr` gives one series equal to `want` (fresh scrapes); returns the last value."""
        deadline = time.time() + timeout
        got = None
        while time.time() < deadline:
            v = self.query(expr)
            got = next(iter(v.values())) if len(v) == 1 else v
            if got == want:
                return got
            time.sleep(0.25)
        return got

    def freeze(self, after, timeout=30):
        """Fixes the time every later query is evaluated at: a moment at which each target's latest
        scrape began after `after` (a Unix time) and succeeded. A scrape that fails (it timed out on a
        busy machine) marks every series of its target stale, and an instant query then finds none of
        them until the next scrape; evaluated at a fixed moment, every assertion reads the same samples
        whatever scrapes come later. The moment lies two intervals back, so the scrapes that began
        before it have finished (each is bounded by the scrape timeout, one interval)."""
        targets = 'up{job=~"shardserve-.*"}'
        deadline = time.time() + timeout
        while True:
            self.at = time.time() - 2 * SCRAPE_INTERVAL_S
            up = self.query(f"count({targets} == 1)")
            first = self.query(f"min(timestamp({targets}))")
            ok = (next(iter(up.values()), 0) == 3 and next(iter(first.values()), 0) > after)
            if ok:
                return
            if time.time() > deadline:
                self.at = None
                raise AssertionError(f"no moment after {after:.3f} with every target scraped: up {up}, "
                                     f"oldest latest scrape {first}; {self.api('targets')}")
            time.sleep(0.25)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Cluster(LocalCluster):
    """The cluster under test: PP=2 x TP=2 over the MoE model, with every process's metrics."""

    def __init__(self, extra_env):
        super().__init__(BIN, MODEL, 2, "cpu:2", ["--pp=2", "--tp=2", "--max_slots=4"], env=extra_env, timeout=120)

    def generate(self, prompt, max_tokens, expect_ok=True):
        p = self.cli("generate", "--prompt_ids", ",".join(map(str, prompt)), "--max_tokens", str(max_tokens),
                     "--ignore_eos", "--print_ids", check=False, timeout=120)
        if (p.returncode == 0) != expect_ok:
            raise AssertionError(f"generate exited with {p.returncode}: {p.stderr}")
        return [int(x) for x in p.stdout.strip().split(",") if x] if expect_ok else p.stderr


def host_port(url):
    return urllib.parse.urlparse(url).netloc


def dashboard_exprs():
    """(file, panel title, expr) of every query in deploy/grafana/*.json, rows' panels included."""
    out = []

    def walk(file, panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((file, p.get("title", "?"), t["expr"]))
            walk(file, p.get("panels", []))

    for file in sorted(glob.glob("deploy/grafana/*.json")):
        with open(file) as f:
            walk(file, json.load(f)["panels"])
    return out


class Observability(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="shardserve-obs-")
        cls.cluster = None
        cls.prom = None
        try:
            # GLOG_v=1: the workers log one line per step with its request ids.
            cls.cluster = Cluster({"GLOG_v": "1"})
            assert len(cls.cluster.worker_metrics) == 2, cls.cluster.worker_metrics
            cls.prom = Prometheus(cls.tmp, host_port(cls.cluster.coordinator_metrics),
                                  [host_port(u) for u in cls.cluster.worker_metrics])
            # Every target answers before any request, so counters start from their first value.
            got = cls.prom.wait_for('count(up{job=~"shardserve-.*"} == 1)', 3)
            assert got == 3, f"targets up: {got}; {cls.prom.api('targets')}"
            cls.results = [None] * len(REQUESTS)
            errors = []

            def send(i):
                try:
                    cls.results[i] = cls.cluster.generate(*REQUESTS[i])
                except Exception as e:  # reported below, with the others
                    errors.append(f"request {i} {REQUESTS[i]}: {e}")

            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(REQUESTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            cls.bad_error = cls.cluster.generate(*BAD_REQUEST, expect_ok=False)
            load_end = time.time()
            # Wait for a scrape that saw every request end.
            want = float(len(REQUESTS) + 1)
            got = cls.prom.wait_for("sum(shardserve_coordinator_requests_total)", want)
            assert got == want, f"requests counted by the coordinator: {got}, sent {want}"
            # Rates in the dashboards need two samples after the load; a few more scrapes pass.
            time.sleep(3 * SCRAPE_INTERVAL_S)
            cls.prom.freeze(after=load_end + SCRAPE_INTERVAL_S)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.prom is not None:
            cls.prom.stop()
        if cls.cluster is not None:
            cls.cluster.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_every_request_generated_what_it_asked_for(self):
        for (prompt, n), got in zip(REQUESTS, self.results):
            self.assertEqual(len(got), n, prompt)

    def test_coordinator_counters_agree_with_what_was_sent(self):
        p = self.prom
        n = float(len(REQUESTS))
        prompt = float(sum(len(ids) for ids, _ in REQUESTS))
        generated = float(sum(k for _, k in REQUESTS))
        c = 'job="shardserve-coordinator"'
        self.assertEqual(p.scalar(f'shardserve_coordinator_requests_total{{{c},finish_reason="length",code="OK"}}'), n)
        self.assertIn("INVALID_ARGUMENT", self.bad_error)
        self.assertEqual(p.scalar(f'shardserve_coordinator_requests_total{{{c},finish_reason="rejected",'
                                  f'code="INVALID_ARGUMENT"}}'), 1)
        self.assertEqual(p.scalar(f"sum(shardserve_coordinator_requests_total{{{c}}})"), n + 1)
        self.assertEqual(p.scalar(f"shardserve_coordinator_prompt_tokens_total{{{c}}}"), prompt)
        self.assertEqual(p.scalar(f"shardserve_coordinator_generated_tokens_total{{{c}}}"), generated)
        for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
            self.assertEqual(p.scalar(f"shardserve_coordinator_{h}_count{{{c}}}"), n, h)
            self.assertEqual(p.scalar(f'shardserve_coordinator_{h}_bucket{{{c},le="+Inf"}}'), n, h)
        # One gap per token after the first.
        self.assertEqual(p.scalar(f"shardserve_coordinator_inter_token_latency_seconds_count{{{c}}}"), generated - n)
        # The pipeline saw every prompt token and every generated token but the last of each request.
        pipeline = prompt + generated - n
        self.assertEqual(p.scalar(f"sum(shardserve_coordinator_step_tokens_total{{{c}}})"), pipeline)
        self.assertEqual(p.scalar(f"sum(shardserve_coordinator_batch_tokens_sum{{{c}}})"), pipeline)
        self.assertEqual(p.scalar(f"shardserve_coordinator_workers_up{{{c}}}"), 2)
        self.assertEqual(p.scalar(f'shardserve_coordinator_workers{{{c},state="ready"}}'), 2)
        self.assertEqual(p.scalar(f"shardserve_coordinator_ready{{{c}}}"), 1)
        self.assertEqual(p.scalar(f"shardserve_coordinator_replicas_serving{{{c}}}"), 1)
        self.assertEqual(p.scalar(f"shardserve_coordinator_plans_total{{{c}}}"), 1)
        self.assertEqual(p.scalar(f'shardserve_coordinator_slots{{{c},replica="0"}}'), 4)
        self.assertEqual(p.scalar(f'shardserve_coordinator_running_sequences{{{c},replica="0"}}'), 0)
        # Every request gave its KV blocks back.
        self.assertGreater(p.scalar(f'shardserve_coordinator_kv_blocks_capacity{{{c},replica="0"}}'), 0)
        self.assertEqual(p.scalar(f'shardserve_coordinator_kv_blocks_used{{{c},replica="0"}}'), 0)

    def test_worker_counters_agree_with_what_was_sent(self):
        p = self.prom
        n = len(REQUESTS)
        pipeline = float(sum(len(ids) + k - 1 for ids, k in REQUESTS))
        w = 'job="shardserve-worker"'
        # Each stage processed every token that went through the pipeline.
        by_stage = p.query(f"sum by (stage) (shardserve_worker_step_tokens_total{{{w}}})")
        self.assertEqual({dict(k)["stage"]: v for k, v in by_stage.items()}, {"0": pipeline, "1": pipeline})
        # Top-2 routing: every token goes to two experts of each MoE layer (layers 0 and 2; layer 1 is
        # dense), summed over the experts of both ranks.
        by_layer = p.query(f"sum by (layer) (shardserve_worker_expert_tokens_total{{{w}}})")
        self.assertEqual({dict(k)["layer"]: v for k, v in by_layer.items()}, {"0": 2 * pipeline, "2": 2 * pipeline})
        # Stage 0 received one message per micro-batch from the coordinator, and sent it on.
        steps = p.scalar('sum(shardserve_coordinator_steps_total{code="OK"})')
        self.assertGreaterEqual(steps, max(k for _, k in REQUESTS))
        self.assertLessEqual(steps, sum(k for _, k in REQUESTS) + n)
        self.assertEqual(p.scalar(f'sum(shardserve_worker_step_seconds_count{{{w},stage="0"}})'), steps)
        self.assertEqual(p.scalar(f'sum(shardserve_worker_step_seconds_count{{{w},stage="1"}})'), steps)
        self.assertGreaterEqual(p.scalar(f'sum(shardserve_worker_stream_messages_total{{{w},direction="tx",'
                                         f'peer="downstream"}})'), steps)
        # Two tensor-parallel ranks per worker all-reduce; each holds weights.
        self.assertEqual(len(p.query(f'shardserve_worker_collective_seconds_count{{{w},op="all_reduce"}}')), 4)
        self.assertEqual(len(p.query(f"shardserve_worker_weight_bytes{{{w}}} > 0")), 4)
        self.assertEqual(len(p.query(f"shardserve_worker_assignment_load_seconds{{{w}}} > 0")), 2)

    def test_dashboards_use_only_exported_metrics_and_valid_queries(self):
        exported = set(self.prom.api("label/__name__/values"))
        exprs = dashboard_exprs()
        self.assertGreater(len(exprs), 20)
        used = set()
        for file, title, expr in exprs:
            for name in re.findall(r"\b(shardserve_[a-z0-9_]+)", expr):
                used.add(name)
                self.assertTrue(name in exported, f"{file}: panel '{title}' uses {name}, which no process exports")
            # Grafana's interval variables become a fixed window; the query must be valid PromQL.
            self.prom.query(expr.replace("$__rate_interval", "1m").replace("$__interval", "1m"))
        # The dashboards cover both kinds of process.
        self.assertTrue(any(u.startswith("shardserve_coordinator_") for u in used))
        self.assertTrue(any(u.startswith("shardserve_worker_") for u in used))

    def test_core_dashboard_queries_return_data(self):
        for file, title, expr in dashboard_exprs():
            if any(k in title for k in ("Time to first token", "Requests by outcome", "Step time by stage",
                                        "Collective share", "Expert load", "Workers by state",
                                        "KV cache blocks in use")):
                got = self.prom.query(expr.replace("$__rate_interval", "1m"))
                self.assertTrue(got, f"{file}: panel '{title}' shows nothing: {expr}")

    def test_one_request_can_be_followed_through_every_process(self):
        log = self.cluster.log()
        ends = re.findall(r"event=request_end request_id=(\S+) status=OK finish_reason=length", log)
        self.assertEqual(len(ends), len(REQUESTS), log[-3000:])
        rid = ends[0]
        lines = [l for l in log.splitlines() if re.search(rf"(?<![\w-]){re.escape(rid)}(?![\w-])", l)]
        self.assertTrue(any("event=request_start" in l for l in lines), lines)
        self.assertTrue(any("event=step stage=0" in l for l in lines), lines)
        self.assertTrue(any("event=step stage=1" in l for l in lines), lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: observability_test.py BIN_DIR")
    BIN = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
