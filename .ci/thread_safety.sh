#!/usr/bin/env bash
# Clang's thread-safety analysis over every C++ source of the project that is not a test (tests use
# the libraries' locks only through their public methods): each file of BUILD_DIR's
# compile_commands.json is parsed with clang++ -fsyntax-only -Wthread-safety -Werror=thread-safety
# (our GCC build cannot check ABSL_GUARDED_BY & co.). A probe with a guarded field read without its
# lock must be refused first, so a toolchain that silently checks nothing fails this stage.
# Usage: .ci/thread_safety.sh BUILD_DIR [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: thread_safety.sh BUILD_DIR [JOBS]}
jobs=${2:-$(nproc)}
python3 - "$build" "$jobs" <<'PY'
import concurrent.futures, json, os, shlex, subprocess, sys

build, jobs = sys.argv[1], int(sys.argv[2])
root = os.getcwd()
commands = json.load(open(os.path.join(build, "compile_commands.json")))
# Flags of the analysis: every other warning is GCC's business (and already an error there).
ANALYSIS = ["-fsyntax-only", "-Wno-everything", "-Wthread-safety", "-Wthread-safety-beta",
            "-Werror=thread-safety", "-Werror=thread-safety-beta"]


def clang_args(entry, source):
    args = shlex.split(entry["command"])
    # Skip a compiler launcher (e.g. ccache) and the compiler itself.
    while len(args) > 1 and os.path.basename(args[0]) in ("ccache", "sccache"):
        args = args[1:]
    args = args[1:]
    out, skip = ["clang++"], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD", entry["file"]) or a.startswith("-W") or a.startswith("-fsanitize"):
            continue
        out.append(a)
    return out + ANALYSIS + [source]


def check(entry, source=None):
    src = source or entry["file"]
    r = subprocess.run(clang_args(entry, src), cwd=entry["directory"], capture_output=True, text=True)
    return src, r.returncode, r.stderr


ours = [e for e in commands
        if e["file"].endswith(".cc") and os.path.relpath(e["file"], root).split("/")[0]
        in ("common", "worker", "coordinator", "sdk")]
if not ours:
    sys.exit(f"no project sources in {build}/compile_commands.json")

# The probe compiles with the include paths of a file that uses common/concurrency/mutex.h.
host = next(e for e in ours if e["file"].endswith("worker/service/stream_budget.cc"))
src, rc, err = check(host, os.path.join(root, "tests/layout/thread_safety_probe.cc"))
if rc == 0 or "requires holding mutex" not in err:
    sys.exit("FAIL: clang did not refuse tests/layout/thread_safety_probe.cc:\n" + err)
print("ok: the probe's unguarded read is refused:",
      next(l for l in err.splitlines() if "requires holding mutex" in l))

failed = 0
with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for src, rc, err in pool.map(check, ours):
        if rc != 0:
            failed += 1
            print(f"FAIL {os.path.relpath(src, root)}\n{err}")
print(f"thread-safety analysis: {len(ours) - failed} of {len(ours)} files clean")
sys.exit(1 if failed else 0)
PY
