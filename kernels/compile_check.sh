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

# Host sources (binding.cpp, runtime.cpp: torch-facing): a syntax check against the installed torch's headers, so a C++ error
# is caught here and not on the GPU machine. A CPU-only torch wheel lacks one generated CUDA header (stubbed)
# and the cuBLAS/cuSPARSE headers (bindings must not include ATen/cuda/CUDAContext.h). Skipped without torch.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then   # the project's Python (creates .venv on first use, as the tests would)
  # shellcheck disable=SC1091
  PY="$(. experiments/env.sh >/dev/null && command -v python)" || PY=python3
fi
if inc=$("$PY" -c "import torch.utils.cpp_extension as c, sysconfig; print(' '.join(['-isystem ' + p for p in c.include_paths()] + ['-isystem ' + sysconfig.get_paths()['include']]))" 2>/dev/null); then
  cuda_inc=""   # the toolkit's include folder (nvcc may be a wrapper script, so try the usual places too)
  for d in "${CUDA_HOME:-}/include" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")/include" \
           /usr/local/cuda/include /usr/local/cuda-*/include; do
    if [ -f "$d/cuda_runtime_api.h" ]; then cuda_inc="$d"; break; fi
  done
  mkdir -p "$out/stub/c10/cuda/impl"
  printf '#pragma once\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  while IFS= read -r f; do
    # shellcheck disable=SC2086
    if g++ -std=c++17 -fsyntax-only -isystem "$out/stub" $inc -isystem "$cuda_inc" -DTORCH_EXTENSION_NAME=check \
         -DTORCH_API_INCLUDE_EXTENSION_H "$f" >"$out/binding.log" 2>&1; then
      echo "ok     $f (syntax)"
    else
      echo "FAIL   $f"; cat "$out/binding.log"; fail=1
    fi
  done < <(find kernels -name '*.cpp' -not -path '*/lab/*' | sort)
else
  echo "skip   bindings (torch not importable by $PY)"
fi
exit "$fail"
