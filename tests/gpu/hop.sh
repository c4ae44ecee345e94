#!/usr/bin/env bash
# A pipeline hop against a bare gRPC round trip, measured on the GPU machine's CPU cores (16 of
# them, mostly idle: issue 23's per-hop target asks for an otherwise idle machine, and the 2-core
# development VMs halt a core that idles for milliseconds, which a hop after a stage's compute then
# pays for). From inside the bundle:
#   bash hop.sh [OUT_DIR] [shardserve-bench-pipeline flags]
# Default flags: --tokens=32 (the generated 100M model, written into a scratch folder first; pass
# --model=../shared/models/stories260K for the small one). Writes OUT_DIR/hop.json (default OUT_DIR:
# ${OUT:-.}): a report part whose "figures" are the benchmark's JSON, and prints the per-hop lines.
# Needs no GPU. Limit: SHARDSERVE_HOP_TIMEOUT_S (default 240 s). Then, where the bundle has it,
# shardserve-bench-transfer (a 32 MiB prefill micro-batch between two stages, copied vs slices, with
# the worker's allocator settings and without) into OUT_DIR/transfer.txt, 60 s at most; it does not
# change the part's status.
set -u
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-${OUT:-.}}"
shift || true
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
say() { :; }
unset WORK  # env.sh makes a scratch folder and removes it at exit
# shellcheck source=env.sh
source "$BUNDLE/env.sh"
FLAGS=("$@")
((${#FLAGS[@]})) || FLAGS=(--tokens=32)
t0=$SECONDS
(cd "$BUNDLE/root" && timeout -k 10 "${SHARDSERVE_HOP_TIMEOUT_S:-240}" "$BUNDLE/bin/shardserve-bench-pipeline" --json \
  --scratch="$WORK/100m" "${FLAGS[@]}" >"$DEST/hop_bench.json" 2>"$DEST/hop_bench.log")
rc=$?
python3 "$BUNDLE/suite.py" bench --name hop --json-file "$DEST/hop_bench.json" --rc "$rc" --seconds $((SECONDS - t0)) \
  --log "$DEST/hop_bench.log" --out "$DEST/hop.json"
python3 - "$DEST/hop.json" <<'PY'
import json, sys
part = json.load(open(sys.argv[1]))
f = part.get("figures") or {}
print(f"model {f.get('model')}, {f.get('cores')} cores, stage compute after an idle gap of {f.get('idle_gap_ms', 0):.2f} ms")
for name, t in (f.get("transports") or {}).items():
    print(f"[{name}] per hop {t['hop_us']:.1f} us = {t['hop_over_round_trip']:.2f}x the bare round trip "
          f"({t['round_trip_us']:.1f} us), {t['hop_over_round_trip_after_idle']:.2f}x the one after idling "
          f"({t['round_trip_after_idle_us']:.1f} us); through the replica client {t['replica_client_hop_relayed_us']:.1f} us "
          f"= {t['replica_client_hop_relayed_over_round_trip']:.2f}x")
print(f"hop: {part['status']}" + (f" ({part['reason']})" if part.get("reason") else ""))
sys.exit(0 if part["status"] == "passed" else 1)
PY
status=$?
if [ -x "$BUNDLE/bin/shardserve-bench-transfer" ]; then
  for keep in true false; do
    timeout -k 5 30 "$BUNDLE/bin/shardserve-bench-transfer" --keep_heap_blocks=$keep >>"$DEST/transfer.txt" 2>&1 ||
      echo "shardserve-bench-transfer --keep_heap_blocks=$keep failed" >>"$DEST/transfer.txt"
  done
  grep -E "^(micro-batch|copied|slices)" "$DEST/transfer.txt"
fi
exit $status
