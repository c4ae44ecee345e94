#!/usr/bin/env bash
# Prepares the Python SDK test: a venv at OUT/venv with tests/sdk/python-requirements.txt from PyPI
# (made again only when that file changes; pip's own cache makes a rebuild quick), then builds and
# installs sdk/python into it from a copy under OUT (protoc runs at build time; the source tree
# stays clean). Needs python3 with venv (Debian: python3-venv).
#   bash tests/sdk/python_sdk_setup.sh OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: python_sdk_setup.sh OUT}
mkdir -p "$out"
req=$root/tests/sdk/python-requirements.txt
venv=$out/venv
if ! cmp -s "$req" "$venv/requirements.installed" 2>/dev/null; then
  echo "creating $venv (grpcio, grpcio-tools, protobuf, setuptools from PyPI)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input --only-binary :all: -r "$req"
  cp "$req" "$venv/requirements.installed"
fi
# Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
src=$out/src
rm -rf "$src"
mkdir -p "$src"
cp -r "$root/sdk/python/." "$src/"
rm -rf "$src/build" "$src"/*.egg-info "$src"/src/*.egg-info
SHARDSERVE_PROTO_DIR=$root/proto "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input \
  --no-build-isolation --no-deps --force-reinstall "$src"
# The installed package has the generated code, its stubs and the dependency pins.
"$venv/bin/python" - <<'PY'
import importlib.metadata as m, os, shardserve, shardserve.v1.inference_pb2_grpc
pkg = os.path.dirname(shardserve.__file__)
assert os.path.isfile(os.path.join(pkg, "py.typed")), "py.typed is missing"
assert os.path.isfile(os.path.join(pkg, "v1", "inference_pb2.pyi")), "the type stubs were not generated"
req = m.requires("shardserve") or []
assert any(r.startswith("grpcio>=") for r in req) and any(r.startswith("protobuf") for r in req), req
PY
echo "python sdk installed in $venv"
