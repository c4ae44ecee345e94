#!/usr/bin/env bash
# The main job on one machine: install dependencies, build, start a local cluster (a coordinator
# and two workers as separate processes on 127.0.0.1, the model split into two pipeline stages),
# send it a request with the shardserve CLI, print the answer, and stop the cluster.
#
# It serves the trained stories260K model from ../shared/models when it is beside the repository,
# otherwise the tiny random-weight Llama the project ships under tests/golden (whose output is the
# token ids of random weights: it shows the cluster working, not a story).
#   bash deploy/local/demo.sh ["PROMPT"]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build bin/shardserve-local bin/shardserve bin/shardserve-worker bin/shardserve-coordinator

model=../shared/models/stories260K
request=(--prompt "${1:-Once upon a time}" --max_tokens 96 --temperature 0)
if [ ! -f "$model/model.safetensors" ]; then
  model=tests/golden/models/llama
  request=(--prompt_ids 1,5,9 --max_tokens 16 --temperature 0 --print_ids)
fi

log=$(mktemp)
./build/bin/shardserve-local --model="$model" --workers=2 --devices_per_worker=cpu:1 --pp=2 >"$log" 2>&1 &
launcher=$!
trap 'kill -TERM $launcher 2>/dev/null; wait $launcher 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  grep -q '^ready: ' "$log" && break
  kill -0 $launcher 2>/dev/null || { cat "$log"; echo "the local cluster did not start" >&2; exit 1; }
  sleep 0.2
done
address=$(sed -n 's/^ready: coordinator at //p' "$log")
[ -n "$address" ] || { cat "$log"; echo "the local cluster was not ready in time" >&2; exit 1; }
echo "cluster ready at $address"
./build/bin/shardserve status --server="$address"
echo
./build/bin/shardserve generate --server="$address" "${request[@]}"
