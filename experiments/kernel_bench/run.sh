#!/usr/bin/env bash
# GPU benchmark of the TwELL kernels vs dense (see README.md). Usage:
#   bash experiments/kernel_bench/run.sh [--quick]      # writes results/kernel_bench/bench_<time>.jsonl
# Env: SFL_PREBUILT=<sfl_twell_*.so>[:<sfl_train_*.so>] to skip the JIT build; SFL_KERNEL_<FIELD> (KernelConfig fields, kernels/config.py, e.g.
# SFL_KERNEL_CROSSOVER=... or SFL_KERNEL_SLOTS=16) to sweep: read once by the benchmark, logged as kernel_config.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MAX_JOBS="${MAX_JOBS:-16}"
out="${BENCH_OUT:-results/kernel_bench/bench_$(date -u +%Y%m%dT%H%M%SZ).jsonl}"
python3 -m sfl.experiments.kernel_bench.bench_inference --out "$out" "$@"
echo "log: $out"
