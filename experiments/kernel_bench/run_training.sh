#!/usr/bin/env bash
# GPU: build the sparse training kernels, run their GPU tests, then the training benchmark (one call). Usage:
#   bash experiments/kernel_bench/run_training.sh [--quick] [--ms 4096,16384,65536]
# Writes results/kernel_bench/training_<time>.jsonl (BENCH_OUT overrides) and, under $LOG_DIR (default
# results/kernel_tests), training_tests_<time>.txt. Settings: KernelConfig's train_* fields,
# overridable as SFL_KERNEL_TRAIN_* (read once by the benchmark; kernels/config.py, kernels/train/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MAX_JOBS="${MAX_JOBS:-16}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
out="${BENCH_OUT:-results/kernel_bench/training_${stamp}.jsonl}"
logdir="${LOG_DIR:-results/kernel_tests}"
mkdir -p "$(dirname "$out")" "$logdir"
t0=$(date +%s)
python3 -c "from sfl.kernels.train.ops import load_ext; load_ext(); print('build ok')"
echo "build_s=$(( $(date +%s) - t0 ))"
if [ -z "${SKIP_TESTS:-}" ]; then
  set +e  # the benchmark runs (and checks its own outputs) even when a test fails
  python3 -m pytest tests/test_train_ffn_cuda.py -q -rA -p no:cacheprovider 2>&1 | tee "$logdir/training_tests_${stamp}.txt"
  echo "tests rc=${PIPESTATUS[0]}"
  set -e
fi
python3 -m sfl.experiments.kernel_bench.bench_training --out "$out" "$@"
echo "log: $out"
