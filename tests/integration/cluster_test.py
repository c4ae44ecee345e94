#!/usr/bin/env python3
"""End-to-end tests of a shardserve cluster: a coordinator and workers as separate processes on
127.0.0.1, started by shardserve-local and driven with the shardserve CLI. Every layout must give
the greedy token ids of the single-process engine (and of Hugging Face, whose ids are committed
under tests/golden)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from local_cluster import STORIES, LocalCluster  # noqa: E402

BIN = None  # directory with shardserve-local, shardserve, shardserve-run


class Cluster(LocalCluster):
    """A LocalCluster with the CLI calls these tests make."""

    def __init__(self, model, workers, devices="cpu:1", extra=(), timeout=240):
        super().__init__(BIN, model, workers, devices, extra, timeout=timeout)
        self.metrics = self.worker_metrics

    def generate(self, *args, check=True):
        return self.cli("generate", *args, check=check)

    def ids(self, prompt_ids, max_tokens, *extra):
        p = self.generate("--prompt_ids", ",".join(map(str, prompt_ids)), "--max_tokens", str(max_tokens),
                          "--print_ids", *extra)
        return [int(x) for x in p.stdout.strip().split(",") if x]

    def status(self):
        return self.cli("status", check=False, timeout=60)


def golden(name):
    return json.load(open(f"tests/golden/models/{name}/reference.json"))


def run_alone(model, prompt_ids, max_tokens, *extra):
    p = subprocess.run([os.path.join(BIN, "shardserve-run"), f"--model={model}",
                        "--prompt_ids", ",".join(map(str, prompt_ids)), "--max_tokens", str(max_tokens),
                        "--print_ids", *extra], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [int(x) for x in p.stdout.strip().split(",") if x]


def decode_steps_and_calls(metrics_url):
    """(decode steps a worker ran, micro-batches it received from the coordinator, its metrics page)."""
    page = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    steps = sum(float(l.split()[-1]) for l in page.splitlines()
                if l.startswith('shardserve_worker_step_seconds_count{phase="decode"'))
    calls = sum(float(l.split()[-1]) for l in page.splitlines()
                if l.startswith('shardserve_worker_stream_messages_total{direction="rx",peer="upstream"'))
    return steps, calls, page


def ids_at_once(cluster, calls):
    """The generated ids of every (prompt_ids, max_tokens, extra CLI args) of `calls`, each sent by
    a client thread of its own, all at once."""
    results = [None] * len(calls)

    def client(i):
        prompt, n, extra = calls[i]
        results[i] = cluster.ids(prompt, n, *extra)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def both_replicas_running(cluster, timeout=60):
    """Waits (bounded) until both replicas of `cluster` run sequences."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = urllib.request.urlopen(cluster.coordinator_metrics, timeout=10).read().decode()
        running = [float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("shardserve_coordinator_running_sequences{")]
        if len(running) == 2 and min(running) > 0:
            return
        time.sleep(0.01)


