#!/usr/bin/env python3
"""Checks the dependency rules of ARCHITECTURE.md / STYLE.md on every source file:
which folder may include which, where CUDA/NCCL headers may appear, flags only in *_main.cc,
no getenv in library code, production code never includes tests/. Exits 1 listing violations."""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+([<"])([^>"]+)[>"]', re.M)
BACKEND_HEADERS = ("cuda_runtime.h", "cuda.h", "cublas_v2.h", "cublasLt.h", "nccl.h", "cuda_fp16.h", "cuda_bf16.h")


def ours(path):
    return path.split("/")[0] in ("common", "worker", "coordinator", "sdk", "proto", "tests", "shardserve")


def rules(src, inc):
    """Returns a violation message, or None."""
    top = src.split("/")[0]
    if inc.startswith("tests/") and top != "tests":
        return "production code includes tests/"
    if top == "common" and ours(inc) and not inc.startswith("common/") and not inc.startswith("shardserve/v1/"):
        return "common/ may include only common/ (and generated proto code)"
    if top == "common" and (inc.startswith("grpcpp/") or inc.startswith("grpc/")) and not (
            src.startswith("common/status/grpc_") or src.startswith("common/security/grpc_security.")
            or src.startswith("common/rpc/")):
        return "common/ uses gRPC only in status/grpc_*, security/grpc_security and rpc/ (shared client transports)"
    if src.startswith("sdk/cpp/") and ours(inc) and not inc.startswith("shardserve/"):
        return "the C++ client library (sdk/cpp) depends on the generated protocol code only"
    # The CLI's offline commands may also use the simulator (coordinator/sim: the planner and the
    # scheduler on virtual time, no gRPC) for `shardserve simulate`.
    offline = inc.startswith("coordinator/planner/") or (src.startswith("sdk/cli/") and inc.startswith("coordinator/sim/"))
    if src.startswith("sdk/") and (inc.startswith("worker/") or (inc.startswith("coordinator/") and not offline)):
        return "sdk/ may use proto, common/ and the pure planner only (the CLI also the simulator)"
    if top == "worker" and inc.startswith("coordinator/"):
        return "worker/ never includes coordinator/"
    if top == "coordinator" and inc.startswith("worker/"):
        return "coordinator/ never includes worker/"
    if (src.startswith("worker/kernels/shared/") and ours(inc) and not inc.startswith("common/tensor/")
            and not inc.startswith("worker/kernels/shared/")):
        return "kernels/shared may include only common/tensor (and itself)"
    if (inc.startswith("worker/kernels/cpu/") or inc.startswith("worker/kernels/cuda/")) and top != "tests":
        same = src.startswith(os.path.dirname(inc) + "/")
        if not same and src != "worker/kernels/registry.cc":
            return "only worker/kernels/registry.cc reaches a backend implementation"
    if (inc.startswith("worker/comm/host/") or inc.startswith("worker/comm/nccl/")) and top != "tests":
        same = src.startswith(os.path.dirname(inc) + "/")
        if not same and src != "worker/comm/comm_registry.cc":
            return "only worker/comm/comm_registry.cc reaches a communicator implementation"
    if os.path.basename(inc) in BACKEND_HEADERS:
        if not (src.startswith("worker/kernels/cuda/") or src.startswith("worker/comm/nccl/")):
            return "CUDA/NCCL headers only in worker/kernels/cuda and worker/comm/nccl"
    return None


def main():
    violations = []
    for top in ("common", "worker", "coordinator", "sdk", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                text = open(path, encoding="utf-8", errors="replace").read()
                for _, inc in INCLUDE.findall(text):
                    msg = rules(rel, inc)
                    if msg:
                        violations.append(f"{rel}: #include {inc}: {msg}")
                library = not rel.startswith("tests/") and not name.endswith("_main.cc")
                if library and re.search(r"\bABSL_FLAG\s*\(", text):
                    violations.append(f"{rel}: ABSL_FLAG outside a *_main.cc file")
                if library and re.search(r"\b(std::)?getenv\s*\(", text):
                    violations.append(f"{rel}: getenv in library code (configuration comes in through flags)")
    for v in violations:
        print(v)
    print(f"layout: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
