#!/usr/bin/env bash
# Device time per kernel of shardserve-bench-gpu's steps, through Nsight Compute, from inside the
# bundle that tests/gpu/bundle.sh made:
#   bash profile.sh [OUT_DIR] [shardserve-bench-gpu flags...]
# OUT_DIR (default ${OUT:-.}) receives ncu.csv (every kernel launch and its
# gpu__time_duration.sum), kernels.json and kernels.txt (kernels.py's per-step summary), and
# bench.json (the benchmark's own figures from the same run; under ncu its timings are not
# meaningful, the kernel times are). Default flags: --models=llama --tokens=8 --batch=8
# --prefill=128 --copy_mib=64 (few launches: ncu serialises and replays every kernel).
set -u
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-${OUT:-.}}"
shift || true
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
say() { printf '%s\n' "$*"; }
# shellcheck source=env.sh
unset WORK  # env.sh makes a scratch folder and removes it at exit
source "$BUNDLE/env.sh"
NCU="$(command -v ncu || true)"
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
  [[ -z "$NCU" && -x "$c" ]] && NCU="$c"
done
[[ -n "$NCU" ]] || { echo "profile.sh: ncu (Nsight Compute) not found" >&2; exit 1; }
FLAGS=("$@")
((${#FLAGS[@]})) || FLAGS=(--models=llama --tokens=8 --batch=8 --prefill=128 --copy_mib=64)
say "== $NCU on shardserve-bench-gpu ${FLAGS[*]}"
(cd "$BUNDLE/root" && timeout -k 10 "${SHARDSERVE_PROFILE_TIMEOUT_S:-300}" "$NCU" --csv --page raw \
  --metrics gpu__time_duration.sum \
  "$BUNDLE/bin/shardserve-bench-gpu" --json --scratch="$WORK/models" "${FLAGS[@]}" >"$WORK/out.txt" 2>"$WORK/err.txt")
rc=$?
# ncu writes the table to stdout after the program's own output: split the two.
python3 - "$WORK/out.txt" "$DEST/bench.json" "$DEST/ncu.csv" <<'PY'
import sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
bench = [l for l in lines if l.startswith("{")]
table = [l for l in lines if l.startswith('"')]
open(sys.argv[2], "w").write((bench[-1] if bench else "{}") + "\n")
open(sys.argv[3], "w").write("\n".join(table) + "\n")
PY
grep -v '^[{"]' "$WORK/out.txt" | tail -5
tail -5 "$WORK/err.txt"
python3 "$BUNDLE/kernels.py" "$DEST/ncu.csv" --json "$DEST/kernels.json" | tee "$DEST/kernels.txt"
say "== ncu exited $rc"
exit "$rc"
