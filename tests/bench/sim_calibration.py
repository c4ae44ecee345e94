#!/usr/bin/env python3
"""Calibration of `shardserve simulate` against the real local cluster (issue 24).

    python3 tests/bench/sim_calibration.py build/bin [--requests 48] [--max_tokens 64] [--repeats 1]

1. Measures "this CPU" with one BLAS thread (numpy's OpenBLAS): the read bandwidth of a
   matrix-vector product over a 256 MiB matrix (a decode step's access pattern) and the sgemm rate
   of a 64-token chunk through a 768 x 2048 matrix (a prefill chunk of the 100M model).
2. Runs tests/bench/serving_bench.py's loads on the real PP=2 cluster of the generated 100M model
   (two 1-rank CPU workers; prompt 32 tokens, --max_tokens output tokens, max_step_tokens 64,
   max_slots 16, max_seq_len 256): 1 client, and 16 clients pipelined and one micro-batch at a time.
3. Simulates the same loads with that CPU profile (`shardserve simulate`, closed loop, loopback
   network, the default fixed costs: nothing is fitted to the measurements of step 2).
4. Prints measured and predicted output tokens/s and TTFT p50/p99 and their ratios (target:
   within 15%).

Figures are only meaningful on an otherwise idle machine: a loaded machine slows the real cluster
and not the simulation.
"""
import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serving_bench  # noqa: E402  (start_cluster, bench)

MODEL = "/tmp/shardserve-100m"


def _bandwidth_worker(seconds, out):
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import numpy as np
    m = np.ones((16384, 4096), dtype=np.float32)  # 256 MiB
    v = np.ones(4096, dtype=np.float32)
    m @ v
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        m @ v
        n += 1
    out.put(n * m.nbytes / (time.perf_counter() - t0))


def _gemm_worker(seconds, out):
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import numpy as np
    # A prefill chunk of 64 tokens through an MLP-sized matrix of the 100M model.
    x = np.random.default_rng(1).standard_normal((64, 768), dtype=np.float32)
    w = np.random.default_rng(2).standard_normal((768, 2048), dtype=np.float32)
    x @ w
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ w
        n += 1
    out.put(n * 2 * 64 * 768 * 2048 / (time.perf_counter() - t0))


def measure(worker, seconds=3.0, procs=1):
    """Per-process rate with `procs` processes running at once (spawned, so that the BLAS thread
    count is set before numpy loads)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(seconds, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    rates = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join()
    return sum(rates) / len(rates)


def simulate(bin_dir, bw, flops, concurrency, requests, max_tokens, depth):
    args = [os.path.join(bin_dir, "shardserve"), "simulate", f"--model={MODEL}",
            "--workers=w*2=cpu:1x8GiB", "--pp=2", "--max_slots=16", "--max_seq_len=256", "--max_step_tokens=64",
            f"--pipeline_depth={depth}", "--network=loopback", f"--cpu_bandwidth_gbs={bw / 1e9}",
            f"--cpu_gflops={flops / 1e9}", f"--concurrency={concurrency}", f"--requests={requests}",
            "--prompt_tokens=32", f"--output_tokens={max_tokens}", "--json"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"shardserve simulate failed: {p.stderr}")
    return json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each real load; the median is used")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
        subprocess.run([os.path.join(args.bin_dir, "shardserve-bench-pipeline"), "--write_model_only",
                        f"--scratch={MODEL}"], check=True)

    bw = measure(_bandwidth_worker)
    flops = measure(_gemm_worker)
    print(f"this CPU, one core: read {bw / 1e9:.1f} GB/s, sgemm {flops / 1e9:.1f} GFLOP/s")

    loads = [("1 client, pipelined", 1, max(4, args.requests // 8), 0),
             ("16 clients, pipelined", 16, args.requests, 0),
             ("16 clients, one micro-batch", 16, args.requests, 1)]
    measured = {}
    for depth in (0, 1):
        cluster = serving_bench.start_cluster(args.bin_dir, MODEL, 64, [f"--pipeline_depth={depth}"])
        try:
            serving_bench.bench(args.bin_dir, cluster.address, 4, 4, 8, seed=1000)  # warm-up
            for name, conc, reqs, d in loads:
                if d != depth:
                    continue
                runs = sorted((serving_bench.bench(args.bin_dir, cluster.address, conc, reqs, args.max_tokens,
                                                   seed=serving_bench.next_seed()) for _ in range(args.repeats)),
                              key=lambda s: s["output_tokens_per_s"])
                measured[name] = runs[len(runs) // 2]
        finally:
            cluster.stop()

    print(f"PP=2 x 1 CPU rank, 100M f32 model, prompt 32, output {args.max_tokens}, max_step_tokens 64")
    print(f"{'':<30} {'':>9} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9}   (ms)")
    worst = 0.0
    for name, conc, reqs, depth in loads:
        m = measured[name]
        s = simulate(args.bin_dir, bw, flops, conc, reqs, args.max_tokens, depth if depth else 0)
        figs = [("tok/s", m["output_tokens_per_s"], s["output_tokens_per_s"], 1),
                ("ttft p50", m["ttft_s"]["p50"], s["ttft_s"]["p50"], 1e3),
                ("ttft p99", m["ttft_s"]["p99"], s["ttft_s"]["p99"], 1e3)]
        print(f"{name:<30} {'measured':>9} " + " ".join(f"{v * k:>9.1f}" for _, v, _, k in figs))
        print(f"{'':<30} {'simulated':>9} " + " ".join(f"{p * k:>9.1f}" for _, _, p, k in figs))
        print(f"{'':<30} {'ratio':>9} " + " ".join(f"{p / v:>9.2f}" for _, v, p, _ in figs))
        worst = max([worst] + [abs(p / v - 1) for _, v, p, _ in figs])
    print(f"largest deviation: {worst * 100:.0f}% (target <= 15%)")


if __name__ == "__main__":
    main()