class Layouts(unittest.TestCase):
    def check_golden(self, cluster, name):
        for case in golden(name)["cases"]:
            got = cluster.ids(case["prompt_ids"], len(case["greedy_ids"]), "--ignore_eos")
            self.assertEqual(got, case["greedy_ids"], f"{name} prompt {case['prompt_ids']}")

    def test_pp2_tp2(self):
        # shardserve-local is secure by default: every link between the processes (registration,
        # coordinator -> stage 0, stage 0 -> stage 1) runs mutual TLS with its throw-away CA, and
        # the answers are exactly the single-process engine's.
        c = Cluster("tests/golden/models/llama", 2, "cpu:2", ["--pp=2", "--tp=2"])
        try:
            log = c.log()
            self.assertIn("(control port", log)
            self.assertRegex(log, r"control port 127\.0\.0\.1:\d+, TLS\)")
            self.assertEqual(log.count("(mutual TLS)"), 2, log)
            for prompt in ([1, 2, 3, 4], [5, 17, 42]):
                self.assertEqual(c.ids(prompt, 16), run_alone("tests/golden/models/llama", prompt, 16))
            self.check_golden(c, "llama")
            st = c.status()
            self.assertEqual(st.returncode, 0, st.stderr)
            # Every worker serves Prometheus metrics; stage 0 ran prefill and decode steps.
            self.assertEqual(len(c.metrics), 2)
            pages = [urllib.request.urlopen(url, timeout=10).read().decode() for url in c.metrics]
            self.assertTrue(any('shardserve_worker_step_seconds_count{phase="prefill",stage="0"}' in p for p in pages))
            self.assertTrue(any('shardserve_worker_collective_seconds_count{op="all_reduce"' in p for p in pages))
            self.assertIn("layers [0, 1)", st.stdout)
            self.assertIn("layers [1, 2)", st.stdout)
            # Each server's certificate names the address its peers dial: no TLS server logged a
            # server name that its certificate lacks.
            self.assertNotIn("No match found for server name", c.log())
            # The two workers share this machine's memory: the plan's weights and KV cache over all
            # their ranks fit in it (each worker alone would offer all that is available, and the plan
            # would count the machine twice).
            units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
            rows = re.findall(r"^\s+\d+\s+w-\S+\s+\S+\s+\[\d+, \d+\)\s+\S+\s+\S+\s+(\d+)\s+\S+\s+"
                              r"([\d.]+) ([KMGT]?B)\s+([\d.]+) ([KMGT]?B)\s", st.stdout, re.M)
            self.assertEqual(len(rows), 2, st.stdout)
            planned = sum(int(tp) * (float(w) * units[wu] + float(kv) * units[kvu]) for tp, w, wu, kv, kvu in rows)
            with open("/proc/meminfo") as f:
                total = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
            self.assertLessEqual(planned, total, st.stdout)
        finally:
            self.assertEqual(c.stop(), 0)

    def test_public_tls_and_insecure(self):
        # --public_tls: the public API serves TLS from the throw-away CA; a plaintext client gets nowhere.
        c = Cluster("tests/golden/models/llama", 1, "cpu:1", ["--public_tls", "--metrics=false"])
        try:
            self.assertIsNotNone(c.tls_ca)
            self.assertEqual(c.ids([1, 2, 3], 8), run_alone("tests/golden/models/llama", [1, 2, 3], 8))
            p = subprocess.run([os.path.join(BIN, "shardserve"), "status", f"--server={c.address}", "--timeout_s=5"],
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
        finally:
            self.assertEqual(c.stop(), 0)
        # --insecure: plaintext everywhere, same answers.
        c = Cluster("tests/golden/models/llama", 1, "cpu:1", ["--insecure", "--metrics=false"])
        try:
            self.assertIn("(plaintext)", c.log())
            self.assertEqual(c.ids([1, 2, 3], 8), run_alone("tests/golden/models/llama", [1, 2, 3], 8))
        finally:
            self.assertEqual(c.stop(), 0)

    def test_pp3_tp1_moe(self):
        c = Cluster("tests/golden/models/qwen2_moe", 3, "cpu:1", ["--pp=3", "--tp=1"])
        try:
            self.check_golden(c, "qwen2_moe")
        finally:
            c.stop()

    def test_deepseek_pp2_tp2_experts_spilled(self):
        # DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, a shared expert) as two
        # stages of 2 CPU ranks each; with 250 KB per device stage 0 (layers 0-1) keeps 4 of layer
        # 1's 8 experts (2 per rank) and the third worker computes the other 4.
        c = Cluster("tests/golden/models/deepseek_v3", 3, "cpu:2",
                    ["--pp=2", "--max_seq_len=64", "--memory_per_device=250KB"])
        try:
            st = c.status()
            self.assertEqual(st.returncode, 0, st.stderr)
            self.assertIn("layers [0, 2), 4 remote experts", st.stdout)
            self.check_golden(c, "deepseek_v3")
        finally:
            self.assertEqual(c.stop(), 0)

    def test_moe_experts_spilled_to_a_third_worker(self):
        # With 190 KB per device the two stage workers (2 CPU ranks each) cannot hold every expert:
        # the planner keeps 2 of the 8 experts of layer 2 on stage 1 (one per rank) and places the
        # other 6 on the third worker, which stage 1 calls for them at every step.
        c = Cluster("tests/golden/models/qwen2_moe", 3, "cpu:2",
                    ["--pp=2", "--max_seq_len=64", "--memory_per_device=190KB"])
        try:
            st = c.status()
            self.assertEqual(st.returncode, 0, st.stderr)
            self.assertIn("layers [1, 3), 6 remote experts", st.stdout)
            self.assertIn("experts 2:2,3,4,5,6,7", st.stdout)
            self.check_golden(c, "qwen2_moe")
            prompt = [1, 5, 9, 12, 40]
            self.assertEqual(c.ids(prompt, 24), run_alone("tests/golden/models/qwen2_moe", prompt, 24))
            # The expert host answered calls (bytes received from its callers).
            pages = [urllib.request.urlopen(url, timeout=10).read().decode() for url in c.metrics]
            host = [p for p in pages if 'peer="expert-callers"' in p]
            self.assertEqual(len(host), 1)
        finally:
            self.assertEqual(c.stop(), 0)

    def test_int8_pipeline_answers_as_one_int8_process(self):
        # --quantize=int8 reaches both stages through their assignments: a 2-stage int8 cluster
        # gives exactly the tokens of one int8 process (and the f32 tokens for the first ones).
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--quantize=int8"])
        try:
            ref = json.load(open("tests/golden/stories260K_reference.json"))
            for case in ref["cases"][:2]:
                n = len(case["greedy_ids"])
                alone = run_alone(STORIES, case["prompt_ids"], n, "--quantize=int8", "--stop_at_eos=false")
                self.assertEqual(c.ids(case["prompt_ids"], n, "--ignore_eos"), alone)
                self.assertEqual(alone[:4], case["greedy_ids"][:4])
        finally:
            self.assertEqual(c.stop(), 0)

    def test_fp8_kv_cache_pipeline_answers_as_one_fp8_kv_process(self):
        # --kv_cache_dtype=fp8 reaches both stages through their assignments (the coordinator plans
        # 1-byte elements, the workers allocate and fill FP8 caches): a 2-stage cluster gives
        # exactly the tokens of one process with an FP8 cache, and the reference's first tokens.
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--kv_cache_dtype=fp8"])
        try:
            ref = json.load(open("tests/golden/stories260K_reference.json"))
            for case in ref["cases"][:2]:
                n = len(case["greedy_ids"])
                alone = run_alone(STORIES, case["prompt_ids"], n, "--kv_cache_dtype=fp8", "--stop_at_eos=false")
                self.assertEqual(c.ids(case["prompt_ids"], n, "--ignore_eos"), alone)
                self.assertEqual(alone[:4], case["greedy_ids"][:4])
        finally:
            self.assertEqual(c.stop(), 0)

    def test_bf16_hops_keep_the_reference_tokens(self):
        # --hidden_wire_dtype=bf16 reaches the coordinator, and from it every stage: stage 0 sends 2
        # bytes per hidden value (its downstream stream bytes stay below the 4 per value that f32
        # states alone would take), the status's plan says so, and the trained stories260K still
        # continues every reference prompt with the reference's tokens.
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--hidden_wire_dtype=bf16"])
        try:
            self.assertIn("hidden states between stages: bf16", c.status().stdout)
            ref = json.load(open("tests/golden/stories260K_reference.json"))
            rows = 0
            for case in ref["cases"]:
                n = len(case["greedy_ids"])
                self.assertEqual(c.ids(case["prompt_ids"], n, "--ignore_eos"), case["greedy_ids"])
                rows += len(case["prompt_ids"]) + n - 1
            sent = 0.0
            for url in c.metrics:
                page = urllib.request.urlopen(url, timeout=10).read().decode()
                for m in re.finditer(r'^shardserve_worker_stream_bytes_total\{([^}]*)\} (\S+)$', page, re.M):
                    if 'direction="tx"' in m.group(1) and 'peer="downstream"' in m.group(1):
                        sent += float(m.group(2))
            hidden = 64
            self.assertGreater(sent, 2 * hidden * rows)
            self.assertLess(sent, 4 * hidden * rows)
        finally:
            self.assertEqual(c.stop(), 0)

    def test_two_replicas_and_stories(self):
        c = Cluster(STORIES, 2, "cpu:1", ["--replicas=2", "--pp=1"])
        try:
            ref = json.load(open("tests/golden/stories260K_reference.json"))
            for case in ref["cases"]:
                self.assertEqual(c.ids(case["prompt_ids"], len(case["greedy_ids"])), case["greedy_ids"])
            self.assertEqual(c.status().stdout.count("ready"), 3)  # cluster + 2 workers
            # --stop and --bad_words reach the server: the greedy story ends before the stop string,
            # and a banned word of it is never written.
            story_args = ["--prompt", "Once upon a time", "--max_tokens", "48"]
            story = c.generate(*story_args).stdout
            words = dict.fromkeys(w.strip(".,!?'\"") for w in story.split())
            # Words of 3+ letters whose every " word" in the story is a whole word.
            words = [w for w in words if len(w) > 2 and w.isalpha()
                     and story.count(" " + w) == len(re.findall(" " + w + r"\b", story))][:4]
            self.assertGreaterEqual(len(words), 2, story)
            cut = c.generate(*story_args, "--stop", " " + words[0])
            self.assertEqual(cut.stdout, story[:story.index(" " + words[0])] + "\n")
            self.assertIn("finish_reason: stop", cut.stderr)
            # Several stop strings as a JSON list: the story ends before the first one it reaches.
            both = [" " + words[1], " " + words[0]]
            cut_both = c.generate(*story_args, "--stop", json.dumps(both))
            self.assertEqual(cut_both.stdout, story[:min(story.index(s) for s in both)] + "\n")
            # A banned word changes the story where the model would have written it (when its tokens
            # there are the word's own spelling), never before.
            changed = 0
            for w in words:
                banned = c.generate(*story_args, "--bad_words", w).stdout
                self.assertTrue(banned.startswith(story[:story.index(" " + w)]), (w, story, banned))
                changed += banned != story
            self.assertGreater(changed, 0, (words, story))
        finally:
            c.stop()


class Load(unittest.TestCase):
    def test_32_concurrent_clients_get_their_own_tokens(self):
        prompts = [[1] + [300 + (7 * i + j) % 200 for j in range(i % 9)] for i in range(32)]
        lengths = [8 + (i * 5) % 40 for i in range(32)]
        expected = [run_alone(STORIES, p, n) for p, n in zip(prompts, lengths)]
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--max_slots=8", "--max_step_tokens=16"])
        try:
            results = [None] * 32

            def client(i):
                results[i] = c.ids(prompts[i], lengths[i])

            threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in range(32):
                self.assertEqual(results[i], expected[i], f"client {i}")

            # The load generator against the same (pipelined) cluster: every request answered in full.
            p = subprocess.run([os.path.join(BIN, "shardserve"), "bench", f"--server={c.address}", "--json",
                                "--requests=24", "--concurrency=8", "--max_tokens=8", "--prompt_tokens=4:12",
                                "--prompt_vocab=500"], capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stderr)
            summary = json.loads(p.stdout)
            self.assertEqual((summary["completed"], summary["failed"]), (24, 0), summary)
            self.assertEqual(summary["output_tokens"], 24 * 8)
            for key in ("ttft_s", "itl_s"):
                self.assertTrue(0 < summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"], summary)
            self.assertGreater(summary["output_tokens_per_s"], 0)
        finally:
            c.stop()

    def test_tiny_kv_cache_preempts_and_still_answers_exactly(self):
        # Blocks of 4 tokens, 20 per replica: one 64-token sequence needs 16, so 8 concurrent
        # clients (greedy and sampled) keep preempting each other; every answer must still be the
        # single-process one.
        prompts = [[1] + [300 + (11 * i + j) % 200 for j in range(1 + i % 7)] for i in range(8)]
        lengths = [20 + (i * 7) % 30 for i in range(8)]
        sampled = ["--temperature", "0.8", "--top_p", "0.9", "--seed", "5"]
        extras = [sampled if i % 2 else [] for i in range(8)]
        expected = [run_alone(STORIES, p, n, *e) for p, n, e in zip(prompts, lengths, extras)]
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--max_seq_len=64", "--max_slots=8", "--max_step_tokens=16",
                                          "--kv_block_size=4", "--kv_blocks=20"])
        try:
            results = ids_at_once(c, [(p, n, e) for p, n, e in zip(prompts, lengths, extras)])
            for i in range(8):
                self.assertEqual(results[i], expected[i], f"client {i}")
        finally:
            c.stop()

    def test_priority_policy_under_a_tiny_kv_cache_answers_exactly(self):
        # --scheduling_policy=priority, one stage and 64 blocks of 4 tokens, which hold one of the
        # requests (at most 206 tokens) but not two: 8 clients of three priorities (greedy and
        # sampled) queue and preempt each other in rank order; every answer must still be the
        # single-process one.
        prompts = [[1] + [300 + (13 * i + j) % 200 for j in range(1 + i % 5)] for i in range(8)]
        lengths = [160 + (i * 7) % 41 for i in range(8)]
        sampled = ["--temperature", "0.8", "--top_p", "0.9", "--seed", "9"]
        extras = [sampled if i % 2 else [] for i in range(8)]
        expected = [run_alone(STORIES, p, n, *e) for p, n, e in zip(prompts, lengths, extras)]
        c = Cluster(STORIES, 1, "cpu:1", ["--scheduling_policy=priority", "--max_seq_len=256", "--max_slots=8",
                                          "--max_step_tokens=16", "--kv_block_size=4", "--kv_blocks=64"])
        try:
            results = ids_at_once(c, [(p, n, ["--priority", str(i % 3 - 1), *e])
                                      for i, (p, n, e) in enumerate(zip(prompts, lengths, extras))])
            for i in range(8):
                self.assertEqual(results[i], expected[i], f"client {i}")
            page = urllib.request.urlopen(c.coordinator_metrics, timeout=10).read().decode()
            preempted = sum(float(l.split()[-1]) for l in page.splitlines()
                            if l.startswith("shardserve_coordinator_preemptions_total{"))
            self.assertGreater(preempted, 0, "the budget should have forced preemption")
            self.assertIn("scheduling: priority", c.cli("status").stdout.splitlines())
        finally:
            c.stop()

    def test_shared_prompt_prefix_is_reused_and_answers_stay_exact(self):
        # One request with a 41-token prompt, then 4 concurrent ones that start with the same 33
        # tokens: with blocks of 4 tokens the later ones find 32 prompt tokens in the prefix cache
        # (logged as cached_prompt_tokens) and still answer exactly as the single-process engine.
        shared = [1] + [200 + (7 * j) % 150 for j in range(32)]
        prompts = [shared + [400 + (13 * i + j) % 90 for j in range(8 - i)] for i in range(5)]
        expected = [run_alone(STORIES, p, 12) for p in prompts]
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2", "--max_seq_len=96", "--max_slots=4", "--max_step_tokens=16",
                                          "--kv_block_size=4"])
        try:
            self.assertEqual(c.ids(prompts[0], 12), expected[0])
            results = [None] * 5

            def client(i):
                results[i] = c.ids(prompts[i], 12)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(1, 5)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i in range(1, 5):
                self.assertEqual(results[i], expected[i], f"client {i}")
        finally:
            c.stop()
        cached = [int(m) for line in c.stderr for m in re.findall(r"event=request_end .* cached_prompt_tokens=(\d+)", line)]
        self.assertEqual(len(cached), 5, "".join(c.stderr[-20:]))
        self.assertEqual(sorted(cached), [0, 32, 32, 32, 32])

    def test_sampling_is_reproducible_across_layouts(self):
        args = ["--temperature", "0.8", "--top_p", "0.9", "--seed", "7"]
        expected = run_alone(STORIES, [1, 400], 40, *args)
        c = Cluster(STORIES, 2, "cpu:1", ["--pp=2"])
        try:
            self.assertEqual(c.ids([1, 400], 40, *args), expected)
        finally:
            c.stop()


    def test_multi_step_decoding_answers_as_the_engine_alone(self):
        # --decode_steps_per_call=8 on a 1-stage cluster: the worker runs up to 8 decode steps per
        # call, and greedy and seeded answers stay exactly the single-process engine's, also with
        # clients at once (batches of several sequences) and max_tokens ending inside a call.
        args = ["--temperature", "0.8", "--top_p", "0.9", "--seed", "7"]
        prompts = [[1, 400], [1, 250, 251], [1, 7, 8, 9, 10]]
        with open("tests/golden/stories260K_reference.json") as f:
            ref = json.load(f)
        c = Cluster(STORIES, 1, "cpu:1", ["--decode_steps_per_call=8"])
        try:
            for case in ref["cases"]:
                self.assertEqual(c.ids(case["prompt_ids"], len(case["greedy_ids"])), case["greedy_ids"])
            self.assertEqual(c.ids([1, 400], 40, *args), run_alone(STORIES, [1, 400], 40, *args))
            expected = [run_alone(STORIES, p, 13 + 5 * i) for i, p in enumerate(prompts)]
            results = [None] * len(prompts)

            def client(i):
                results[i] = c.ids(prompts[i], 13 + 5 * i)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(results, expected)
            # The worker ran more decode steps than the coordinator sent micro-batches.
            steps, calls, page = decode_steps_and_calls(c.metrics[0])
            self.assertGreater(steps, 2 * calls, page)
        finally:
            c.stop()

    def test_the_default_takes_several_decode_steps_per_call_for_a_small_model(self):
        # --decode_steps_per_call=0, the default: the coordinator times its calls and, for a model
        # whose decode step (~0.1 ms on a CPU) is small beside a call's serving overhead, asks for
        # several decode steps per call; `shardserve status` says how many and why, and the answers
        # stay exactly the engine's.
        with open("tests/golden/stories260K_reference.json") as f:
            ref = json.load(f)
        c = Cluster(STORIES, 1, "cpu:1")
        try:
            for case in ref["cases"]:
                self.assertEqual(c.ids(case["prompt_ids"], len(case["greedy_ids"])), case["greedy_ids"])
            self.assertEqual(c.ids([1, 400], 60), run_alone(STORIES, [1, 400], 60))
            out = c.status()
            chosen = re.search(r"^decode steps per call: replica 0: (\d+) \(auto: serving overhead [0-9.]+ ms per call "
                               r"against [0-9.]+ ms of compute per step", out.stdout, re.M)
            self.assertIsNotNone(chosen, out.stdout + out.stderr)
            self.assertGreater(int(chosen.group(1)), 1, out.stdout)
            steps, calls, page = decode_steps_and_calls(c.metrics[0])
            self.assertGreater(steps, 2 * calls, page)
        finally:
            c.stop()


