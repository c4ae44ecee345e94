#!/usr/bin/env bash
# Builds the GPU suite and packs it into a self-contained folder for GPU machines, which have the
# NVIDIA driver, CUDA and Python but none of our Debian libraries and no package registry:
#   bash tests/gpu/bundle.sh [OUT_DIR]          (default OUT_DIR: gpu-bundle at the repository root)
# OUT_DIR then holds:
#   run.sh env.sh profile.sh variants.sh hop.sh suite.py kernels.py README.md   the runner, its library setup, the profiler and helpers
#   bin.tar.xz bin/ (the daemons and tools, shardserve-bench-gpu, -pipeline, -transfer) and tests/ (every test binary
#              labelled gpu, found through ctest -L gpu), packed; env.sh unpacks them into the
#              bundle on first use
#   lib.tar.xz their shared libraries except glibc's and NVIDIA's (packed: OpenBLAS and ICU data
#              alone are ~65 MiB unpacked); run.sh unpacks it to a scratch folder. libstdc++ and
#              libgcc_s go to compat/ in it: Debian 12's libstdc++ needs glibc 2.36, so run.sh uses
#              them only where the machine's own libstdc++ lacks a version the binaries need
#   compat.txt the GLIBCXX_/CXXABI_ versions the binaries and libraries need
#   root/      stands in for the source root the tests run in: tests/golden/..., tests/testing/local_cluster.py
#   shared/models/stories260K   what root/../shared/models/stories260K finds
# Fails when the folder is over 60 MiB, or, for a bundle inside the repository (which travels with
# the working tree), when the two together are over 63 MiB: what can be carried to a GPU machine is
# 64 MiB in all.
# Environment: BUILD_DIR (default build-gpu), JOBS (default 2), SHARDSERVE_BUNDLE_LINK_GOLDEN (below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$ROOT/gpu-bundle}"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
JOBS="${JOBS:-2}"
LIMIT_MIB=60
BINS=(shardserve-worker shardserve-coordinator shardserve-local shardserve-run shardserve shardserve-bench-gpu
  shardserve-bench-pipeline shardserve-bench-transfer)
TARGETS=(gpu_tests gpu_bench pipeline_bench transfer_bench shardserve_worker coordinator_main shardserve_local
  shardserve_run shardserve_cli)

echo "== configure and build ($BUILD)"
mkdir -p "$BUILD"
nice -n 10 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DSHARDSERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="80-real;90" -DCMAKE_CUDA_FLAGS="--compress-mode=size" -DSHARDSERVE_BENCH=ON >"$BUILD/configure.log" 2>&1 ||
  { tail -30 "$BUILD/configure.log"; exit 1; }
nice -n 10 ninja -C "$BUILD" -j"$JOBS" "${TARGETS[@]}"

