#!/usr/bin/env python3
"""Serving benchmark: a local cluster (shardserve-local, CPU ranks) under `shardserve bench` load.

    python3 tests/bench/serving_bench.py build/bin [--model DIR | --bf16] [--requests 48] [--max_tokens 64]
        [--max_step_tokens 64] [--repeats 3]

Without --model it uses the generated 100M model (written by shardserve-bench-pipeline into
/tmp/shardserve-100m). It prints, for a PP=2 cluster of two 1-rank workers:
  1. output tokens/s with 1 client and with 16 clients (target: 16 clients >= 5x one client);
  2. at 16 clients, the default pipelining (--pipeline_depth=0: the coordinator's cost-aware policy
     chooses the split per step; the line `shardserve status` gives for it is printed) against
     pipelined (--pipeline_depth=2: always 2 micro-batches) and one micro-batch at a time
     (--pipeline_depth=1) (target: the default >= the better of the two); the three clusters serve
     side by side and take turns run by run, so that a shared machine's noise weighs on all alike;
and TTFT / inter-token p50/p99 beside each, and for the 16-client loads how busy each stage was (its
compute time, from the workers' shardserve_worker_step_seconds, over the wall time);
  3. with --prefix: 16 clients whose prompts share a 192-token prefix (a system prompt) before 32
     tokens of their own, with prefix caching on and off: TTFT and throughput, and the prompt
     tokens served from the cache;
  4. with --one_stage (default model: stories260K): one client through a 1-stage cluster (one
     1-rank worker; --requests requests one after another per run, so that a run lasts ~1 s and
     not the ~0.1 s whose figures scattered from 0.50 to 0.61) against the engine alone, both from the same run: the worker's own decode step
     time (its shardserve_worker_step_seconds, phase "decode") over the client's time per output
     token (1 / its tok/s; target: >= 0.6); the rest is the serving path's own cost, split with the
     exported metrics into the coordinator's round trip of a micro-batch beyond the worker's compute
     and the coordinator's inter-token gap beyond the round trip. (The client's ITL percentiles are
     not used for the ratio: streamed tokens can arrive coalesced.) --decode_steps_per_call=K passes
     K to the cluster (multi-step decoding: the worker runs up to K decode steps per call; 0, the
     default, lets the coordinator choose, and the line `shardserve status` gives for its choice
     is printed); compare 0 (auto), 1 and 8 in interleaved runs.
  5. with --step_deltas (default model: stories260K, whose compute is small beside the serving
     path): 16 and 64 clients through a PP=2 cluster with step deltas on and off (--step_deltas of
     shardserve-local), taking turns: tokens/s, and the bytes per micro-batch on the coordinator's
     stream to stage 0 and on the hop to stage 1 (the workers' shardserve_worker_stream_bytes_total
     over their messages, upstream rx).
Figures are only meaningful on an otherwise idle machine.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from local_cluster import STORIES, LocalCluster  # noqa: E402


def start_cluster(bin_dir, model, max_step_tokens, extra):
    """A PP=2 cluster of two 1-rank workers (tests/testing/local_cluster.py)."""
    return LocalCluster(bin_dir, model, 2, "cpu:1",
                        ["--pp=2", "--max_slots=16", "--max_seq_len=256", f"--max_step_tokens={max_step_tokens}",
                         *extra], timeout=300)


def bench(bin_dir, address, concurrency, requests, max_tokens, shared_prefix=0, seed=1, vocab=32000):
    """One `shardserve bench` run; each seed draws other prompts (so that a run does not find the
    prompts of an earlier one in the prefix cache)."""
    p = subprocess.run(
        [os.path.join(bin_dir, "shardserve"), "bench", f"--server={address}", "--json",
         f"--concurrency={concurrency}", f"--requests={requests}", f"--max_tokens={max_tokens}",
         "--prompt_tokens=32", f"--prompt_vocab={vocab}", f"--shared_prefix_tokens={shared_prefix}", f"--seed={seed}"],
        capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"shardserve bench failed: {p.stderr}")
    s = json.loads(p.stdout)
    if s["failed"]:
        sys.exit(f"{s['failed']} requests failed: {s['failed_by_code']}")
    return s


def step_seconds(url):
    """Sum of a worker's shardserve_worker_step_seconds histogram."""
    total = 0.0
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("shardserve_worker_step_seconds_sum"):
            total += float(line.split()[-1])
    return total


