#!/usr/bin/env python3
"""`shardserve plan --explain` end to end on config-only models: the table, --json, a refusal.

    python3 tests/sdk/cli_plan_explain_test.py build/bin
"""
import json
import os
import subprocess
import sys

BIN = os.path.join(sys.argv[1], "shardserve")
GPT3 = "tests/sim/models/gpt3-175b"
# Two 8-GPU nodes hold the 175B model each; the 4-GPU node does not (88.5 GB per rank > 85.9 GB),
# nor the 2 x 24 GB one.
WORKERS = "a=cuda:8x80GiB,b=cuda:8x80GiB,c=cuda:4x80GiB,d=cuda:2x24GiB"


def run(*args, ok=True):
    p = subprocess.run([BIN, "plan", *args], capture_output=True, text=True, timeout=120)
    if ok and p.returncode != 0:
        sys.exit(f"shardserve plan {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    if not ok and p.returncode == 0:
        sys.exit(f"shardserve plan {' '.join(args)} should have failed:\n{p.stdout}")
    return p


def main():
    plain = run("--model", GPT3, "--workers", WORKERS).stdout
    assert "Why this plan" not in plain, plain
    text = run("--model", GPT3, "--workers", WORKERS, "--explain").stdout
    # The plan itself comes first, unchanged.
    assert text.startswith(plain.rstrip("\n")), (plain, text)
    for want in ("Why this plan (--explain)", "search order:", "fewest pipeline stages",
                 "1. tp=2..8 pp=1 replicas=4: does not fit (no_partition_fits): worker \"d\" (tp=2, layers 0..96 + "
                 "embedding + lm_head): 175.8 GB of weights per rank > 25.8 GB free per rank",
                 "2. tp=4..8 pp=1 replicas=3: does not fit (no_partition_fits): worker \"c\" (tp=4",
                 "88.5 GB of weights per rank > 85.9 GB free per rank",
                 "3. tp=8 pp=1 replicas=2: CHOSEN",
                 "Chosen: tp=8 pp=1 replicas=2, because it is the first layout in the search order that fits"):
        assert want in text, f"{want!r} not in:\n{text}"

    j = json.loads(run("--model", GPT3, "--workers", WORKERS, "--explain", "--json").stdout)
    assert j["error"] is None and len(j["plan"]["replicas"]) == 2, j["plan"]
    layouts = j["explain"]["layouts"]
    assert [l["verdict"] for l in layouts] == ["no_partition_fits", "no_partition_fits", "chosen"], layouts
    chosen = layouts[-1]
    assert (chosen["pp"], chosen["replicas"], chosen["tp_min"]) == (1, 2, 8), chosen
    # The chosen layout's stages are the plan's: same workers, weights and KV per rank.
    plan_stages = [s for r in j["plan"]["replicas"] for s in r["stages"]]
    assert [(s["worker_id"], s["weight_bytes_per_rank"], s["kv_tokens"]) for s in chosen["stages"]] == \
        [(s["worker_id"], s["weight_bytes_per_rank"], s["kv_tokens"]) for s in plan_stages], (chosen, plan_stages)
    for s in chosen["stages"]:
        assert s["fits"] and s["weight_bytes_per_rank"] + s["kv_bytes_per_rank"] <= s["free_bytes_per_rank"], s
    # GPT-3 (hidden 12288, 96 layers, vocab 50304) at tp 8: 96 x 2 all-reduces x 2 x 7/8 x 49,152
    # bytes per rank per token; logits: 7 slices of 50304 / 8 floats; one stage, no bubble.
    assert len(j["explain"]["traffic"]) == 2, j["explain"]["traffic"]
    t = j["explain"]["traffic"][0]
    assert t["stages"] == [{"tp_all_reduce_bytes_per_token": 96 * 2 * (2 * 7 * 49152 // 8),
                            "logits_all_gather_bytes_per_token": 7 * 6288 * 4,
                            "next_stage_bytes_per_token": 0, "remote_expert_bytes_per_token": 0.0}], t
    assert t["bubble_one_micro_batch"] == 0 and t["bubble_pipelined"] == 0, t
    assert "Traffic per token (replica 0; the others alike)" in text and "16.5 MB" in text, text
    assert "Pipeline bubble: a stage idles 0% of the time" in text, text
    bad = layouts[1]["stages"][0]
    assert bad["worker_id"] == "c" and not bad["fits"] and bad["weight_bytes_per_rank"] > bad["free_bytes_per_rank"], bad

    # Nothing fits: the explanation says why, the exit status is the planner's error.
    p = run("--model", GPT3, "--workers", "a=cuda:2x80GiB,b=cuda:2x80GiB", "--explain", ok=False)
    assert "does not fit (too_little_memory)" in p.stdout and "No layout fits" in p.stdout, p.stdout
    assert "RESOURCE_EXHAUSTED" in p.stderr, p.stderr
    pj = json.loads(run("--model", GPT3, "--workers", "a=cuda:2x80GiB,b=cuda:2x80GiB", "--json", ok=False).stdout)
    assert pj["plan"] is None and "workers have" in pj["error"], pj
    # A MoE model: the layouts are listed the same way.
    m = json.loads(run("--model", "tests/sim/models/mixtral-8x22b", "--workers", "n*3=cuda:8x80GiB",
                       "--max_seq_len=4096", "--json").stdout)
    assert m["explain"]["layouts"][-1]["verdict"] == "chosen", m["explain"]["layouts"]
    # Expert spill: the layout without spill is listed first; the chosen one says how many experts left.
    sp = json.loads(run("--model", "tests/sim/models/mixtral-8x22b", "--workers",
                        "a=cuda:8x24GiB,b=cuda:8x24GiB,c=cuda:8x24GiB", "--max_seq_len=4096", "--pp=1", "--replicas=1",
                        "--json").stdout)
    ls = sp["explain"]["layouts"]
    assert [(l["expert_spill"], l["verdict"]) for l in ls] == [(False, "too_little_memory"), (True, "chosen")], ls
    st = ls[-1]["stages"][0]
    assert st["remote_experts"] > 0 and st["local_experts"] + st["remote_experts"] == 56 * 8, st
    print("ok")


if __name__ == "__main__":
    main()
