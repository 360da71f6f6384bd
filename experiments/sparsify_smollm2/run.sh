#!/usr/bin/env bash
# Sparsifying SmolLM2-135M (paper Table 1 accuracy columns, Table 6, sparsity-vs-accuracy plot):
# ReLU-fication + L1 fine-tuning at a few L1 values, and the dense ReLU-fied twin (L1 = 0) trained the same
# way; then lm-eval on the 7 tasks, once through the dense MLP (eval.json) and once with the sparse path in
# the loop (eval_sparse.json: mlp_impl=cuda on GPU, the pure-PyTorch TwELL reference on CPU) -- same accuracy.
# On GPU also eval_sparse_forced.json: twell_mode=sparse, every layer through TwELL (auto dispatch runs our
# dense path where the activity is above the crossover, which at these activities is most layers).
#   SCALE=smoke bash experiments/sparsify_smollm2/run.sh   # CPU: 2 runs x 4 steps, lm-eval --limit 5, ~5-8 min
#   SCALE=cpu   bash experiments/sparsify_smollm2/run.sh   # CPU: 2 runs x 40 steps x 256 tokens, --limit 30, ~15 min
#   SCALE=gpu   bash experiments/sparsify_smollm2/run.sh   # one H100: 7 runs x ~2-3 min + eval (full sets)
# Env: L1_VALUES="0 ..." replaces the list; EVAL_LIMIT=N docs per task (EVAL_LIMIT=all: the full sets);
# SPARSE_IMPL=cuda|reference overrides the sparse path. Needs .data/smollm2-135m (python -m sfl.data.prepare).
# EVAL_MODE=direct runs lm-eval here; EVAL_MODE=split (the default where lm-eval is missing, e.g. the GPU
# machine) only scores the requests file EVAL_REQUESTS, exported on a machine with lm-eval by
#   python -m sfl.experiments.trainer.evaluate --model .data/smollm2-135m --tasks all --export-requests R.npz --out /tmp/x
# and experiments/replay.sh then computes the metrics there. RUNS_ROOT / RESULTS_ROOT /
# KEEP_CKPT: run_lib.sh. STEPS="train eval" (default both) selects the steps. SEEDS="0 1 2" fine-tunes every L1 value
# once per seed (the seed sets the data order; seed N > 0 in <run>_seed<N>/; summary_seeds.csv: mean and interval).
# EVAL_PATHS (default "dense sparse forced") picks the scored paths: "dense" alone for seed repeats, whose sparse
# paths the seed-0 runs already compared.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
EXP=sparsify_smollm2
HERE=experiments/$EXP
sfl_require_gpu

if [ ! -f "${SFL_DATA_DIR:-.data}/smollm2-135m/config.json" ]; then
  echo "no .data/smollm2-135m: run 'python -m sfl.data.prepare' first" >&2; exit 2
fi
if [ "$SCALE" = gpu ]; then
  DEFAULT_L1="0 1e-3 3e-3 1e-2 3e-2 1e-1 3e-1"
  EVAL_LIMIT="${EVAL_LIMIT:-all}"
  SPARSE_IMPL="${SPARSE_IMPL:-cuda}"
  DEV_ARGS=(--device cuda --dtype bfloat16)
  EVAL_ARGS=("${DEV_ARGS[@]}" --batch-size 64)
elif [ "$SCALE" = cpu ]; then
  DEFAULT_L1="0 1e-2"
  EVAL_LIMIT="${EVAL_LIMIT:-30}"
  SPARSE_IMPL="${SPARSE_IMPL:-reference}"
  DEV_ARGS=(--device cpu)
  EVAL_ARGS=("${DEV_ARGS[@]}" --batch-size 8)
else
  DEFAULT_L1="0 3e-3"
  EVAL_LIMIT="${EVAL_LIMIT:-5}"
  SPARSE_IMPL="${SPARSE_IMPL:-reference}"
  DEV_ARGS=(--device cpu)
  EVAL_ARGS=("${DEV_ARGS[@]}" --batch-size 8)
fi
read -r -a L1S <<< "${L1_VALUES:-$DEFAULT_L1}"
read -r -a SEED_LIST <<< "${SEEDS:-0}"
STEPS="${STEPS:-train eval}"
EVAL_PATHS=" ${EVAL_PATHS:-dense sparse forced} "
EVAL_MODE="${EVAL_MODE:-auto}"
if [ "$EVAL_MODE" = auto ]; then
  if python -c "import lm_eval" 2>/dev/null; then EVAL_MODE=direct; else EVAL_MODE=split; fi
