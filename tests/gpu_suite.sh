#!/usr/bin/env bash
# Every CUDA test on the GPU at hand, as one log with its provenance (commit, GPU, driver, versions):
#   bash tests/gpu_suite.sh [LOG]          # default LOG: results/kernel_tests/gpu_suite_<gpu>.txt
# Export SFL_GIT_COMMIT where the checkout has no .git (a copied working tree). The CPU suite (tests/run.sh) skips these; this is what a kernel or distributed-path change is checked with.
# Covers the inference op, the training op, the model, and the distributed path (FSDP2 / DDP / DCP resume /
# FSDP2 evaluation through the sparse op) under torchrun over every visible GPU, at most 2.
# SANITIZE=memcheck|racecheck|synccheck runs the kernel tests (not the multi-process ones) under compute-sanitizer;
# select tests with pytest's own PYTEST_ADDOPTS="-k '...'" (quoted as in a shell), which the log's header records.
# ONLY=distributed runs the distributed path alone (a multi-GPU machine, once the one-GPU tests have passed).
set -euo pipefail
cd "$(dirname "$0")/.."
. experiments/env.sh
gpu=$(python -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')
log="${1:-results/kernel_tests/gpu_suite_${gpu}${SANITIZE:+_$SANITIZE}.txt}"
mkdir -p "$(dirname "$log")"
{
  echo "commit ${SFL_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
       "source_tree_hash $(python -c 'from sfl.experiments.trainer.provenance import source_tree_hash as h; print(h())')"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  echo "SANITIZE=${SANITIZE:-} ONLY=${ONLY:-} PYTEST_ADDOPTS=${PYTEST_ADDOPTS:-}" "GPUs $(nvidia-smi -L | wc -l)"
} > "$log"
files=(tests/test_twell_cuda.py tests/test_train_ffn_cuda.py tests/test_model_cuda.py tests/test_decode_loop.py tests/test_kernels_cpu.py
       tests/test_reference_format.py tests/test_run_safety.py)
set +e
if [ -n "${SANITIZE:-}" ]; then
  compute-sanitizer --tool "$SANITIZE" --error-exitcode 1 --target-processes all \
    python -m pytest "${files[@]:0:2}" -q -p no:cacheprovider -x >> "$log" 2>&1
  rc=$?
else
  rc=0
  if [ "${ONLY:-}" != distributed ]; then
    python -m pytest "${files[@]}" -q -p no:cacheprovider -rs >> "$log" 2>&1 || rc=$?
  fi
  echo "== the distributed path under torchrun" >> "$log"
  python -m pytest tests/test_distributed.py -k gpu -q -p no:cacheprovider -rs >> "$log" 2>&1 || rc=$?
fi
set -e
echo "exit $rc" >> "$log"
tail -3 "$log"
exit "$rc"
