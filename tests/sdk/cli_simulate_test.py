#!/usr/bin/env python3
"""`shardserve simulate` end to end: the table, --json, --fail, --trace, --sweep and the errors.

    python3 tests/sdk/cli_simulate_test.py build/bin
"""
import json
import os
import subprocess
import sys
import tempfile

BIN = os.path.join(sys.argv[1], "shardserve")
MIXTRAL = "tests/sim/models/mixtral-8x22b"


def run(*args, ok=True):
    p = subprocess.run([BIN, "simulate", *args], capture_output=True, text=True, timeout=300)
    if ok and p.returncode != 0:
        sys.exit(f"shardserve simulate {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    if not ok and p.returncode == 0:
        sys.exit(f"shardserve simulate {' '.join(args)} should have failed:\n{p.stdout}")
    return p


def main():
    base = ["--model", MIXTRAL, "--workers", "n*3=cuda:8x80GiB", "--max_seq_len=4096",
            "--prompt_tokens=256:512", "--output_tokens=64:128"]
    # A table, then the same run as JSON.
    table = run(*base, "--rate=20", "--duration_s=10").stdout
    for want in ("layout: tp=8 pp=1 replicas=3", "throughput:", "ttft", "KV use:"):
        assert want in table, f"{want!r} not in the table:\n{table}"
    r = json.loads(run(*base, "--rate=20", "--duration_s=10", "--json").stdout)
    assert r["layout"] == "tp=8 pp=1 replicas=3", r["layout"]
    assert r["completed"] == r["requests"] > 100, r
    assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"], r["ttft_s"]
    assert r["output_tokens_per_s"] > 0 and r["kv_use"]["peak"] > 0
    # A fault: replica 1 goes, its sequences fail over, a re-plan of the survivors is reported.
    f = json.loads(run(*base, "--rate=20", "--duration_s=10", "--fail=n-1@5", "--json").stdout)
    assert len(f["faults"]) == 1 and f["faults"][0]["replicas_removed"] == [1], f["faults"]
    assert f["faults"][0]["replan"] == "tp=8 pp=1 replicas=2", f["faults"][0]["replan"]
    assert f["failed"] == 0 and f["completed"] == f["requests"], f
    # A trace.
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as t:
        t.write("# arrival prompt output\n0 100 10\n0.5 200 20\n1.0 300 30\n")
    tr = json.loads(run(*base, f"--trace={t.name}", "--json").stdout)
    os.unlink(t.name)
    assert tr["requests"] == 3 and tr["completed"] == 3, tr
    # A sweep finds the cheapest layout that meets the SLO.
    s = json.loads(run(*base, "--rate=20", "--duration_s=10", "--sweep", "--slo=ttft_p99=1s", "--max_pp=1",
                       "--json").stdout)
    assert s["best"] is not None and s["tried"], s
    best = min((c for c in s["tried"] if c["meets"]), key=lambda c: (c["workers"], c["devices"]))
    assert s["best"]["layout"] == f"tp={best['tp']} pp={best['pp']} replicas={best['replicas']}", (s["best"]["layout"], best)
    # Closed loop: 4 clients, 40 requests.
    c = json.loads(run(*base, "--concurrency=4", "--requests=40", "--json").stdout)
    assert c["requests"] == 40 and c["completed"] == 40, c
    # Errors name the flag.
    for args, want in ((["--rate=0"], "--rate (open loop), --trace"), (["--rate=1", "--gpu=v100"], "unknown GPU profile"),
                       (["--rate=1", "--fail=n-1"], "WORKER@SECONDS"), (["--rate=1", "--sweep", "--slo=x=1"], "--slo")):
        p = run(*base, *args, ok=False)
        assert want in p.stderr, f"{want!r} not in: {p.stderr}"
    print("cli_simulate_test: OK")


if __name__ == "__main__":
    main()
