#!/usr/bin/env bash
# The small-scale suite of record at one commit, its runs spread over the visible GPUs
# (experiments/run_parallel.sh): every result of l1_sweep, activation_analysis, ablations and train_equivalence.
#   SCALE=gpu bash experiments/small_scale_suite.sh       # all stages; one H100: ~25 min, two: about half
# Stages (STAGES, default "sweep analysis rest"), each resumable (finished runs are skipped):
#   sweep     l1_sweep: every point at seed 0, and SEEDS (default "1 2") more seeds of SEED_POINTS
#             (default "0 3e-4 1e-3 3e-3 silu": the points whose intervals the tables report)
#   analysis  activation_analysis of three seed-0 sweep models (needs this machine's sweep models; one job, alone,
#             because it times the per-layer FFNs)
#   rest      ablations (two jobs: gating, dead_neurons; they reuse the sweep's logs) and train_equivalence
#             (one job per seed 0 + SEEDS)
# Env: WORKERS_PER_GPU (default 2 for sweep and rest: two small trainings share a GPU), LOG_DIR (job logs),
# SCALE / RUNS_ROOT / RESULTS_ROOT as in experiments/run_lib.sh (exported to every job).
set -euo pipefail
cd "$(dirname "$0")/.."
. experiments/env.sh
. experiments/run_lib.sh
export SCALE RUNS_ROOT RESULTS_ROOT KEEP_CKPT SFL_GIT_COMMIT
read -r -a STAGE_LIST <<< "${STAGES:-sweep analysis rest}"
read -r -a MORE_SEEDS <<< "${SEEDS-1 2}"
read -r -a SEED_POINTS <<< "${SEED_POINTS:-0 3e-4 1e-3 3e-3 silu}"
if [ "$SCALE" = gpu ]; then POINTS="0 3e-5 1e-4 3e-4 1e-3 3e-3 1e-2 3e-2 silu"; else POINTS="0 1e-3 1e-2 1e-1 silu"; fi
LOG_DIR=${LOG_DIR:-$RUNS_ROOT/suite_logs}
mkdir -p "$LOG_DIR"

stage_jobs() {  # the job lines of one stage
  case $1 in
    sweep)
      for p in $POINTS; do echo "L1_VALUES=$p SEEDS=0 bash experiments/l1_sweep/run.sh"; done
      for s in ${MORE_SEEDS[@]+"${MORE_SEEDS[@]}"}; do
        for p in "${SEED_POINTS[@]}"; do echo "L1_VALUES=$p SEEDS=$s bash experiments/l1_sweep/run.sh"; done
      done ;;
    analysis) echo "bash experiments/activation_analysis/run.sh" ;;
    rest)
      echo "ABL_GROUPS=gating bash experiments/ablations/run.sh"
      echo "ABL_GROUPS=dead_neurons bash experiments/ablations/run.sh"
      for s in 0 ${MORE_SEEDS[@]+"${MORE_SEEDS[@]}"}; do echo "SEEDS=$s bash experiments/train_equivalence/run.sh"; done ;;
    *) echo "unknown stage $1 (choose from sweep analysis rest)" >&2; return 2 ;;
  esac
}

for stage in "${STAGE_LIST[@]}"; do
  jobs="$LOG_DIR/$stage.jobs"
  stage_jobs "$stage" > "$jobs"
  workers=${WORKERS_PER_GPU:-2}; [ "$stage" != analysis ] || workers=1
  echo "== stage $stage: $(wc -l < "$jobs") jobs"
  WORKERS_PER_GPU=$workers LOG_DIR="$LOG_DIR/$stage" bash experiments/run_parallel.sh "$jobs"
done
# one summary per experiment once every job is done (each job also wrote one when it finished)
for exp in l1_sweep ablations/gating ablations/dead_neurons train_equivalence; do
  [ ! -d "$RESULTS_ROOT/$exp" ] || python -m sfl.experiments.trainer.runs summarize "$RESULTS_ROOT/$exp" > /dev/null
done
echo "suite done: $RESULTS_ROOT"
