#!/usr/bin/env bash
# L1 sweep (paper Figs 2, 3, 9; Table 3): from-scratch sparse ReLU-gated models at several L1 values, from
# L1 = 0 (the dense ReLU baseline) up to where fewer than one neuron per token stays active, plus a dense
# SiLU baseline (train.py's `activation: silu`).
#   SCALE=smoke bash experiments/l1_sweep/run.sh   # CPU, 4 L1 values + SiLU, ~3 min on 2 cores (CI)
#   SCALE=gpu   bash experiments/l1_sweep/run.sh   # one H100: 8 L1 values + SiLU, ~30-60 s per run
# Env: L1_VALUES="0 1e-4 ..." replaces the list; SEEDS="0 1 2" trains every point with each seed (seed 0 in
# relu_l1_<L1>/, seed N in relu_l1_<L1>_seed<N>/; summary_seeds.csv then holds mean and 95% interval per point);
# EVAL_LIMIT=N adds lm-eval (7 tasks, N docs each) per run;
# RUNS_ROOT / RESULTS_ROOT / KEEP_CKPT: see experiments/run_lib.sh. Resumable: finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
EXP=l1_sweep
HERE=experiments/$EXP
sfl_require_gpu

if [ "$SCALE" = gpu ]; then
  DEFAULT_L1="0 3e-5 1e-4 3e-4 1e-3 3e-3 1e-2 3e-2"
  EVAL_ARGS=(--device cuda --dtype bfloat16 --batch-size 64)
else
  DEFAULT_L1="0 1e-3 1e-2 1e-1"
  EVAL_ARGS=(--device cpu --batch-size 16)
fi
read -r -a L1S <<< "${L1_VALUES:-$DEFAULT_L1}"
read -r -a SEED_LIST <<< "${SEEDS:-0}"
EVAL_LIMIT="${EVAL_LIMIT:-0}"
suffix() { [ "$1" = 0 ] && echo "" || echo "_seed$1"; }  # seed 0 keeps the historical directory names

total=$(( (${#L1S[@]} + 1) * ${#SEED_LIST[@]} ))
echo "== $EXP, SCALE=$SCALE: ${#L1S[@]} L1 values (${L1S[*]}, l1_reduction=sum) + the SiLU baseline," \
     "seeds ${SEED_LIST[*]}"
i=0
for seed in "${SEED_LIST[@]}"; do
  for l1 in "${L1S[@]}"; do
    i=$((i + 1))
    sfl_train "$EXP" "relu_l1_$l1$(suffix "$seed")" "$i" "$total" "$HERE/$SCALE.yaml" -- "l1_coeff=$l1" "seed=$seed"
  done
  i=$((i + 1))
  sfl_train "$EXP" "silu_dense$(suffix "$seed")" "$i" "$total" "$HERE/$SCALE.yaml" "$HERE/silu.yaml" -- "seed=$seed"
done

if [ "$EVAL_LIMIT" != 0 ]; then
  echo "== lm-eval (7 tasks, limit $EVAL_LIMIT) per run"
  for seed in "${SEED_LIST[@]}"; do
    for l1 in "${L1S[@]}"; do
      sfl_eval "$EXP" "relu_l1_$l1$(suffix "$seed")" eval --limit "$EVAL_LIMIT" --mlp-impl dense "${EVAL_ARGS[@]}"
    done
    sfl_eval "$EXP" "silu_dense$(suffix "$seed")" eval --limit "$EVAL_LIMIT" "${EVAL_ARGS[@]}"
  done
fi

# The sweep is meant to end below one active neuron per token; say so when it does not.
last="$RESULTS_ROOT/$EXP/relu_l1_${L1S[-1]}"
python - "$last" <<'PY' || true
import json, sys
from sfl.experiments.runs import run_summary
from pathlib import Path
s = run_summary(Path(sys.argv[1]))
if s:
    nnz = s["val_nnz_mean"] if s["val_nnz_mean"] is not None else s["nnz_mean"]
    verdict = "below 1: the sweep spans dense to <1 neuron/token" if nnz is not None and nnz < 1 else \
        "NOT below 1: extend L1_VALUES with a larger value and rerun (finished runs are skipped)"
    print(f"largest L1 ({s['l1_coeff']}): {nnz:.3g} non-zeros per token -- {verdict}")
PY
sfl_finish "$EXP"
