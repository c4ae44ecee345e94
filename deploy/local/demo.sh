#!/usr/bin/env bash
# The main job on one machine: install dependencies, build, and generate text in one process.
# Uses the trained stories260K model from ../shared/models when it is beside the repository,
# otherwise the tiny random-weight Llama the project ships under tests/golden (whose output is
# token ids of random weights: it shows the engine working, not a story).
#   bash deploy/local/demo.sh ["PROMPT"]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build shardserve_run
model=../shared/models/stories260K
if [ -f "$model/model.safetensors" ]; then
  ./build/bin/shardserve-run --model "$model" --prompt "${1:-Once upon a time}" --max_tokens 96 --temperature 0 \
    || ./build/bin/shardserve-run --model "$model" --prompt_ids 1 --max_tokens 96 --temperature 0
else
  ./build/bin/shardserve-run --model tests/golden/models/llama --prompt_ids 1,5,9 --max_tokens 16 --temperature 0
fi
