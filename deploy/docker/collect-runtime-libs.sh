#!/usr/bin/env bash
# Copies the shared libraries that the given binaries load (their ldd closure, symlinks resolved)
# into OUT, so that a runtime image gets the binaries and their runtime libraries and nothing else.
# Left out, because the runtime base image provides them: glibc and the dynamic loader, libgcc_s,
# libstdc++, the vDSO, the NVIDIA driver (libcuda, mounted by the container toolkit), and the
# libraries named by SKIP_LIBS (an extended regex of sonames; the CUDA images skip the CUDA runtime,
# cuBLAS and NCCL, which NVIDIA's runtime image carries). Fails when a library is not found.
#   SKIP_LIBS='^(libcudart|libcublas)' deploy/docker/collect-runtime-libs.sh OUT BINARY...
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUT BINARY..." >&2; exit 2; }
out=$1
shift
mkdir -p "$out"
base='^(linux-vdso|libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux[^ ]*|libgcc_s|libstdc\+\+|libcuda)\.so'
status=0
for bin in "$@"; do
  while read -r soname arrow path _; do
    if [ "$arrow" = "=>" ] && [ "$path" = "not" ]; then
      echo "$bin: $soname not found" >&2
      status=1
      continue
    fi
    [ "$arrow" = "=>" ] || continue
    [[ "$soname" =~ $base ]] && continue
    [ -n "${SKIP_LIBS:-}" ] && [[ "$soname" =~ $SKIP_LIBS ]] && continue
    cp -L "$path" "$out/$soname"
  done < <(ldd "$bin")
done
exit $status