# The gpu tests, by label: gtest_discover_tests lists each binary's cases after it is built.
mapfile -t TESTS < <(ctest --test-dir "$BUILD" -L gpu --show-only=json-v1 | python3 -c '
import json, os, sys
seen = []
for t in json.load(sys.stdin).get("tests", []):
    exe = (t.get("command") or [""])[0]
    if exe and os.path.isfile(exe) and exe not in seen:
        seen.append(exe)
print("\n".join(seen))')
if ((${#TESTS[@]} == 0)); then
  echo "bundle.sh: ctest -L gpu lists no built test binary in $BUILD" >&2
  exit 1
fi

echo "== pack $OUT"
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/tests" "$OUT/root/tests/golden" "$OUT/root/tests/testing" "$OUT/shared/models"
for b in "${BINS[@]}"; do
  [[ -x "$BUILD/bin/$b" ]] || { echo "bundle.sh: $BUILD/bin/$b was not built" >&2; exit 1; }
  cp "$BUILD/bin/$b" "$OUT/bin/"
done
for t in "${TESTS[@]}"; do cp "$t" "$OUT/tests/"; done
strip --strip-unneeded "$OUT"/bin/* "$OUT"/tests/*
cp "$ROOT"/tests/gpu/{run.sh,env.sh,profile.sh,variants.sh,hop.sh,suite.py,kernels.py,README.md} "$OUT/"
chmod +x "$OUT"/{run.sh,profile.sh,variants.sh,suite.py,kernels.py}

# Shared libraries: everything ldd resolves except the glibc family (the machine's own) and the
# NVIDIA/CUDA libraries (the machine's driver, toolkit and pip packages provide those).
SYSTEM='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|ld-linux[-a-z0-9_]*|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z0-9_-]+)\.so'
LIBS="$(mktemp -d)"
trap 'rm -rf "$LIBS"' EXIT
unresolved=""
for b in "$OUT"/bin/* "$OUT"/tests/*; do
  while read -r name arrow path _; do
    if [[ "$arrow" == "=>" && "$path" == "not" ]]; then unresolved+="$(basename "$b"): $name; "; continue; fi
    [[ "$arrow" == "=>" && "$path" == /* ]] || continue
    [[ "$name" =~ $SYSTEM ]] && continue
    dest="$LIBS"
    [[ "$name" =~ ^(libstdc\+\+|libgcc_s)\.so ]] && dest="$LIBS/compat"
    mkdir -p "$dest"
    [[ -e "$dest/$name" ]] || cp -L "$path" "$dest/$name"
  done < <(ldd "$b")
done
if [[ -n "$unresolved" ]]; then
  echo "bundle.sh: unresolved libraries on this machine: $unresolved" >&2
  exit 1
fi
# The C++ runtime versions needed, for run.sh to check the machine's libstdc++ against.
for f in "$OUT"/bin/* "$OUT"/tests/* "$LIBS"/*.so*; do objdump -T "$f" 2>/dev/null; done |
  grep -oE '(GLIBCXX|CXXABI)_[0-9][0-9.]*' | sort -uV >"$OUT/compat.txt"
echo "   $(find "$LIBS" -name '*.so*' | wc -l) libraries, $(du -sm "$LIBS" | cut -f1) MiB unpacked; packing"
XZ_OPT="-6 -T$JOBS" nice -n 10 tar -cJf "$OUT/lib.tar.xz" -C "$LIBS" .

# The test data, at the paths the tests open relative to the source root. With
# SHARDSERVE_BUNDLE_LINK_GOLDEN=1 the golden models (16 MiB) are a relative link to the source
# tree's instead of a copy: for a bundle at the repository root that travels with the tree.
if [[ "${SHARDSERVE_BUNDLE_LINK_GOLDEN:-0}" == 1 && "$OUT" == "$ROOT/gpu-bundle" ]]; then
  ln -s ../../../../tests/golden/models "$OUT/root/tests/golden/models"
else
  cp -r "$ROOT/tests/golden/models" "$OUT/root/tests/golden/"
fi
cp "$ROOT"/tests/golden/*.json "$OUT/root/tests/golden/"
cp "$ROOT/tests/testing/local_cluster.py" "$OUT/root/tests/testing/"
if [[ -d "$ROOT/../shared/models/stories260K" ]]; then
  cp -r "$ROOT/../shared/models/stories260K" "$OUT/shared/models/"
else
  echo "   warning: $ROOT/../shared/models/stories260K not found; tests that read it will skip or fail"
fi

# The oldest glibc the binaries accept (the GPU machine's must be at least this).
glibc="$(for f in "$OUT"/bin/* "$OUT"/tests/* "$LIBS"/*.so*; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -1)"
echo "   binaries: ${BINS[*]}"
echo "   gpu tests: $(cd "$OUT/tests" && echo *)"
echo "   needs ${glibc:-GLIBC_?} or newer on the GPU machine (2.36 where its libstdc++ is older than $(grep GLIBCXX "$OUT/compat.txt" | tail -1))"
echo "   glibc of this machine: $(ldd --version | head -1 | grep -o "[0-9.]*$")"
# The binaries compress about 3x: packed, the bundle and the working tree fit the transfer together.
echo "   packing bin/ and tests/"
XZ_OPT="-6 -T$JOBS" nice -n 10 tar -cJf "$OUT/bin.tar.xz" -C "$OUT" bin tests
rm -rf "$OUT/bin" "$OUT/tests"
bytes="$(du -sb "$OUT" | cut -f1)"
mib="$(python3 -c "print(f'{$bytes / 2**20:.1f}')")"
echo "== bundle $OUT: $mib MiB (limit $LIMIT_MIB MiB)"
if ((bytes > LIMIT_MIB * 1024 * 1024)); then
  echo "bundle.sh: the bundle is over $LIMIT_MIB MiB" >&2
  exit 1
fi
case "$(readlink -f "$OUT")/" in
  "$(readlink -f "$ROOT")"/*)
    # What travels with it: tracked files and untracked ones git does not ignore.
    tree="$(cd "$ROOT" && git ls-files -co --exclude-standard -z 2>/dev/null | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)"
    total=$((bytes + ${tree:-0}))
    echo "   with the working tree it travels with ($(python3 -c "print(f'{${tree:-0} / 2**20:.1f}')") MiB):" \
      "$(python3 -c "print(f'{$total / 2**20:.1f}')") MiB (limit 63 MiB)"
    if ((total > 63 * 1024 * 1024)); then
      echo "bundle.sh: the bundle and the working tree together are over 63 MiB" >&2
      exit 1
    fi
    ;;
esac
