#!/usr/bin/env python3
"""The GPU suite's bookkeeping, for tests/gpu/run.sh (standard library only; Python 3.9+).

run.sh runs each part of the suite and records it as one small JSON file (a "part") in a parts
directory; `report` merges the parts into the suite's one report. Subcommands:

  gtest  --name N --json F --rc RC --seconds S --out PART   a GoogleTest binary's --gtest_output file
  part   --name N --status S [--seconds S] [--reason R] [--rc RC] [--log F] [--json-file F] --out PART
  bench  --json-file F --rc RC --seconds S --out PART       shardserve-bench-gpu --json's output
  cluster --bin DIR --root DIR --out PART [--timeout S]      local PP=2 cluster vs shardserve-run
  report --parts DIR --out FILE [--meta KEY=VALUE ...]       merge; exit 1 when a part failed

A part's status is one of passed, failed, skipped (with a reason) or timeout; a report is ok when
no part failed or timed out.
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

STATUSES = ("passed", "failed", "skipped", "timeout")
TIMEOUT_RCS = (124, 137)  # timeout(1): 124 on expiry, 137 after its SIGKILL


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def log_tail(path, lines=40):
    """The last `lines` lines of a log file, or None when there is none."""
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def skip_messages(log_path):
    """GTEST_SKIP() messages from a GoogleTest log (its JSON output does not carry them)."""
    out, grab = [], False
    if not log_path or not os.path.exists(log_path):
        return out
    with open(log_path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.endswith(": Skipped"):
                grab = True
            elif grab and line.startswith("["):
                grab = False
            elif grab and line.strip():
                out.append(line.strip())
    return out


def gtest_part(name, json_path, rc, seconds, log_path=None):
    """A part from a GoogleTest JSON output file (--gtest_output=json:F) and the binary's exit code.

    passed: every test ran and passed; skipped: no test failed and none ran to completion (every one
    called GTEST_SKIP, e.g. without a GPU), with the skip messages as the reason; failed: a test
    failed, the binary crashed or wrote no output; timeout: the time limit ended it.
    """
    part = {"name": name, "kind": "gtest", "rc": rc, "seconds": round(seconds, 3),
            "passed": 0, "failed": 0, "skipped": 0, "failures": []}
    doc = None
    if os.path.exists(json_path):
        try:
            with open(json_path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            part["reason"] = f"unreadable gtest output {json_path}: {e}"
    for suite in (doc or {}).get("testsuites", []):
        for case in suite.get("testsuite", []):
            full = f"{suite.get('name')}.{case.get('name')}"
            if case.get("failures"):
                part["failed"] += 1
                part["failures"].append({"test": full, "message": case["failures"][0].get("failure", "")[:2000]})
            elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                part["skipped"] += 1
            else:
                part["passed"] += 1
    if rc in TIMEOUT_RCS:
        part["status"] = "timeout"
    elif doc is None:
        part["status"] = "failed"
        part.setdefault("reason", f"no gtest output (exit code {rc})")
    elif part["failed"] or rc != 0:
        part["status"] = "failed"
        if not part["failed"]:
            part["reason"] = f"exit code {rc} with no failed test"
    elif part["passed"] == 0 and part["skipped"] > 0:
        part["status"] = "skipped"
        part["reason"] = "; ".join(sorted(set(skip_messages(log_path)))) or "every test skipped"
    else:
        part["status"] = "passed"
        if part["skipped"]:
            part["reason"] = "skipped: " + ("; ".join(sorted(set(skip_messages(log_path)))) or "?")
    return part


def bench_part(json_path, rc, seconds, name="bench"):
    """A part from a benchmark's --json stdout (shardserve-bench-gpu; shardserve-bench-pipeline for
    hop.sh): its figures, or why there are none."""
    part = {"name": name, "kind": "bench", "rc": rc, "seconds": round(seconds, 3)}
    doc = None
    try:
        with open(json_path) as f:
            text = f.read()
        start = text.find("{")
        doc = json.loads(text[start:]) if start >= 0 else None
    except (OSError, ValueError) as e:
        part["reason"] = f"no JSON from the benchmark: {e}"
    if rc in TIMEOUT_RCS:
        part["status"] = "timeout"
    elif doc is None or not isinstance(doc, dict):
        part["status"] = "failed"
        part.setdefault("reason", f"no JSON from the benchmark (exit code {rc})")
    elif "skipped" in doc:
        part["status"] = "skipped"
        part["reason"] = doc["skipped"]
    elif rc != 0 or "error" in doc:
        part["status"] = "failed"
        part["reason"] = doc.get("error", f"exit code {rc}")
    else:
        part["status"] = "passed"
    if isinstance(doc, dict):
        part["figures"] = doc
    return part


def run_ids(argv, timeout):
    """Runs a command that prints comma-separated ids; (ids or None, stderr tail)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"{os.path.basename(argv[0])}: timed out after {timeout} s"
    if p.returncode != 0:
        return None, p.stderr[-3000:]
    return [int(x) for x in p.stdout.strip().split(",") if x.strip()], p.stderr[-1000:]


