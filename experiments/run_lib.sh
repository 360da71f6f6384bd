# Shared by experiments/*/run.sh (sourced after experiments/env.sh, from the repo root).
# Scales, output roots, and resumable "train one run" / "evaluate one checkpoint" steps over the ONE
# training loop (experiments/trainer/train.py) and the ONE eval entry point (experiments/trainer/evaluate.py).
#
#   SCALE=smoke (default)  CPU, tiny, minutes: exercises the whole pipeline (what CI runs).
#                          Outputs: runs/smoke/<exp>/<run>/ (checkpoints, final model) and the logs under
#                          runs/smoke/results/<exp>/<run>/ -- never results/ (smoke numbers are not results).
#   SCALE=cpu              where an experiment ships cpu.yaml: the largest run 2 CPU cores allow; real results.
#   SCALE=gpu              one H100: the scale the README reports. Logs go to results/<exp>/<run>/,
#                          models to runs/gpu/<exp>/<run>/final.
# Overrides: RUNS_ROOT, RESULTS_ROOT (e.g. $OUT/results on the GPU machine), KEEP_CKPT=1 keeps the
# optimizer checkpoints of finished runs (default: deleted once the run's final model is saved).
# A run whose results/<exp>/<run>/train_log.jsonl has a "final" line is skipped; an interrupted one
# resumes from its newest checkpoint (train.py --resume).

SCALE="${SCALE:-smoke}"
case "$SCALE" in
  smoke|gpu) ;;
  cpu) ;;  # only experiments that ship a cpu.yaml (sfl_train says so otherwise)
  *) echo "SCALE=$SCALE: choose SCALE=smoke (CPU, minutes), cpu (CPU, the largest run 2 cores allow; where a" \
          "cpu.yaml exists) or gpu (one H100)" >&2; exit 2 ;;
esac
RUNS_ROOT="${RUNS_ROOT:-runs/$SCALE}"
# gpu and cpu runs are real (committed) results; smoke runs only exercise the pipeline
if [ "$SCALE" = smoke ]; then RESULTS_ROOT="${RESULTS_ROOT:-runs/smoke/results}"; else RESULTS_ROOT="${RESULTS_ROOT:-results}"; fi
KEEP_CKPT="${KEEP_CKPT:-0}"
export SFL_GIT_COMMIT="${SFL_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
SFL_FAILED=()

sfl_require_gpu() {
  if [ "$SCALE" = gpu ] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "SCALE=gpu needs a CUDA GPU (none visible). Use SCALE=smoke on CPU." >&2
    exit 2
  fi
}

# sfl_train EXP RUN IDX TOTAL CONFIG.yaml [OVERRIDE.yaml ...] [-- key=value ...]
# Trains $RUNS_ROOT/EXP/RUN with the merged config (later files / key=values win), copies the training log to
# $RESULTS_ROOT/EXP/RUN/train_log.jsonl and prints one progress line. A failed run is recorded in SFL_FAILED
# and the sweep goes on with the next one.
sfl_train() {
  local exp=$1 run=$2 idx=$3 total=$4
  shift 4
  local yamls=() sets=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; sets=("$@"); break; fi
    yamls+=("$1"); shift
  done
  local out="$RUNS_ROOT/$exp/$run" res="$RESULTS_ROOT/$exp/$run" y
  for y in "${yamls[@]}"; do
    [ -f "$y" ] || { echo "$exp/$run: no config $y (SCALE=$SCALE is not offered by this experiment)" >&2; exit 2; }
  done
  if python -m sfl.experiments.trainer.runs done "$res"; then
    echo "[$idx/$total] $exp/$run: finished before, skipped -- $(python -m sfl.experiments.trainer.runs describe "$res")"
    return 0
  fi
  mkdir -p "$out" "$res"
  if ! python -m sfl.experiments.trainer.runs done "$out"; then
    local setargs=()
    for s in ${sets[@]+"${sets[@]}"}; do setargs+=(--set "$s"); done
    python -m sfl.experiments.trainer.runs merge "${yamls[@]}" ${setargs[@]+"${setargs[@]}"} --set "out_dir=$out" \
      -o "$out/config.yaml"
    # what to clean (a log without a checkpoint: a run killed before its first save) is decided by train.py
    # under the run directory's lock, never here: another process may be training in it
    if compgen -G "$out/checkpoints/step_*/COMPLETE" > /dev/null; then
      echo "[$idx/$total] $exp/$run: resuming from its newest checkpoint"
    else
      echo "[$idx/$total] $exp/$run: training ($(tr '\n' ' ' < "$out/config.yaml" | grep -oE 'l1_coeff: [^ ]+' || true))"
    fi
    local t0=$SECONDS
    if ! python -m sfl.experiments.trainer.train --config "$out/config.yaml" --resume; then
      echo "[$idx/$total] $exp/$run: FAILED after $((SECONDS - t0)) s (log: $out/train_log.jsonl)" >&2
      SFL_FAILED+=("$exp/$run")
      return 0
    fi
  fi
  local keep=()
  [ "$KEEP_CKPT" != 1 ] || keep=(--keep-checkpoints)
  if ! python -m sfl.experiments.trainer.runs finish "$out" "$res" ${keep[@]+"${keep[@]}"}; then
    SFL_FAILED+=("$exp/$run")
    return 0
  fi
  echo "[$idx/$total] $exp/$run: done -- $(python -m sfl.experiments.trainer.runs describe "$res")"
}

