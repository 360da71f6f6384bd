#!/usr/bin/env bash
# L1 sweep (paper Figs 2, 3, 9; Table 3): from-scratch sparse ReLU-gated models at several L1 values, from
# L1 = 0 (the dense ReLU baseline) up to where fewer than one neuron per token stays active, plus a dense
# SiLU baseline (train.py's `activation: silu`).
#   SCALE=smoke bash experiments/l1_sweep/run.sh   # CPU, 4 L1 values + SiLU, ~3 min on 2 cores (CI)
#   SCALE=gpu   bash experiments/l1_sweep/run.sh   # one H100: 8 L1 values + SiLU, ~30-60 s per run
# Env: L1_VALUES="0 1e-4 ... silu" replaces the list of points (an L1 value, or `silu`: the SiLU baseline);
# SEEDS="0 1 2" trains every point with each seed (seed 0 in relu_l1_<L1>/, seed N in relu_l1_<L1>_seed<N>/;
# summary_seeds.csv then holds mean and 95% interval per point);
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
  DEFAULT_POINTS="0 3e-5 1e-4 3e-4 1e-3 3e-3 1e-2 3e-2 silu"
  EVAL_ARGS=(--device cuda --dtype bfloat16 --batch-size 64)
else
  DEFAULT_POINTS="0 1e-3 1e-2 1e-1 silu"
  EVAL_ARGS=(--device cpu --batch-size 16)
fi
read -r -a POINT_LIST <<< "${L1_VALUES:-$DEFAULT_POINTS}"
read -r -a SEED_LIST <<< "${SEEDS:-0}"
EVAL_LIMIT="${EVAL_LIMIT:-0}"
suffix() { [ "$1" = 0 ] && echo "" || echo "_seed$1"; }  # seed 0 keeps the historical directory names
run_name() { if [ "$1" = silu ]; then echo "silu_dense$(suffix "$2")"; else echo "relu_l1_$1$(suffix "$2")"; fi; }

total=$(( ${#POINT_LIST[@]} * ${#SEED_LIST[@]} ))
echo "== $EXP, SCALE=$SCALE: points ${POINT_LIST[*]} (L1 with l1_reduction=sum; silu = the dense SiLU baseline)," \
     "seeds ${SEED_LIST[*]}"
i=0
for seed in "${SEED_LIST[@]}"; do
  for p in "${POINT_LIST[@]}"; do
    i=$((i + 1))
    if [ "$p" = silu ]; then
      sfl_train "$EXP" "$(run_name "$p" "$seed")" "$i" "$total" "$HERE/$SCALE.yaml" "$HERE/silu.yaml" -- "seed=$seed"
    else
      sfl_train "$EXP" "$(run_name "$p" "$seed")" "$i" "$total" "$HERE/$SCALE.yaml" -- "l1_coeff=$p" "seed=$seed"
    fi
  done
done

if [ "$EVAL_LIMIT" != 0 ]; then
  echo "== lm-eval (7 tasks, limit $EVAL_LIMIT) per run"
  for seed in "${SEED_LIST[@]}"; do
    for p in "${POINT_LIST[@]}"; do
      impl=(--mlp-impl dense); [ "$p" != silu ] || impl=()
      sfl_eval "$EXP" "$(run_name "$p" "$seed")" eval --limit "$EVAL_LIMIT" ${impl[@]+"${impl[@]}"} "${EVAL_ARGS[@]}"
    done
  done
fi

# The sweep is meant to end below one active neuron per token; say so when it does not.
L1S=(); for p in "${POINT_LIST[@]}"; do [ "$p" = silu ] || L1S+=("$p"); done
[ ${#L1S[@]} -gt 0 ] && last="$RESULTS_ROOT/$EXP/relu_l1_${L1S[-1]}" || last=/nonexistent
python - "$last" <<'PY' || true
import json, sys
from sfl.experiments.trainer.runs import run_summary
from pathlib import Path
s = run_summary(Path(sys.argv[1]))
if s:
    nnz = s["val_nnz_mean"] if s["val_nnz_mean"] is not None else s["nnz_mean"]
    verdict = "below 1: the sweep spans dense to <1 neuron/token" if nnz is not None and nnz < 1 else \
        "NOT below 1: extend L1_VALUES with a larger value and rerun (finished runs are skipped)"
    print(f"largest L1 ({s['l1_coeff']}): {nnz:.3g} non-zeros per token -- {verdict}")
PY
sfl_finish "$EXP"