def cluster_part(bin_dir, root, timeout, devices="cuda:0"):
    """Two workers sharing one GPU as two pipeline stages (shardserve-local --pp=2), one greedy
    request through the CLI, compared with shardserve-run on the same GPU and prompt, and with the
    transformers reference when the model is the golden llama."""
    t0 = time.time()
    part = {"name": "cluster", "kind": "cluster", "devices_per_worker": devices, "workers": 2, "pp": 2}
    golden = os.path.join(root, "tests/golden/models/llama")
    if os.path.exists(os.path.join(golden, "reference.json")):
        with open(os.path.join(golden, "reference.json")) as f:
            case = json.load(f)["cases"][0]
        model, prompt, reference = "tests/golden/models/llama", case["prompt_ids"], case["greedy_ids"]
    else:
        model, prompt, reference = "../shared/models/stories260K", [1, 403, 407], None
    max_tokens = len(reference) if reference else 16
    part.update(model=model, prompt_ids=prompt, max_tokens=max_tokens)
    sys.path.insert(0, os.path.join(root, "tests", "testing"))
    from local_cluster import LocalCluster  # noqa: E402  (copied into the bundle by bundle.sh)
    cwd = os.getcwd()
    os.chdir(root)
    cluster = None
    try:
        alone, err = run_ids([os.path.join(bin_dir, "shardserve-run"), f"--model={model}",
                              "--prompt_ids=" + ",".join(map(str, prompt)), f"--max_tokens={max_tokens}",
                              "--temperature=0", "--print_ids", f"--devices={devices}"], timeout / 3)
        part["run_ids"] = alone
        if alone is None:
            part.update(status="failed", reason=f"shardserve-run failed: {err}")
            return part
        try:
            # Both workers share the GPU: cap what each offers the planner and the KV cache, so that
            # the first to load does not take the memory the second needs.
            cluster = LocalCluster(bin_dir, model, workers=2, devices=devices,
                                   extra=["--pp=2", "--tp=1", "--max_seq_len=128", "--kv_blocks=64",
                                          "--memory_per_device=4GiB", "--metrics=false"],
                                   timeout=timeout / 2)
        except AssertionError as e:
            part.update(status="failed", reason=str(e)[-3000:])
            return part
        p = cluster.cli("generate", "--prompt_ids", ",".join(map(str, prompt)), "--max_tokens", str(max_tokens),
                        "--temperature", "0", "--print_ids", check=False, timeout=timeout / 3)
        if p.returncode != 0:
            part.update(status="failed", reason=f"shardserve generate failed: {p.stderr[-3000:]}",
                        log_tail=cluster.log()[-3000:])
            return part
        got = [int(x) for x in p.stdout.strip().split(",") if x.strip()]
        part["cluster_ids"] = got
        part["cluster_matches_run"] = got == alone
        if reference is not None:
            part["reference_ids"] = reference
            part["run_matches_reference"] = alone == reference
        if got != alone:
            part.update(status="failed", reason="the PP=2 cluster's greedy tokens differ from shardserve-run's")
        else:
            part["status"] = "passed"
        return part
    except subprocess.TimeoutExpired as e:
        part.update(status="timeout", reason=str(e))
        return part
    finally:
        if cluster is not None:
            part["cluster_exit"] = cluster.stop()
        os.chdir(cwd)
        part["seconds"] = round(time.time() - t0, 3)


