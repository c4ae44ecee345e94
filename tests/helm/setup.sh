#!/usr/bin/env bash
# Prepares what the helm_* tests use, under OUT (default build/helm):
#   OUT/render  the chart renderer (tests/helm/render), built with Debian's Go and its Sprig,
#               ghodss/yaml and gojsonschema packages in GOPATH mode — no Go module download;
#   OUT/venv    a Python venv with the pinned, hash-checked kubernetes-validate from PyPI
#               (tests/helm/requirements.txt).
# Idempotent: rebuilds the renderer only when its source is newer, and the venv only when the
# requirements changed. Needs the packages .ci/install_deps.sh installs (golang-go,
# golang-github-masterminds-sprig-dev, golang-github-ghodss-yaml-dev,
# golang-github-xeipuuv-gojsonschema-dev, python3-venv, yamllint).
#   bash tests/helm/setup.sh [OUT]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/build/helm}
mkdir -p "$out"

missing=()
for tool in go yamllint python3; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ -d /usr/share/gocode/src/github.com/Masterminds/sprig ] || missing+=("golang-github-masterminds-sprig-dev")
if [ ${#missing[@]} -gt 0 ]; then
  echo "tests/helm/setup.sh: missing ${missing[*]}: run 'bash .ci/install_deps.sh' (as root)" >&2
  exit 1
fi

src=$root/tests/helm/render/main.go
if [ ! -x "$out/render" ] || [ "$src" -nt "$out/render" ]; then
  echo "building the chart renderer"
  (cd "$root" && GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS='' CGO_ENABLED=0 GOCACHE="$out/gocache" \
    go build -o "$out/render.tmp" ./tests/helm/render)
  mv "$out/render.tmp" "$out/render"
fi

req=$root/tests/helm/requirements.txt
venv=$out/venv
if ! cmp -s "$req" "$venv/requirements.installed" 2>/dev/null; then
  echo "creating $venv (kubernetes-validate from PyPI)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input --require-hashes \
    --only-binary :all: -r "$req"
  cp "$req" "$venv/requirements.installed"
fi
"$venv/bin/python" -c 'import kubernetes_validate, jsonschema, yaml' || {
  echo "tests/helm/setup.sh: the venv at $venv is broken; remove it and run again" >&2
  exit 1
}
echo "helm test tools ready in $out"
