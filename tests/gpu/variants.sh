#!/usr/bin/env bash
# Runs shardserve-bench-gpu once per variant, from inside the bundle, and prints one table row each:
#   bash variants.sh [OUT_DIR] [VARIANT...]
# Variants: "spin" (the host spins in its waits for the device, as the daemons do: the decode
# figures) and "blocking" (--blocking_sync: the host sleeps in its waits, so host_cpu_ms_per_step
# is the host's own work per step), "pdl" (spin with --pdl: the decode kernels launched with
# programmatic dependent launch, off by default; see worker/kernels/cuda/pdl.cuh), "no_mma" (spin
# with prefill attention on the CUDA cores instead of the tensor cores) and "moe_host" (spin with
# MoE decode steps copying the experts' offsets to the host, op by op, as before the device path),
# "no_fused_norm" (spin with the norms as kernels of their own) and "fp8_kv" (spin with the KV
# cache in float8 e4m3: --kv_cache_dtype=fp8).
# Default: spin blocking. Each run's JSON goes to
# OUT_DIR/bench_VARIANT.json (default OUT_DIR: ${OUT:-.}). Bench flags come from
# SHARDSERVE_BENCH_FLAGS (default: --models=llama); SHARDSERVE_BENCH_BIN names another benchmark
# binary (e.g. one built from an earlier commit, for a before/after in one run).
set -u
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-${OUT:-.}}"
shift || true
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
say() { :; }
# shellcheck source=env.sh
unset WORK  # env.sh makes a scratch folder and removes it at exit
source "$BUNDLE/env.sh"
VARIANTS=("$@")
((${#VARIANTS[@]})) || VARIANTS=(spin blocking)
read -r -a FLAGS <<<"${SHARDSERVE_BENCH_FLAGS:---models=llama}"
for v in "${VARIANTS[@]}"; do
  case "$v" in
    spin) extra=() ;;
    blocking) extra=(--blocking_sync) ;;
    pdl) extra=(--pdl) ;;
    no_mma) extra=(--nomma_attention) ;;
    moe_host) extra=(--nomoe_device_offsets) ;;
    no_fused_norm) extra=(--nofused_norm) ;;
    fp8_kv) extra=(--kv_cache_dtype=fp8) ;;
    *) echo "variants.sh: unknown variant '$v' (spin, blocking, pdl, no_mma, moe_host, no_fused_norm, fp8_kv)" >&2
      exit 2 ;;
  esac
  (cd "$BUNDLE/root" && timeout -k 10 "${SHARDSERVE_VARIANT_TIMEOUT_S:-150}" \
    "${SHARDSERVE_BENCH_BIN:-$BUNDLE/bin/shardserve-bench-gpu}" --json --scratch="$WORK/models" "${FLAGS[@]}" ${extra[@]+"${extra[@]}"} \
    >"$DEST/bench_$v.json" 2>"$WORK/err_$v.txt") || { echo "$v: failed: $(tail -3 "$WORK/err_$v.txt")"; continue; }
  python3 - "$v" "$DEST/bench_$v.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
for m in r.get("models", []):
    d1, dn, p = m["decode_batch_1"], m["decode_batch_n"], m["prefill"]
    print(f"{sys.argv[1]:9s} {m['model']:6s} b1 {d1['tok_s']:8.1f} tok/s {d1['fraction_of_roofline']:.3f} roof "
          f"cpu {d1['host_cpu_ms_per_step']:.3f}/{d1['step_ms']:.3f} ms | b{dn['batch']} {dn['tok_s']:8.1f} tok/s "
          f"{dn['fraction_of_roofline']:.3f} roof | prefill {p['tok_s']:8.0f} tok/s {p['fraction_of_bf16_gemm']:.3f} gemm")
PY
done