fi
case "$EVAL_MODE" in
  direct) ;;
  split)
    if [ -z "${EVAL_REQUESTS:-}" ] || [ ! -f "$EVAL_REQUESTS" ]; then
      echo "EVAL_MODE=split (no lm-eval here) needs EVAL_REQUESTS=<requests.npz>, exported where lm-eval runs:" >&2
      echo "  python -m sfl.experiments.trainer.evaluate --model .data/smollm2-135m --tasks all [--limit N] --export-requests R.npz --out /tmp/x" >&2
      exit 2
    fi ;;
  *) echo "EVAL_MODE=$EVAL_MODE: choose auto, direct or split" >&2; exit 2 ;;
esac
LIMIT_ARGS=(); [ "$EVAL_LIMIT" = all ] || LIMIT_ARGS=(--limit "$EVAL_LIMIT")

echo "== $EXP, SCALE=$SCALE: L1 values ${L1S[*]} (l1_reduction=sum); eval $EVAL_MODE, limit $EVAL_LIMIT, sparse path $SPARSE_IMPL"
# run_name L1 SEED: the historical names for seed 0, a _seed<N> suffix otherwise
run_name() {
  local base; if [ "$1" = 0 ]; then base=dense_relu_l1_0; else base="sparse_l1_$1"; fi
  if [ "${2:-0}" = 0 ]; then echo "$base"; else echo "${base}_seed$2"; fi
}
RUNS=()  # "L1 SEED" pairs, in training order
for seed in "${SEED_LIST[@]}"; do for l1 in "${L1S[@]}"; do RUNS+=("$l1 $seed"); done; done
if [[ " $STEPS " == *" train "* ]]; then
  i=0
  for pair in "${RUNS[@]}"; do
    read -r l1 seed <<< "$pair"
    i=$((i + 1))
    sfl_train "$EXP" "$(run_name "$l1" "$seed")" "$i" "${#RUNS[@]}" "$HERE/$SCALE.yaml" -- "l1_coeff=$l1" \
      "init_from=${SFL_DATA_DIR:-.data}/smollm2-135m" "seed=$seed"
  done
fi
if [[ " $STEPS " == *" eval "* ]] && [ "$EVAL_MODE" = split ]; then
  echo "== split eval: scoring $EVAL_REQUESTS (its tasks and limit), dense path and sparse path $SPARSE_IMPL;"
  echo "   metrics: experiments/replay.sh where lm-eval runs"
  for pair in "${RUNS[@]}"; do
    read -r l1 seed <<< "$pair"
    run=$(run_name "$l1" "$seed")
    [[ $EVAL_PATHS != *" dense "* ]] || sfl_score "$EXP" "$run" eval "$EVAL_REQUESTS" --mlp-impl dense "${DEV_ARGS[@]}"
    [[ $EVAL_PATHS != *" sparse "* ]] ||
      sfl_score "$EXP" "$run" eval_sparse "$EVAL_REQUESTS" --mlp-impl "$SPARSE_IMPL" "${DEV_ARGS[@]}"
    if [ "$SPARSE_IMPL" = cuda ] && [[ $EVAL_PATHS == *" forced "* ]]; then  # every layer through TwELL
      sfl_score "$EXP" "$run" eval_sparse_forced "$EVAL_REQUESTS" --mlp-impl cuda --twell-mode sparse "${DEV_ARGS[@]}"
    fi
  done
  sfl_finish "$EXP"
  exit 0
fi
if [[ " $STEPS " == *" eval "* ]]; then
  echo "== lm-eval, 7 tasks: dense path (eval.json) and sparse path $SPARSE_IMPL (eval_sparse.json)"
  for pair in "${RUNS[@]}"; do
    read -r l1 seed <<< "$pair"
    run=$(run_name "$l1" "$seed")
    [[ $EVAL_PATHS != *" dense "* ]] ||
      sfl_eval "$EXP" "$run" eval --mlp-impl dense ${LIMIT_ARGS[@]+"${LIMIT_ARGS[@]}"} "${EVAL_ARGS[@]}"
    [[ $EVAL_PATHS != *" sparse "* ]] ||
      sfl_eval "$EXP" "$run" eval_sparse --mlp-impl "$SPARSE_IMPL" ${LIMIT_ARGS[@]+"${LIMIT_ARGS[@]}"} "${EVAL_ARGS[@]}"
    if [ "$SPARSE_IMPL" = cuda ] && [[ $EVAL_PATHS == *" forced "* ]]; then
      sfl_eval "$EXP" "$run" eval_sparse_forced --mlp-impl cuda --twell-mode sparse \
        ${LIMIT_ARGS[@]+"${LIMIT_ARGS[@]}"} "${EVAL_ARGS[@]}"
    fi
  done
fi
# The two paths must agree: print the per-run accuracy difference (the notebook tabulates it too).
python -m sfl.experiments.trainer.runs compare-paths "$RESULTS_ROOT/$EXP" || true
sfl_finish "$EXP"
