#!/usr/bin/env bash
# Sourced by run.sh, profile.sh and variants.sh from inside the bundle: unpacks the bundle's
# binaries into it (once) and its libraries into $WORK/lib, and sets LD_LIBRARY_PATH to them plus the machine's CUDA runtime, cuBLAS and NCCL.
# Needs BUNDLE (the bundle's folder) and say(); WORK (a scratch folder) is made, and removed at
# exit, when the caller has not set it. Sets LIBDIR, LIB_PATH,
# FOUND (library -> folder), NEEDED, COMPAT (which C++ runtime is used), MISSING (what ldd leaves
# unresolved), ENV_STATUS/ENV_REASON and found_json.
if [[ -z "${WORK:-}" ]]; then
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/shardserve-gpu.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
fi
unpack_xz() {  # ARCHIVE DIR
  if command -v xz >/dev/null 2>&1; then
    tar -xJf "$1" -C "$2"
  else
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"
  fi
}
# The binaries and test binaries come packed (bin.tar.xz: bin/ and tests/; bundle.sh compresses
# them so that the bundle and the working tree it travels with stay under the transfer limit):
# unpacked into the bundle once, where every script then finds them.
if [[ -f "$BUNDLE/bin.tar.xz" && ! -e "$BUNDLE/bin/.unpacked" ]]; then
  if unpack_xz "$BUNDLE/bin.tar.xz" "$BUNDLE"; then
    touch "$BUNDLE/bin/.unpacked"
  else
    say "   could not unpack $BUNDLE/bin.tar.xz: the parts that need its binaries will fail"
  fi
fi
# The bundle's own libraries come packed as well; unpacked next to the scratch files.
LIBDIR="$WORK/lib"
mkdir -p "$LIBDIR"
if [[ -f "$BUNDLE/lib.tar.xz" ]]; then
  unpack_xz "$BUNDLE/lib.tar.xz" "$LIBDIR"
elif [[ -d "$BUNDLE/lib" ]]; then
  LIBDIR="$BUNDLE/lib"
fi
# CUDA runtime, cuBLAS and NCCL come from the machine: the toolkit's folders first, then the lib
# folders of pip's nvidia-* packages (torch's venv ships NCCL there) for whatever is still missing.
CUDA_DIRS=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
  [[ -d "$d" ]] && CUDA_DIRS+=("$(readlink -f "$d")")
done
SITE_DIRS=()
for py in python3 /opt/torch/.venv/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while IFS= read -r d; do [[ -d "$d/nvidia" ]] && SITE_DIRS+=("$d"); done < <(
    "$py" -c "import site, sys; print('\n'.join(site.getsitepackages() + [site.getusersitepackages()]))" 2>/dev/null)
done
for d in /opt/torch/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
  [[ -d "$d/nvidia" ]] && SITE_DIRS+=("$d")
done
NEEDED=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2)
declare -A FOUND=()
for lib in "${NEEDED[@]}"; do
  for d in "${CUDA_DIRS[@]}"; do
    if [[ -e "$d/$lib" ]]; then FOUND[$lib]="$d"; break; fi
  done
  if [[ -z "${FOUND[$lib]:-}" ]]; then
    for sp in "${SITE_DIRS[@]}"; do
      hit="$(find "$sp/nvidia" -name "$lib" -print -quit 2>/dev/null)"
      if [[ -n "$hit" ]]; then FOUND[$lib]="$(dirname "$(readlink -f "$hit")")"; break; fi
    done
  fi
done
LIB_PATH=("$LIBDIR")
# The bundled libstdc++/libgcc_s (Debian 12's; they need glibc 2.36) only where the machine's own
# libstdc++ lacks a GLIBCXX_/CXXABI_ version that the binaries need.
COMPAT="not needed"
if [[ -d "$LIBDIR/compat" ]]; then
  sys_stdcxx="$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')"
  lacking=""
  if [[ -z "$sys_stdcxx" ]]; then
    lacking="no libstdc++.so.6 in ldconfig's cache"
  elif [[ -f "$BUNDLE/compat.txt" ]]; then
    while IFS= read -r v; do grep -qaF "$v" "$sys_stdcxx" || lacking+="$v "; done <"$BUNDLE/compat.txt"
  fi
  if [[ -n "$lacking" ]]; then
    LIB_PATH+=("$LIBDIR/compat")
    COMPAT="bundled libstdc++/libgcc_s (the machine's ${sys_stdcxx:-libstdc++} lacks: $lacking)"
  else
    COMPAT="the machine's $sys_stdcxx has every version needed"
  fi
fi
for lib in "${NEEDED[@]}"; do
  d="${FOUND[$lib]:-}"
  [[ -n "$d" && ! " ${LIB_PATH[*]} " =~ " $d " ]] && LIB_PATH+=("$d")
done
export LD_LIBRARY_PATH="$(IFS=:; echo "${LIB_PATH[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "-- libraries"
say "   LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
say "   C++ runtime: $COMPAT"
for lib in "${NEEDED[@]}"; do say "   $lib: ${FOUND[$lib]:-NOT FOUND (searched: ${CUDA_DIRS[*]:-no toolkit} ${SITE_DIRS[*]:-no site-packages/nvidia})}"; done
MISSING=()
for b in "$BUNDLE"/bin/* "$BUNDLE"/tests/*; do
  [[ -f "$b" && -x "$b" ]] || continue
  while IFS= read -r line; do MISSING+=("$(basename "$b"): $line"); done < <(ldd "$b" 2>&1 | grep -E "not found|version .* not found")
done
ENV_STATUS=passed
ENV_REASON=""
if ((${#MISSING[@]})); then
  ENV_STATUS=failed
  ENV_REASON="unresolved libraries: $(printf '%s; ' "${MISSING[@]}" | head -c 3000)"
  say "   ldd: ${#MISSING[@]} unresolved:"; printf '     %s\n' "${MISSING[@]}" | head -20
else
  say "   ldd: every binary resolves its libraries"
fi
found_json="{$(for lib in "${NEEDED[@]}"; do printf '"%s": "%s",' "$lib" "${FOUND[$lib]:-}"; done | sed 's/,$//')}"