def decode_steps(url):
    """(seconds, steps) of a worker's decode micro-batches (shardserve_worker_step_seconds)."""
    seconds = steps = 0.0
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if 'phase="decode"' not in line:
            continue
        if line.startswith("shardserve_worker_step_seconds_sum"):
            seconds += float(line.split()[-1])
        elif line.startswith("shardserve_worker_step_seconds_count"):
            steps += float(line.split()[-1])
    return seconds, steps


def sums(url, names):
    """{name: (sum, count)} of the histograms `names` on a metrics page, over all their labels."""
    out = {n: [0.0, 0.0] for n in names}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        for n in names:
            for suffix, i in (("_sum", 0), ("_count", 1)):
                if line.startswith(n + suffix):
                    out[n][i] += float(line.split()[-1])
    return out


COORD = ("shardserve_coordinator_step_seconds", "shardserve_coordinator_inter_token_latency_seconds")
WORKER = ("shardserve_worker_step_seconds",)


def row(name, s, width=34):
    print(f"{name:<{width}} {s['output_tokens_per_s']:>10.1f} {s['ttft_s']['p50'] * 1e3:>10.1f} "
          f"{s['ttft_s']['p99'] * 1e3:>10.1f} {s['itl_s']['p50'] * 1e3:>10.2f} {s['itl_s']['p99'] * 1e3:>10.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--model", default="")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--max_step_tokens", type=int, default=64,
                    help="tokens per micro-batch (chunked prefill); with CPU ranks a small budget keeps a "
                         "burst of prompts from stalling everyone's decode (ITL p99) and keeps the "
                         "pipeline's fill short; the cluster's default is 256")
    ap.add_argument("--bf16", action="store_true",
                    help="the generated 100M model with BF16 weights (kept bf16 by the CPU backend)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each load; the run with the median throughput is reported")
    ap.add_argument("--prefix", action="store_true",
                    help="only the shared-prefix comparison (prefix caching on vs off)")
    ap.add_argument("--decode_steps_per_call", type=int, default=0,
                    help="with --one_stage: shardserve-local's --decode_steps_per_call (multi-step decoding: "
                         "decode steps the worker runs per call; 0 = auto, the cluster's default)")
    ap.add_argument("--overlap_decode_calls", choices=["true", "false"], default="true",
                    help="with --one_stage: shardserve-local's --overlap_decode_calls (the next call of a decode "
                         "batch goes while the last one runs; the cluster's default is true)")
    ap.add_argument("--stage_inline_us", type=int, default=-1,
                    help="with --one_stage: shardserve-local's --stage_inline_us (micro-batches whose stage's last "
                         "step took at most this long run on the gRPC thread that read them; 0 = never; "
                         "default: the cluster's)")
    ap.add_argument("--one_stage", action="store_true",
                    help="only one client through a 1-stage cluster vs the engine alone (default model stories260K)")
    ap.add_argument("--step_deltas", action="store_true",
                    help="only 16 and 64 clients at PP=2 with step deltas on and off (default model stories260K)")
    args = ap.parse_args()
    if args.step_deltas:
        step_deltas(args, args.model or STORIES)
        return
    if args.one_stage:
        one_stage(args, args.model or STORIES)
        return
    model = args.model
    if not model:
        model = "/tmp/shardserve-100m-bf16" if args.bf16 else "/tmp/shardserve-100m"
        if not os.path.exists(os.path.join(model, "model.safetensors")):
            subprocess.run([os.path.join(args.bin_dir, "shardserve-bench-pipeline"), "--write_model_only",
                            f"--scratch={model}"] + (["--bf16"] if args.bf16 else []), check=True)

    if args.prefix:
        prefix_comparison(args, model)
        return
    results = {}
    busy = {}
    names = {0: "default (auto)", 1: "one micro-batch at a time", 2: "pipelined (depth 2)"}
    explanation = ""
    # The three clusters serve side by side and take turns, run by run, so that the load other
    # processes put on a shared machine weighs on all three alike.
    clusters = {}
    try:
        for depth in names:
            clusters[depth] = start_cluster(args.bin_dir, model, args.max_step_tokens, [f"--pipeline_depth={depth}"])
            bench(args.bin_dir, clusters[depth].address, 4, 4, 8, seed=next_seed())  # warm-up
        runs = sorted((bench(args.bin_dir, clusters[0].address, 1, max(4, args.requests // 8), args.max_tokens,
                             seed=next_seed()) for _ in range(args.repeats)), key=lambda s: s["output_tokens_per_s"])
        results["1 client, default"] = runs[len(runs) // 2]
        runs = {depth: [] for depth in names}
        seconds = {depth: [0.0] * len(clusters[depth].worker_metrics) for depth in names}
        wall = {depth: 0.0 for depth in names}
        for i in range(args.repeats):
            for depth in names:
                address, metrics = clusters[depth].address, clusters[depth].worker_metrics
                # The default's split as `shardserve status` explains it, asked while the 16 clients run.
                status = []
                probe = threading.Timer(2.0, lambda a=address: status.append(pipelining_status(args.bin_dir, a)))
                if depth == 0 and i == 0:
                    probe.start()
                before = [step_seconds(u) for u in metrics]
                t0 = time.time()
                runs[depth].append(bench(args.bin_dir, address, 16, args.requests, args.max_tokens, seed=next_seed()))
                wall[depth] += time.time() - t0
                seconds[depth] = [x + step_seconds(u) - b for x, u, b in zip(seconds[depth], metrics, before)]
                if depth == 0 and i == 0:
                    probe.join()
                    explanation = status[0] if status else "(no answer)"
        for depth, name in names.items():
            ordered = sorted(runs[depth], key=lambda s: s["output_tokens_per_s"])
            results["16 clients, " + name] = ordered[len(ordered) // 2]
            busy["16 clients, " + name] = [x / wall[depth] for x in seconds[depth]]
    finally:
        for cluster in clusters.values():
            cluster.stop()

    print(f"PP=2 x 1 CPU rank, prompt 32 tokens, {args.max_tokens} output tokens, max_step_tokens "
          f"{args.max_step_tokens}, median of {args.repeats} runs, model {model}")
    print(f"{'':<40} {'tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>10} {'ITL p99':>10}   (ms)")
    for name, s in results.items():
        row(name, s, 40)
    for name, b in busy.items():
        print(f"{name}: stages busy {', '.join(f'{x:.2f}' for x in b)} of the time")
    print(f"default, as `shardserve status` explains it 2 s into its first 16-client run:\n  {explanation}")
    one = results["1 client, default"]["output_tokens_per_s"]
    auto = results["16 clients, " + names[0]]["output_tokens_per_s"]
    flat = results["16 clients, " + names[1]]["output_tokens_per_s"]
    piped = results["16 clients, " + names[2]]["output_tokens_per_s"]
    print(f"16 clients / 1 client (default):          {auto / one:.2f}x (target >= 5)")
    print(f"default / better of depth 1 and 2 (16):   {auto / max(flat, piped):.2f}x (target >= 1.0)")
    print(f"pipelined / one micro-batch (16):         {piped / flat:.2f}x")


def pipelining_status(bin_dir, address, prefix="pipelining:"):
    """The lines of `shardserve status` that start with `prefix`."""
    p = subprocess.run([os.path.join(bin_dir, "shardserve"), "status", f"--server={address}"],
                       capture_output=True, text=True, timeout=60)
    lines = [line for line in p.stdout.splitlines() if line.startswith(prefix)]
    return "\n  ".join(lines) if lines else f"(no {prefix} line; status said: {p.stdout} {p.stderr})"


def stream_counters(url):
    """(bytes, messages) a worker read from its upstream hop (shardserve_worker_stream_*_total)."""
    got = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if 'direction="rx"' in line and 'peer="upstream"' in line:
            got[line.split("{")[0]] = float(line.split()[-1])
    return (got.get("shardserve_worker_stream_bytes_total", 0.0),
            got.get("shardserve_worker_stream_messages_total", 0.0))


def step_deltas(args, model):
    """Step deltas on and off, side by side, 16 and 64 clients (see the module's doc)."""
    clusters = {}
    try:
        for on in (True, False):
            clusters[on] = LocalCluster(args.bin_dir, model, 2, "cpu:1",
                                        ["--pp=2", "--max_slots=64", "--max_seq_len=256",
                                         f"--max_step_tokens={args.max_step_tokens}",
                                         f"--step_deltas={'true' if on else 'false'}"], timeout=300)
        print(f"{'clients':>7} {'deltas':>6} {'tok/s':>10} {'B/step to stage 0':>18} {'B/step to stage 1':>18}")
        for clients in (16, 64):
            runs = {True: [], False: []}
            for r in range(args.repeats):
                for on in ((True, False) if r % 2 == 0 else (False, True)):  # either goes first as often
                    c = clusters[on]
                    before = [stream_counters(u) for u in c.worker_metrics]
                    s = bench(args.bin_dir, c.address, clients, max(args.requests, 2 * clients), args.max_tokens,
                              seed=100 * clients + r, vocab=512)
                    after = [stream_counters(u) for u in c.worker_metrics]
                    per = sorted(((a[0] - b[0]) / max(a[1] - b[1], 1) for a, b in zip(after, before)))
                    runs[on].append((s["output_tokens_per_s"], per))
            for on in (True, False):
                tps = sorted(t for t, _ in runs[on])[len(runs[on]) // 2]
                per = runs[on][-1][1]  # the smaller figure is stage 0's (no hidden states)
                print(f"{clients:>7} {'on' if on else 'off':>6} {tps:>10.1f} {per[0]:>18.0f} {per[-1]:>18.0f}   runs: "
                      + " ".join(f"{t:.0f}" for t, _ in runs[on]))
    finally:
        for c in clusters.values():
            c.stop()


def one_stage(args, model):
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cluster = LocalCluster(args.bin_dir, model, 1, "cpu:1",
                           ["--max_seq_len=256", f"--decode_steps_per_call={args.decode_steps_per_call}",
                            f"--overlap_decode_calls={args.overlap_decode_calls}",
                            *([f"--stage_inline_us={args.stage_inline_us}"] if args.stage_inline_us >= 0 else [])],
                           timeout=300)
    try:
        bench(args.bin_dir, cluster.address, 1, 2, 8, seed=next_seed(), vocab=vocab)  # warm-up
        runs = []
        for _ in range(args.repeats):
            s0, n0 = decode_steps(cluster.worker_metrics[0])
            c0, w0 = sums(cluster.coordinator_metrics, COORD), sums(cluster.worker_metrics[0], WORKER)
            s = bench(args.bin_dir, cluster.address, 1, args.requests, args.max_tokens, seed=next_seed(), vocab=vocab)
            s1, n1 = decode_steps(cluster.worker_metrics[0])
            c1, w1 = sums(cluster.coordinator_metrics, COORD), sums(cluster.worker_metrics[0], WORKER)
            s["engine_step_s"] = (s1 - s0) / max(1.0, n1 - n0)
            # Per micro-batch (all phases): the worker's compute, the coordinator's round trip of it,
            # and per token the coordinator's inter-token gap.
            d = {n: ((c1 | w1)[n][0] - (c0 | w0)[n][0], (c1 | w1)[n][1] - (c0 | w0)[n][1]) for n in COORD + WORKER}
            # Per coordinator call: with --decode_steps_per_call > 1 one call runs several of the
            # worker's decode steps (its metric records each step), so the worker's time is summed per call.
            calls = max(1.0, d[COORD[0]][1])
            s["worker_step_s"] = d[WORKER[0]][0] / calls
            s["steps_per_call"] = d[WORKER[0]][1] / calls
            s["coord_step_s"] = d[COORD[0]][0] / calls
            s["coord_itl_s"] = d[COORD[1]][0] / max(1.0, d[COORD[1]][1])
            runs.append(s)
        runs.sort(key=lambda s: s["output_tokens_per_s"])
        s = runs[len(runs) // 2]
        # The replica's choice as `shardserve status` explains it, after the runs.
        choice = pipelining_status(args.bin_dir, cluster.address, "decode steps per call:")
    finally:
        cluster.stop()
    engine = s["engine_step_s"]
    print(f"1 client, 1 stage x 1 CPU rank, prompt 32 tokens, {args.max_tokens} output tokens, median of "
          f"{args.repeats} runs, model {model}, --decode_steps_per_call={args.decode_steps_per_call}, "
          f"--overlap_decode_calls={args.overlap_decode_calls}")
    print(f"{'':<34} {'tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>10} {'ITL p99':>10}   (ms)")
    row("1 client, 1 stage", s)
    served = 1 / s["output_tokens_per_s"]
    print(f"engine alone (the worker's decode step): {engine * 1e3:.3f} ms = {1 / engine:.0f} tok/s; served: "
          f"{served * 1e3:.3f} ms per output token (TTFT included)")
    print(f"served / engine alone (tok/s): {engine / served:.2f} (target >= 0.6)")
    print(f"`shardserve status` after the runs: {choice}")
    # Where a token's time goes, from the metrics the processes export (means over the run).
    w, c, g, k = s["worker_step_s"], s["coord_step_s"], s["coord_itl_s"], s["steps_per_call"]
    print(f"per micro-batch (a call of {k:.2f} decode steps on average): worker compute {w * 1e3:.3f} ms, "
          f"coordinator <-> worker round trip beyond it {(c - w) * 1e3:.3f} ms; per token: coordinator's inter-token "
          f"gap {g * 1e3:.3f} ms, of which outside the call's share {(g - c / max(1.0, k)) * 1e3:.3f} ms "
          f"(scheduling, delivery); the client's mean gap {s['itl_s']['mean'] * 1e3:.3f} ms")


SEEDS = iter(range(1, 1 << 30))


def next_seed():
    return next(SEEDS)


def prefix_comparison(args, model):
    shared = 192
    results = {}
    for caching in ("true", "false"):
        cluster = start_cluster(args.bin_dir, model, args.max_step_tokens, [f"--prefix_caching={caching}"])
        address = cluster.address
        try:
            # Every run shares the same prefix (as a system prompt); the warm-up puts it in the cache,
            # as the first user of a system prompt would. Each run's own tokens are new.
            bench(args.bin_dir, address, 1, 1, 4, shared, seed=next_seed())
            runs = sorted((bench(args.bin_dir, address, 16, args.requests, args.max_tokens, shared, next_seed())
                           for _ in range(args.repeats)), key=lambda s: s["output_tokens_per_s"])
            results[caching] = runs[len(runs) // 2]
        finally:
            cluster.stop()
    print(f"PP=2 x 1 CPU rank, 16 clients, prompts of {shared} shared + 32 own tokens, {args.max_tokens} output "
          f"tokens, max_step_tokens {args.max_step_tokens}, median of {args.repeats} runs, model {model}")
    print(f"{'':<34} {'tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>10} {'ITL p99':>10}   (ms)")
    for caching, s in results.items():
        row(f"prefix caching {'on' if caching == 'true' else 'off'}", s)
        print(f"{'':<34} prompt tokens {s['prompt_tokens']}, from the cache {s['cached_prompt_tokens']} "
              f"({s['cached_prompt_tokens'] / max(1, s['prompt_tokens']):.0%})")
    on, off = results["true"], results["false"]
    print(f"caching on / off: throughput {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x, "
          f"TTFT p50 {off['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}x lower")


if __name__ == "__main__":
    main()