def merge(parts_dir, meta):
    parts = []
    for name in sorted(os.listdir(parts_dir)):
        if name.endswith(".json"):
            with open(os.path.join(parts_dir, name)) as f:
                parts.append(json.load(f))
    counts = {s: 0 for s in STATUSES}
    for p in parts:
        if p.get("status") not in STATUSES:
            p["reason"] = f"unknown status {p.get('status')!r}; {p.get('reason', '')}".strip("; ")
            p["status"] = "failed"
        counts[p["status"]] += 1
    tests = {k: sum(p.get(k, 0) for p in parts if p.get("kind") == "gtest") for k in ("passed", "failed", "skipped")}
    report = {
        "suite": "shardserve-gpu",
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "parts": {p["name"]: p for p in parts},
        "summary": {"parts": counts, "gtest_cases": tests},
        "ok": counts["failed"] == 0 and counts["timeout"] == 0,
    }
    report.update(meta)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gtest")
    g.add_argument("--name", required=True)
    g.add_argument("--json", required=True)
    g.add_argument("--rc", type=int, required=True)
    g.add_argument("--seconds", type=float, default=0)
    g.add_argument("--log")
    g.add_argument("--out", required=True)
    p = sub.add_parser("part")
    p.add_argument("--name", required=True)
    p.add_argument("--status", required=True, choices=STATUSES)
    p.add_argument("--seconds", type=float, default=0)
    p.add_argument("--reason")
    p.add_argument("--rc", type=int)
    p.add_argument("--log")
    p.add_argument("--field", action="append", default=[], help="KEY=VALUE (VALUE parsed as JSON when it is)")
    p.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--name", default="bench")
    b.add_argument("--json-file", required=True)
    b.add_argument("--rc", type=int, required=True)
    b.add_argument("--seconds", type=float, default=0)
    b.add_argument("--log")
    b.add_argument("--out", required=True)
    c = sub.add_parser("cluster")
    c.add_argument("--bin", required=True)
    c.add_argument("--root", required=True)
    c.add_argument("--timeout", type=float, default=150)
    c.add_argument("--devices", default="cuda:0")
    c.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("--parts", required=True)
    r.add_argument("--meta", action="append", default=[], help="KEY=VALUE (VALUE parsed as JSON when it is)")
    r.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    def kv(items):
        out = {}
        for item in items:
            k, _, v = item.partition("=")
            try:
                out[k] = json.loads(v)
            except ValueError:
                out[k] = v
        return out

    if a.cmd == "gtest":
        part = gtest_part(a.name, a.json, a.rc, a.seconds, a.log)
    elif a.cmd == "part":
        part = {"name": a.name, "status": a.status, "seconds": round(a.seconds, 3), **kv(a.field)}
        if a.reason:
            part["reason"] = a.reason
        if a.rc is not None:
            part["rc"] = a.rc
    elif a.cmd == "bench":
        part = bench_part(a.json_file, a.rc, a.seconds, a.name)
    elif a.cmd == "cluster":
        part = cluster_part(os.path.abspath(a.bin), os.path.abspath(a.root), a.timeout, a.devices)
    else:
        report = merge(a.parts, kv(a.meta))
        write_json(a.out, report)
        return 0 if report["ok"] else 1
    if a.cmd in ("gtest", "part", "bench") and a.log and part["status"] in ("failed", "timeout"):
        part["log_tail"] = log_tail(a.log)
    write_json(a.out, part)
    counts = f" {part['passed']} passed, {part['failed']} failed, {part['skipped']} skipped" if a.cmd == "gtest" else ""
    print(f"  {part['name']}: {part['status']}{counts}" + (f" ({part['reason']})" if part.get("reason") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
