"""Coordinator restart to first answer, on a model whose load takes noticeable time.

    restart_bench.py BIN_DIR [--model DIR] [--restarts N] [--downtime S]

Starts a coordinator and two CPU workers (two pipeline stages) as separate processes, waits for the
first answer, then N times kills the coordinator (SIGKILL), waits --downtime seconds, starts it again
and times how long after its start the first request is answered. Without --model it uses the
generated 100M model (ARCHITECTURE.md "Benchmarks"), written by shardserve-bench-pipeline
--write_model_only into /tmp/shardserve-100m when it is not there. Prints each time, their median,
and how many times each worker loaded weights (its log's "loaded in" lines). Run it with the binaries
of two builds to compare them (the figures of README "Coordinator restarts" came from it).
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_port  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--model", default="")
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--downtime", type=float, default=2.0)
    ap.add_argument("--limit_s", type=float, default=300.0, help="give up on an answer after this long")
    args = ap.parse_args()
    model = args.model or "/tmp/shardserve-100m"
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        subprocess.run([os.path.join(args.bin_dir, "shardserve-bench-pipeline"), "--write_model_only",
                        f"--scratch={model}"], check=True)
    tmp = tempfile.mkdtemp(prefix="shardserve-restart-bench-")
    api, control = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = []

    def start_coordinator(run):
        return subprocess.Popen(
            [os.path.join(args.bin_dir, "shardserve-coordinator"), f"--listen={api}", f"--control_listen={control}",
             f"--model={model}", "--expected_workers=2", "--pp=2", "--tp=1", "--replicas=1", "--max_seq_len=256",
             "--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=2000"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"coordinator-{run}.log"), "w"))

    def answer_after(since):
        while time.time() - since < args.limit_s:
            p = subprocess.run([os.path.join(args.bin_dir, "shardserve"), "generate", f"--server={api}",
                                "--prompt_ids", "1,2,3,4", "--max_tokens", "4", "--print_ids"],
                               capture_output=True, text=True, timeout=120)
            if p.returncode == 0:
                return time.time() - since
            time.sleep(0.1)
        raise SystemExit(f"no answer {args.limit_s} s after the start; logs in {tmp}")

    try:
        coordinator = start_coordinator(0)
        for i in range(2):
            procs.append(subprocess.Popen(
                [os.path.join(args.bin_dir, "shardserve-worker"), f"--coordinator={control}",
                 "--listen=127.0.0.1:0", "--devices=cpu:1", f"--node_name=node-{i}"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"worker-{i}.log"), "w")))
        print(f"first start: answered after {answer_after(time.time()):.1f} s")
        times = []
        for run in range(1, args.restarts + 1):
            coordinator.send_signal(signal.SIGKILL)
            coordinator.wait()
            time.sleep(args.downtime)
            started = time.time()
            coordinator = start_coordinator(run)
            times.append(answer_after(started))
            print(f"restart {run} (down {args.downtime} s): answered {times[-1]:.2f} s after the start", flush=True)
        loads = []
        for i in range(2):
            with open(os.path.join(tmp, f"worker-{i}.log")) as f:
                loads.append(sum(1 for line in f if "loaded in" in line))
        print(f"model {model}: restart to first answer median {statistics.median(times):.2f} s "
              f"(min {min(times):.2f}, max {max(times):.2f}) over {len(times)} restarts; "
              f"weight loads per worker {loads}")
    finally:
        for p in procs + [coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
