#!/usr/bin/env bash
# Training equivalence: the l1_sweep model trained through our sparse training op (mlp_impl cuda: TwELL forward,
# sparse backward) against the same run through dense PyTorch (mlp_impl dense), same L1, seed and data order.
# The dense side is the l1_sweep run of that L1 and seed (its log is copied, with REUSED_FROM.txt); it is trained
# here only when l1_sweep has not run it. Equal within seed noise = the kernels train the same model.
#   SCALE=smoke bash experiments/train_equivalence/run.sh   # CPU: mlp_impl reference (the pure-PyTorch TwELL op)
#   SCALE=gpu   bash experiments/train_equivalence/run.sh   # one H100: mlp_impl cuda, ~1 min per run
# Env: L1 (default gpu 3e-3, smoke 1e-2); SEEDS="0 1 2" (seed N > 0 in <run>_seed<N>/); RUNS_ROOT / RESULTS_ROOT /
# KEEP_CKPT: experiments/run_lib.sh. Output: $RESULTS_ROOT/train_equivalence/{dense,<impl>}_l1_<L1>[_seed<N>]/,
# summary.csv and (with >= 2 seeds) summary_seeds.csv.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
EXP=train_equivalence
BASE=experiments/l1_sweep/$SCALE.yaml
sfl_require_gpu
if [ "$SCALE" = gpu ]; then L1="${L1:-3e-3}"; IMPL=cuda; else L1="${L1:-1e-2}"; IMPL=reference; fi
read -r -a SEED_LIST <<< "${SEEDS:-0}"
suffix() { [ "$1" = 0 ] && echo "" || echo "_seed$1"; }

echo "== $EXP, SCALE=$SCALE: L1 $L1, mlp_impl $IMPL vs dense, seeds ${SEED_LIST[*]}"
total=$(( 2 * ${#SEED_LIST[@]} )) i=0
for seed in "${SEED_LIST[@]}"; do
  i=$((i + 1))
  dense="dense_l1_$L1$(suffix "$seed")" src="$RESULTS_ROOT/l1_sweep/relu_l1_$L1$(suffix "$seed")"
  if python -m sfl.experiments.trainer.runs done "$src" && ! python -m sfl.experiments.trainer.runs done "$RESULTS_ROOT/$EXP/$dense"; then
    sfl_reuse_log "$src" "$RESULTS_ROOT/$EXP/$dense" \
      "same config as l1_sweep/$(basename "$src"): log copied by experiments/train_equivalence/run.sh"
    echo "[$i/$total] $EXP/$dense: the l1_sweep run of the same config -- reused its log"
  else
    sfl_train "$EXP" "$dense" "$i" "$total" "$BASE" -- "l1_coeff=$L1" "seed=$seed" "mlp_impl=dense"
  fi
  i=$((i + 1))
  sfl_train "$EXP" "${IMPL}_l1_$L1$(suffix "$seed")" "$i" "$total" "$BASE" -- "l1_coeff=$L1" "seed=$seed" "mlp_impl=$IMPL"
done
sfl_finish "$EXP"
