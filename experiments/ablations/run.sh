#!/usr/bin/env bash
# Ablations (paper Tables 4, 5; Fig. 8) at small scale, over the l1_sweep model and budget:
#   gating/        gated vs non-gated FFN (equal parameters) at L1 = 0 and two sparse L1 values (A < B, matched by
#                  rank to the paper's 2e-5 and 3e-5);
#   dead_neurons/  dense, standard (L1 = A), sparsity warm-up (L1 = B, ramped in after 1/6 of training) and, once
#                  train.py supports it, dead-neuron re-initialisation (paper Eq. 6, lambda 0.1) at L1 = A.
# Gated runs identical to an l1_sweep run are reused (log copied, model linked) instead of retrained.
#   SCALE=smoke bash experiments/ablations/run.sh   # CPU, ~2-3 min (less when l1_sweep smoke ran before)
#   SCALE=gpu   bash experiments/ablations/run.sh   # one H100, ~30-60 s per new run (4-5 new runs)
# Env: ABL_GROUPS="gating dead_neurons" (the default: both) picks the groups; ABL_L1="A B" (default: smoke 1e-2 1e-1, gpu 1e-3 3e-3 -- set them to the l1_sweep values whose activity
# brackets ~0.5% of N); SEEDS="0 1 2" repeats every run per seed (<run>_seed<N>; the gated ones reuse the l1_sweep
# run of that seed); EVAL_LIMIT=N adds lm-eval; RUNS_ROOT / RESULTS_ROOT / KEEP_CKPT: run_lib.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
HERE=experiments/ablations
BASE=experiments/l1_sweep/$SCALE.yaml
sfl_require_gpu

if [ "$SCALE" = gpu ]; then
  DEFAULT_ABL="1e-3 3e-3"; N_NONGATED=3072; WARM=(l1_warmup_start=100 l1_warmup_steps=100)
  EVAL_ARGS=(--device cuda --dtype bfloat16 --batch-size 64)
else
  DEFAULT_ABL="1e-2 1e-1"; N_NONGATED=384; WARM=(l1_warmup_start=3 l1_warmup_steps=3)
  EVAL_ARGS=(--device cpu --batch-size 16)
fi
read -r A B <<< "${ABL_L1:-$DEFAULT_ABL}"
EVAL_LIMIT="${EVAL_LIMIT:-0}"

# train_or_reuse GROUP RUN IDX TOTAL L1 [override.yaml ...]; extra key=values in EXTRA_SETS; the seed is $SEED (run
# names get a _seed<N> suffix for N > 0). A run with nothing but l1_coeff (and the seed) changed is the l1_sweep run
# of the same L1 and seed when that one has finished: its log is copied (with REUSED_FROM.txt saying so) and its
# model linked where this machine has it.
train_or_reuse() {
  local group=$1 run=$2 idx=$3 total=$4 l1=$5 sfx=""
  shift 5
  [ "$SEED" = 0 ] || sfx="_seed$SEED"
  run="$run$sfx"
  local src="l1_sweep/relu_l1_$l1$sfx"
  local src_res="$RESULTS_ROOT/$src" src_model="$RUNS_ROOT/$src/final"
  local dst_res="$RESULTS_ROOT/ablations/$group/$run" dst_out="$RUNS_ROOT/ablations/$group/$run"
  if [ $# -eq 0 ] && [ ${#EXTRA_SETS[@]} -eq 0 ] && python -m sfl.experiments.trainer.runs done "$src_res"; then
    sfl_reuse_log "$src_res" "$dst_res" "same config as $src (only l1_coeff and the seed differ from the defaults): log copied by experiments/ablations/run.sh"
    mkdir -p "$dst_out"
    [ ! -f "$src_model/config.json" ] || ln -sfn "$(cd "$src_model" && pwd)" "$dst_out/final"
    echo "[$idx/$total] ablations/$group/$run: same config as $src -- reused its log"
    return 0
  fi
  local seed_set=(); [ "$SEED" = 0 ] || seed_set=("seed=$SEED")
  sfl_train "ablations/$group" "$run" "$idx" "$total" "$BASE" "$@" -- "l1_coeff=$l1" \
    ${EXTRA_SETS[@]+"${EXTRA_SETS[@]}"} ${seed_set[@]+"${seed_set[@]}"}
}

echo "== ablations, SCALE=$SCALE: sparse L1 A=$A B=$B (l1_reduction=sum); non-gated N=$N_NONGATED"
read -r -a GROUP_LIST <<< "${ABL_GROUPS:-gating dead_neurons}"
wants() { [[ " ${GROUP_LIST[*]} " == *" $1 "* ]]; }
read -r -a SEED_LIST <<< "${SEEDS:-0}"
for SEED in "${SEED_LIST[@]}"; do
if wants gating; then
EXTRA_SETS=()
train_or_reuse gating gated_dense_l1_0 1 6 0
train_or_reuse gating "gated_l1_$A" 2 6 "$A"
train_or_reuse gating "gated_l1_$B" 3 6 "$B"
EXTRA_SETS=("intermediate_size=$N_NONGATED")
train_or_reuse gating nongated_dense_l1_0 4 6 0 "$HERE/nongated.yaml"
train_or_reuse gating "nongated_l1_$A" 5 6 "$A" "$HERE/nongated.yaml"
train_or_reuse gating "nongated_l1_$B" 6 6 "$B" "$HERE/nongated.yaml"
fi

if wants dead_neurons; then
EXTRA_SETS=()
n=4
train_or_reuse dead_neurons dense_l1_0 1 "$n" 0
train_or_reuse dead_neurons "standard_l1_$A" 2 "$n" "$A"
EXTRA_SETS=("${WARM[@]}")
train_or_reuse dead_neurons "warmup_l1_$B" 3 "$n" "$B" "$HERE/warmup.yaml"
EXTRA_SETS=("dead_reinit_lambda=0.1")
train_or_reuse dead_neurons "reinit_l1_$A" 4 "$n" "$A"
fi
done

if [ "$EVAL_LIMIT" != 0 ]; then
  echo "== lm-eval (7 tasks, limit $EVAL_LIMIT)"
  for d in "$RUNS_ROOT"/ablations/*/*/; do
    rel=${d#"$RUNS_ROOT"/}; rel=${rel%/}
    sfl_eval "$(dirname "$rel")" "$(basename "$rel")" eval --limit "$EVAL_LIMIT" --mlp-impl dense "${EVAL_ARGS[@]}"
  done
fi
sfl_finish ablations/gating || true
sfl_finish ablations/dead_neurons
