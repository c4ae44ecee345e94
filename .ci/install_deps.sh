#!/usr/bin/env bash
# Installs every Debian package shardserve needs to build and test. Run as root on Debian 12.
# The CUDA toolkit (nvcc, cuBLAS, NCCL) is not a Debian 12 package: where it is installed under
# /usr/local/cuda the build picks it up (SHARDSERVE_CUDA=AUTO); without it the CPU build is complete.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgoogle-glog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libsentencepiece-dev nlohmann-json3-dev libpcre2-dev libicu-dev
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
