#!/usr/bin/env bash
# Compile-checks every CUDA source for Hopper (sm_90a) with plain nvcc: no GPU and no CUDA torch needed,
# because the .cu files include only CUDA headers (torch-facing code lives in binding.cpp).
# Prints ptxas register/spill reports; fails on any error or on a spill.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t srcs < <(find kernels -name '*.cu' | sort)
[ "${#srcs[@]}" -gt 0 ] || { echo "no .cu files"; exit 0; }
command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit (13.x) to compile-check kernels" >&2; exit 1; }
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
fail=0
for f in "${srcs[@]}"; do
  log="$out/$(basename "$f").log"
  if nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -c "$f" -o "$out/$(basename "$f").o" >"$log" 2>&1; then
    spills=$(grep -E "[1-9][0-9]* bytes spill" "$log" || true)
    if [ -n "$spills" ]; then echo "SPILL  $f"; echo "$spills"; fail=1; else echo "ok     $f"; fi
  else
    echo "FAIL   $f"; cat "$log"; fail=1
  fi
done
exit "$fail"
