#!/usr/bin/env python3
"""Calibration of `shardserve simulate` against the real local cluster (issue 24).

    python3 tests/bench/sim_calibration.py build/bin [--requests 48] [--max_tokens 64] [--repeats 1]

1. Measures "this CPU" with the engine's own kernels (shardserve-bench-cpu-profile: the CPU
   backend's Linear on one thread over the 100M model's 768 x 2048 MLP matrix): the weight bytes
   per second of a 1-token product (a decode step's access pattern, cold weights), the FLOP/s of a
   64-token product (a prefill chunk), and the two-stage probe: the same on two threads at once,
   which gives how much more the machine reads and computes with two stages running than with one
   (its memory and compute parallelism).
2. Runs tests/bench/serving_bench.py's loads on the real PP=2 cluster of the generated 100M model
   (two 1-rank CPU workers on this machine; prompt 32 tokens, --max_tokens output tokens,
   max_step_tokens 64, max_slots 16, max_seq_len 256): 1 client, and 16 clients pipelined (the
   default policy) and one micro-batch at a time.
3. Simulates the same loads with that CPU profile (`shardserve simulate --one_machine`, closed loop,
   loopback network, the measured parallelism for the two stages sharing the machine, the default
   fixed costs: nothing is fitted to the measurements of step 2).
4. Prints measured and predicted output tokens/s and TTFT p50/p99 and their ratios (target:
   within 15%), what pipelining gains at 16 clients (pipelined over one micro-batch) measured and
   predicted, and the load average before and after.

Figures are only meaningful on an otherwise idle machine: a loaded machine slows the real cluster
and not the simulation (and skews the probe).
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serving_bench  # noqa: E402  (start_cluster, bench)

MODEL = "/tmp/shardserve-100m"


def probe(bin_dir):
    """This CPU's profile from shardserve-bench-cpu-profile (its JSON object)."""
    p = subprocess.run([os.path.join(bin_dir, "shardserve-bench-cpu-profile")], capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        sys.exit(f"shardserve-bench-cpu-profile failed: {p.stderr}")
    return json.loads(p.stdout)


def load_average():
    return os.getloadavg()[0]


def simulate(bin_dir, cpu, concurrency, requests, max_tokens, depth):
    args = [os.path.join(bin_dir, "shardserve"), "simulate", f"--model={MODEL}",
            "--workers=w*2=cpu:1x8GiB", "--one_machine", "--pp=2", "--max_slots=16", "--max_seq_len=256", "--max_step_tokens=64",
            f"--pipeline_depth={depth}", "--network=loopback", f"--cpu_bandwidth_gbs={cpu['memory_bytes_per_s'] / 1e9}",
            f"--cpu_gflops={cpu['flops_per_s'] / 1e9}", f"--cpu_memory_parallelism={cpu['memory_parallelism']}",
            f"--cpu_compute_parallelism={cpu['compute_parallelism']}", f"--concurrency={concurrency}", f"--requests={requests}",
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

    load_before = load_average()
    cpu = probe(args.bin_dir)
    print(f"load average before: {load_before:.2f}")
    print(f"this CPU, the engine's Linear on one core: read {cpu['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"{cpu['flops_per_s'] / 1e9:.1f} GFLOP/s; two stages at once: {cpu['memory_parallelism']:.2f}x the reads, "
          f"{cpu['compute_parallelism']:.2f}x the arithmetic of one")

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
    simulated = {}
    for name, conc, reqs, depth in loads:
        m = measured[name]
        s = simulated[name] = simulate(args.bin_dir, cpu, conc, reqs, args.max_tokens, depth)
        figs = [("tok/s", m["output_tokens_per_s"], s["output_tokens_per_s"], 1),
                ("ttft p50", m["ttft_s"]["p50"], s["ttft_s"]["p50"], 1e3),
                ("ttft p99", m["ttft_s"]["p99"], s["ttft_s"]["p99"], 1e3)]
        print(f"{name:<30} {'measured':>9} " + " ".join(f"{v * k:>9.1f}" for _, v, _, k in figs))
        print(f"{'':<30} {'simulated':>9} " + " ".join(f"{p * k:>9.1f}" for _, _, p, k in figs))
        print(f"{'':<30} {'ratio':>9} " + " ".join(f"{p / v:>9.2f}" for _, v, p, _ in figs))
        worst = max([worst] + [abs(p / v - 1) for _, v, p, _ in figs])
    piped, one = "16 clients, pipelined", "16 clients, one micro-batch"
    print(f"pipelined / one micro-batch at 16 clients: measured "
          f"{measured[piped]['output_tokens_per_s'] / measured[one]['output_tokens_per_s']:.2f}x, simulated "
          f"{simulated[piped]['output_tokens_per_s'] / simulated[one]['output_tokens_per_s']:.2f}x")
    print(f"largest deviation: {worst * 100:.0f}% (target <= 15%)")
    print(f"load average after: {load_average():.2f}")


if __name__ == "__main__":
    main()