class Faults(unittest.TestCase):
    def kill_while_generating(self, workers, pp, clients, n, victim):
        """Two replicas of `pp` stages on `workers` 1-rank workers; once both run sequences of the
        `clients` clients generating `n` tokens each, the worker whose pid victim(cluster) gives is
        killed (SIGKILL). The sequences it ran fail over to the other replica, every client still
        gets exactly the tokens of the single-process engine, and the cluster serves on. Returns
        the cluster's log."""
        prompts = [[1] + [250 + (17 * i + j) % 120 for j in range(2 + i % 5)] for i in range(clients)]
        expected = [run_alone(STORIES, p, n) for p in prompts]
        c = Cluster(STORIES, workers, "cpu:1", ["--replicas=2", f"--pp={pp}", "--max_seq_len=320", "--max_slots=8"])
        try:
            results = [None] * clients

            def client(i):
                results[i] = c.ids(prompts[i], n)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            both_replicas_running(c)
            os.kill(victim(c), signal.SIGKILL)
            for t in threads:
                t.join()
            for i in range(clients):
                self.assertEqual(results[i], expected[i], f"client {i}")
            self.assertEqual(c.ids(prompts[0], 8), expected[0][:8], "the cluster serves on")
        finally:
            c.stop()
        log = "".join(c.stderr)
        self.assertIn("event=failover", log)
        return log

    def test_a_killed_worker_loses_no_request(self):
        # Two replicas of one worker each, 12 clients.
        def first_worker(c):
            workers = subprocess.run(["pgrep", "-P", str(c.proc.pid), "-f", "shardserve-worker"],
                                     capture_output=True, text=True).stdout.split()
            self.assertEqual(len(workers), 2)
            return int(workers[0])

        log = self.kill_while_generating(2, 1, 12, 300, first_worker)
        self.assertIn("the coordinator serves on with the workers left", log)

    def kill_a_stage_while_generating(self, stage):
        """Two replicas of two stages, whose last stage answers the coordinator on its return
        stream (direct answers): the worker computing `stage` of one replica is killed; the steps in
        flight through it fail with UNAVAILABLE and fail over."""
        def stage_worker(c):
            victim = None
            deadline = time.time() + 60
            while victim is None and time.time() < deadline:  # until a decode step of `stage` shows
                victim = next((url for url in c.metrics
                               if f'shardserve_worker_step_seconds_count{{phase="decode",stage="{stage}"}}'
                               in urllib.request.urlopen(url, timeout=10).read().decode()), None)
            self.assertIsNotNone(victim, f"no worker ran stage {stage}")
            port = victim.split(":")[-1].split("/")[0]
            ss = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
            pid = re.search(r"pid=(\d+)", ss)
            self.assertIsNotNone(pid, ss)
            return int(pid.group(1))

        self.kill_while_generating(4, 2, 8, 200, stage_worker)

    def test_a_killed_last_stage_loses_no_request(self):
        self.kill_a_stage_while_generating("1")

    def test_a_killed_first_stage_loses_no_request(self):
        self.kill_a_stage_while_generating("0")

    def test_bad_requests_are_invalid_argument(self):
        c = Cluster("tests/golden/models/llama", 1)
        try:
            for args, message in [
                (["--prompt_ids", "1,999", "--max_tokens", "4"], "999"),
                (["--prompt_ids", "1", "--max_tokens", "0"], "max_tokens"),
                (["--prompt_ids", "1", "--temperature", "-1"], "temperature"),
                (["--prompt_ids", "1", "--top_p", "1.5"], "top_p"),
                (["--prompt_ids", ",".join(["5"] * 128), "--max_tokens", "1"], "128"),
                (["--prompt_ids", "1", "--max_tokens", "500"], "max_tokens"),
                # The default --scheduling_policy=fcfs takes no priorities.
                (["--prompt_ids", "1", "--max_tokens", "2", "--priority", "1"], "--scheduling_policy=priority"),
            ]:
                p = c.generate(*args, check=False)
                self.assertEqual(p.returncode, 1, args)
                self.assertIn("INVALID_ARGUMENT", p.stderr, args)
                self.assertIn(message, p.stderr, args)
            # The cluster still serves.
            self.assertEqual(len(c.ids([1, 2], 3)), 3)
        finally:
            c.stop()

    def test_an_address_file_that_cannot_be_written_stops_the_coordinator(self):
        # --address_file is how shardserve-local learns the ports: a coordinator that cannot write it
        # says so and exits, rather than serving on ports nobody knows.
        p = subprocess.run([os.path.join(BIN, "shardserve-coordinator"), "--listen=127.0.0.1:0",
                            "--control_listen=127.0.0.1:0", f"--model={STORIES}",
                            "--address_file=/nonexistent-dir/addresses"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("--address_file: cannot write /nonexistent-dir/addresses.tmp", p.stderr)

    def test_worker_that_cannot_load_is_reported(self):
        d = tempfile.mkdtemp()
        try:
            for f in ["config.json", "generation_config.json", "model.safetensors"]:
                shutil.copy(f"tests/golden/models/llama/{f}", d)
            with open(os.path.join(d, "model.safetensors"), "r+b") as f:
                f.truncate(5000)
            p = subprocess.run([os.path.join(BIN, "shardserve-local"), f"--model={d}", "--workers=1",
                                "--ready_timeout_s=120"], capture_output=True, text=True, timeout=200)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("failed", p.stderr)
            self.assertIn("truncated", p.stderr)
        finally:
            shutil.rmtree(d)

    def test_client_disconnect_frees_its_sequence(self):
        c = Cluster(STORIES, 1, "cpu:1", ["--max_slots=1"])
        try:
            long = subprocess.Popen([os.path.join(BIN, "shardserve"), "generate", f"--server={c.address}",
                                     "--prompt_ids", "1", "--max_tokens", "400", "--ignore_eos"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(0.5)
            long.kill()
            long.wait()
            # With one slot, this only completes if the cancelled sequence released it.
            self.assertEqual(len(c.ids([1, 2], 5)), 5)
        finally:
            c.stop()

    def test_shutdown_leaves_no_process(self):
        c = Cluster("tests/golden/models/llama", 2, "cpu:1", ["--pp=2"])
        port = c.address.split(":")[1]
        self.assertEqual(c.stop(), 0)
        time.sleep(0.5)
        p = subprocess.run(["pgrep", "-f", f"127.0.0.1:{port}"], capture_output=True, text=True)
        self.assertEqual(p.stdout.strip(), "", "processes left behind")


if __name__ == "__main__":
    BIN = sys.argv.pop(1)
    unittest.main(verbosity=2)
