#!/usr/bin/env bash
# Installs every Debian package shardserve needs to build and test (--build-only: to build).
# Run as root on Debian 12.
# The CUDA toolkit (nvcc, cuBLAS, NCCL) is not a Debian 12 package: where it is installed under
# /usr/local/cuda the build picks it up (SHARDSERVE_CUDA=AUTO); without it the CPU build is complete.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3 procps
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgoogle-glog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libsentencepiece-dev nlohmann-json3-dev libpcre2-dev libicu-dev libcpp-httplib-dev
  clang libclang-rt-14-dev
  libssl-dev openssl
)
# Only the tests need these: the Helm chart checks (tests/helm) render the chart with Go and Sprig
# in GOPATH mode, lint YAML, and make a venv for kubernetes-validate; the observability test
# (tests/integration/observability_test.py) scrapes a local cluster with a real Prometheus server;
# ccache keeps the compiled objects of the test command's four builds between its runs (CMake uses
# it where it is installed: SHARDSERVE_CCACHE). The container builds (deploy/docker) pass --build-only.
test_packages=(
  ccache golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev
  golang-github-xeipuuv-gojsonschema-dev yamllint python3-venv python3-yaml prometheus curl
)
[ "${1:-}" = "--build-only" ] || packages+=("${test_packages[@]}")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
