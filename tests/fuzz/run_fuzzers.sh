#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for a fixed time (default 30 s), seeded
# with the golden checkpoints' headers and configs. Exits non-zero when a fuzzer finds a crash.
#   bash tests/fuzz/run_fuzzers.sh [seconds] [build-dir]
# FUZZ_SEED (default 1) seeds libFuzzer's mutations, so that CI's short runs walk the same inputs
# each time (a gate that fails at random helps nobody); FUZZ_SEED=0 takes a random seed, for
# longer exploring runs. FUZZ_CXX_FLAGS replaces RelWithDebInfo's optimization and debug flags (CI
# passes -O2 -g1, which builds faster). An input that once crashed stays in tests/fuzz/regressions/.
set -euo pipefail
seconds=${1:-30}
build=${2:-build-fuzz}
seed=${FUZZ_SEED:-1}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${FUZZ_CXX_FLAGS:--O2 -g -DNDEBUG}" \
  -DSHARDSERVE_CUDA=OFF -DSHARDSERVE_BENCH=OFF -DSHARDSERVE_FUZZ=ON -DSHARDSERVE_SANITIZE=fuzzer >/dev/null
ninja -C "$build" safetensors_header_fuzzer model_spec_fuzzer structured_schema_fuzzer chat_template_fuzzer
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
mkdir -p "$corpus/safetensors" "$corpus/config" "$corpus/schema" "$corpus/template"
python3 - "$corpus/safetensors" <<'PY'
import glob, os, struct, sys
out = sys.argv[1]
for i, path in enumerate(sorted(glob.glob("tests/golden/models/*/*.safetensors"))):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
        data_size = os.path.getsize(path) - 8 - n
    with open(os.path.join(out, f"seed{i}"), "wb") as g:
        g.write(struct.pack("<Q", data_size) + header)
PY
i=0
for f in tests/golden/models/*/config.json ../shared/models/stories260K/config.json; do
  [ -f "$f" ] && cp "$f" "$corpus/config/seed$((i++)).json"
done
# Schemas (first byte 0: a JSON Schema) and regexes (first byte 1) from the structured-output tests.
python3 - "$corpus/schema" <<'PY'
import os, re, sys
out = sys.argv[1]
text = open("tests/coordinator/structured/test_schemas.h", encoding="utf-8").read()
for i, s in enumerate(re.findall(r'R"\((.*?)\)"', text)):
    open(os.path.join(out, f"schema{i}"), "wb").write(b"\x00" + s.encode())
for i, s in enumerate([r"\d{4}-\d{2}-\d{2}", r"(yes|no), because [a-z ]{1,30}\.", r"[^\s.]+@[a-z]+\.(com|org)"]):
    open(os.path.join(out, f"regex{i}"), "wb").write(b"\x01" + s.encode())
PY
# Chat templates: every one the Jinja tests record (model templates, the harmony style, each feature).
python3 - "$corpus/template" <<'PY'
import json, os, sys
out = sys.argv[1]
cases = json.load(open("tests/coordinator/http/jinja_golden.json", encoding="utf-8"))["cases"]
for i, t in enumerate(sorted({c["template"] for c in cases})):
    open(os.path.join(out, f"template{i}"), "wb").write(t.encode())
PY
# Inputs that once crashed a fuzzer run first, as part of the corpus.
cp tests/fuzz/regressions/structured_schema/* "$corpus/schema/"
cp tests/fuzz/regressions/chat_template/* "$corpus/template/"
# Any sanitizer report ends the run with a non-zero status (the libraries are also built with
# -fno-sanitize-recover=all; these make sure of it at run time).
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1
"$build/tests/fuzz/safetensors_header_fuzzer" -seed="$seed" -max_total_time="$seconds" -max_len=65536 "$corpus/safetensors"
"$build/tests/fuzz/model_spec_fuzzer" -seed="$seed" -max_total_time="$seconds" -max_len=16384 "$corpus/config"
"$build/tests/fuzz/structured_schema_fuzzer" -seed="$seed" -max_total_time="$seconds" -max_len=4096 -timeout=10 "$corpus/schema"
"$build/tests/fuzz/chat_template_fuzzer" -seed="$seed" -max_total_time="$seconds" -max_len=8192 -timeout=10 "$corpus/template"
echo "fuzzers: no crash in ${seconds}s each"