# sfl_reuse_log SRC_RES DST_RES WHY: a run whose config equals a finished one elsewhere takes that run's log (and its
# eval.json, where DST_RES has none) instead of retraining; REUSED_FROM.txt in DST_RES says WHY.
sfl_reuse_log() {
  local src=$1 dst=$2 why=$3
  mkdir -p "$dst"
  cp "$src/train_log.jsonl" "$dst/train_log.jsonl"
  echo "$why" > "$dst/REUSED_FROM.txt"
  if [ -f "$src/eval.json" ] && [ ! -f "$dst/eval.json" ]; then cp "$src/eval.json" "$dst/eval.json"; fi
}

# _sfl_evaluate EXP RUN NAME DONE_FILE WHAT [evaluate.py args ...]
# Runs experiments/trainer/evaluate.py on $RUNS_ROOT/EXP/RUN/final into a temp dir and moves each file it wrote to
# $RESULTS_ROOT/EXP/RUN as NAME.<file> (eval.json -> NAME.json, scores.npz -> NAME.scores.npz). Skipped when
# DONE_FILE exists there; a failure is recorded in SFL_FAILED and the sweep goes on.
_sfl_evaluate() {
  local exp=$1 run=$2 name=$3 done_file=$4 what=$5
  shift 5
  local res="$RESULTS_ROOT/$exp/$run" model="$RUNS_ROOT/$exp/$run/final"
  if [ -f "$res/$done_file" ]; then
    echo "  $exp/$run $name: exists, skipped"
    return 0
  fi
  if [ ! -f "$model/config.json" ]; then
    echo "  $exp/$run $name: no trained model at $model (training failed or was cleaned); skipped" >&2
    SFL_FAILED+=("$exp/$run:$name")
    return 0
  fi
  local tmp f
  tmp="$(mktemp -d "${TMPDIR:-/tmp}/sfl_eval.XXXXXX")"
  echo "  $exp/$run $name: $what $*"
  if python -m sfl.experiments.trainer.evaluate --model "$model" --out "$tmp" "$@"; then
    mkdir -p "$res"
    for f in "$tmp"/*; do f=$(basename "$f"); mv "$tmp/$f" "$res/$name.${f#eval.}"; done
  else
    echo "  $exp/$run $name: FAILED" >&2
    SFL_FAILED+=("$exp/$run:$name")
  fi
  rm -rf "$tmp"
}

# sfl_eval EXP RUN NAME [evaluate.py args ...]
# lm-eval on $RUNS_ROOT/EXP/RUN/final; the eval.json it writes is stored as $RESULTS_ROOT/EXP/RUN/NAME.json
# (NAME=eval for the dense path, eval_sparse for the sparse one). Skipped when that file exists.
sfl_eval() {
  _sfl_evaluate "$1" "$2" "$3" "$3.json" lm-eval "${@:4}"
}

# sfl_score EXP RUN NAME REQUESTS.npz [evaluate.py args ...]
# Split eval, GPU half (no lm-eval needed): scores the exported requests with $RUNS_ROOT/EXP/RUN/final into
# $RESULTS_ROOT/EXP/RUN/NAME.scores.{npz,json}; `evaluate.py --replay` turns them into NAME.json on a machine
# with lm-eval (experiments/replay.sh). Skipped when the scores exist.
sfl_score() {
  _sfl_evaluate "$1" "$2" "$3" "$3.scores.npz" scoring --score "$4" "${@:5}"
}

# sfl_finish EXP: summary.csv over the experiment's runs, then a non-zero exit if anything failed.
sfl_finish() {
  local exp=$1
  if [ -d "$RESULTS_ROOT/$exp" ]; then python -m sfl.experiments.trainer.runs summarize "$RESULTS_ROOT/$exp" || true; fi
  if [ ${#SFL_FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${SFL_FAILED[*]}" >&2
    return 1
  fi
  echo "all runs finished: logs in $RESULTS_ROOT/$exp/, models in $RUNS_ROOT/$exp/"
}

# sfl_train_rerunnable BASE_DIR CONFIG.yaml FRESH [key=value ...]
# The re-runnable training step of a job run by hand again and again (the quickstart). With CONFIG + the
# key=values it trains in BASE_DIR, or in BASE_DIR-2, -3, ... (experiments/trainer/runs.py pick_run_dir): the first
# directory that holds this same run -- finished: reported, not retrained; interrupted: resumed from its newest
# checkpoint -- or nothing (trained there). A directory holding a run with other settings is left as it is, so
# a re-run never deletes or overwrites finished work. FRESH=1: always a directory that holds nothing.
# Sets SFL_RUN_DIR to the directory used and SFL_RUN_STATE to what it held (new|unfinished|finished).
sfl_train_rerunnable() {
  local base=$1 config=$2 fresh=$3
  shift 3
  local setargs=() s merged pick resume=() fresh_arg=()
  for s in "$@"; do setargs+=(--set "$s"); done
  [ "$fresh" != 1 ] || fresh_arg=(--fresh)
  merged="$(mktemp "${TMPDIR:-/tmp}/sfl_config.XXXXXX")"
  python -m sfl.experiments.trainer.runs merge "$config" ${setargs[@]+"${setargs[@]}"} -o "$merged"
  pick="$(python -m sfl.experiments.trainer.runs pick-dir "$base" "$merged" ${fresh_arg[@]+"${fresh_arg[@]}"})"
  SFL_RUN_STATE="${pick%% *}" SFL_RUN_DIR="${pick#* }"
  case "$SFL_RUN_STATE" in
    finished)
      rm -f "$merged"
      echo "$SFL_RUN_DIR: finished before with these settings, not retrained -- $(python -m sfl.experiments.trainer.runs describe "$SFL_RUN_DIR")"
      echo "  (to train it again from scratch, in a new directory: FRESH=1)"
      return 0 ;;
    unfinished)
      echo "$SFL_RUN_DIR: an interrupted run with these settings; resuming it from its newest checkpoint"
      resume=(--resume) ;;
    new)
      if [ "$SFL_RUN_DIR" != "$base" ]; then
        echo "$base holds a run with other settings (or FRESH=1): kept as it is; training in $SFL_RUN_DIR"
      fi
      [ ! -e "$SFL_RUN_DIR/train_log.jsonl" ] || resume=(--resume) ;;  # a log torn before its header: restart
  esac
  mkdir -p "$SFL_RUN_DIR"
  python -m sfl.experiments.trainer.runs merge "$merged" --set "out_dir=$SFL_RUN_DIR" -o "$SFL_RUN_DIR/config.yaml"
  rm -f "$merged"
  python -m sfl.experiments.trainer.train --config "$SFL_RUN_DIR/config.yaml" ${resume[@]+"${resume[@]}"}
}
