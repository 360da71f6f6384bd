#!/usr/bin/env bash
# Accuracy parity from scratch (the paper's setting: sparse models trained from scratch, not
# sparsified later): a dense ReLU model (L1 = 0) and L1 models of the same size, data and budget, each with several
# seeds, scored on the 7 tasks (full sets), and the change in mean accuracy against the dense arm with a paired
# bootstrap interval over documents (each document's score averaged over the seeds of its arm).
#   SCALE=smoke bash experiments/scratch_accuracy/run.sh   # CPU: tiny model, lm-eval --limit 5 (pipeline only)
#   SCALE=gpu   bash experiments/scratch_accuracy/run.sh   # one H100: 151 M-parameter models, ~2-3 min per run
# Env: L1_VALUES (default gpu "0 1e-3", smoke "0 1e-2"; 0 is the dense arm and must be there); SEEDS (default
# "0 1"; seed N > 0 in <run>_seed<N>/); STEPS (default "train eval compare"); EVAL_LIMIT (gpu: all, smoke: 5);
# EVAL_MODE direct | split | auto (split where lm-eval is missing, e.g. the GPU machine: scores the requests file
# EVAL_REQUESTS; then, where lm-eval runs, `bash experiments/replay.sh scratch_accuracy` and
# `STEPS=compare SCALE=gpu bash experiments/scratch_accuracy/run.sh`). RUNS_ROOT / RESULTS_ROOT / KEEP_CKPT: run_lib.sh.
# Output: $RESULTS_ROOT/scratch_accuracy/<run>/{train_log.jsonl,eval.json}, summary.csv, summary_seeds.csv and
# paired_l1_<L1>.json (the change against the dense arm, per task and mean, with its 95% interval).
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
EXP=scratch_accuracy
HERE=experiments/$EXP
if [ "$SCALE" = gpu ]; then
  DEFAULT_L1="0 1e-3"; EVAL_LIMIT="${EVAL_LIMIT:-all}"; DEV_ARGS=(--device cuda --dtype bfloat16 --batch-size 64)
else
  DEFAULT_L1="0 1e-2"; EVAL_LIMIT="${EVAL_LIMIT:-5}"; DEV_ARGS=(--device cpu --batch-size 8)
fi
read -r -a L1S <<< "${L1_VALUES:-$DEFAULT_L1}"
read -r -a SEED_LIST <<< "${SEEDS:-0 1}"
STEPS="${STEPS:-train eval compare}"
EVAL_MODE="${EVAL_MODE:-auto}"
if [ "$EVAL_MODE" = auto ]; then
  if python -c "import lm_eval" 2>/dev/null; then EVAL_MODE=direct; else EVAL_MODE=split; fi
fi
[[ " ${L1S[*]} " == *" 0 "* ]] || { echo "L1_VALUES must hold 0 (the dense arm)" >&2; exit 2; }
[[ " $STEPS " != *" train "* && " $STEPS " != *" eval "* ]] || sfl_require_gpu
LIMIT_ARGS=(); [ "$EVAL_LIMIT" = all ] || LIMIT_ARGS=(--limit "$EVAL_LIMIT")
run_name() { if [ "$2" = 0 ]; then echo "relu_l1_$1"; else echo "relu_l1_$1_seed$2"; fi; }

echo "== $EXP, SCALE=$SCALE: L1 ${L1S[*]} x seeds ${SEED_LIST[*]}; steps $STEPS; eval $EVAL_MODE, limit $EVAL_LIMIT"
if [[ " $STEPS " == *" train "* ]]; then
  i=0 total=$(( ${#L1S[@]} * ${#SEED_LIST[@]} ))
  for seed in "${SEED_LIST[@]}"; do
    for l1 in "${L1S[@]}"; do
      i=$((i + 1))
      sfl_train "$EXP" "$(run_name "$l1" "$seed")" "$i" "$total" "$HERE/$SCALE.yaml" -- "l1_coeff=$l1" "seed=$seed"
    done
  done
fi
if [[ " $STEPS " == *" eval "* ]]; then
  if [ "$EVAL_MODE" = split ] && { [ -z "${EVAL_REQUESTS:-}" ] || [ ! -f "$EVAL_REQUESTS" ]; }; then
    echo "EVAL_MODE=split (no lm-eval here) needs EVAL_REQUESTS=<requests.npz>, exported where lm-eval runs:" \
         "python -m sfl.experiments.trainer.evaluate --model <any model dir> --tasks all --export-requests R.npz --out /tmp/x" >&2
    exit 2
  fi
  for seed in "${SEED_LIST[@]}"; do
    for l1 in "${L1S[@]}"; do
      if [ "$EVAL_MODE" = split ]; then
        sfl_score "$EXP" "$(run_name "$l1" "$seed")" eval "$EVAL_REQUESTS" --mlp-impl dense "${DEV_ARGS[@]}"
      else
        sfl_eval "$EXP" "$(run_name "$l1" "$seed")" eval --mlp-impl dense ${LIMIT_ARGS[@]+"${LIMIT_ARGS[@]}"} \
          "${DEV_ARGS[@]}"
      fi
    done
  done
fi
if [[ " $STEPS " == *" compare "* ]]; then
  evals() { local s out=(); for s in "${SEED_LIST[@]}"; do out+=("$RESULTS_ROOT/$EXP/$(run_name "$1" "$s")/eval.json"); done
            (IFS=,; echo "${out[*]}"); }
  for l1 in "${L1S[@]}"; do
    [ "$l1" != 0 ] || continue
    echo "== L1 $l1 vs dense, mean over seeds ${SEED_LIST[*]} per document"
    python -m sfl.experiments.trainer.paired_eval "$(evals 0)" "$(evals "$l1")" --json "$RESULTS_ROOT/$EXP/paired_l1_$l1.json" \
      || SFL_FAILED+=("compare:$l1")
  done
fi
sfl_finish "$EXP"
