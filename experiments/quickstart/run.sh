#!/usr/bin/env bash
# The main job, end to end on a fresh machine: environment, offline data, a tiny sparse model trained from
# scratch (GPU if present, else CPU), lm-eval on the 7 tasks with a small --limit, the quickstart figure.
# Outputs, all in the run directory runs/quickstart/ (git-ignored): checkpoints with from_pretrained copies in
# hf/, the final model, eval_limit<N>/, and results/ with quickstart/{train_log.jsonl,eval.json} and the figure
# and tables (results/figures/quickstart_loss_nnz.png, results/paper_tables/). Nothing tracked is touched.
# --record: also copy the log and eval into results/quickstart/ and regenerate figures/ and paper_tables/
# from them (the logs of record: only when you mean to replace them).
# Other arguments go to train.py as --set overrides (e.g. max_steps=50).
#
# Re-running it (README "Quick start"): with the same settings, a finished run is reported and not retrained,
# and its evaluation is reused; an interrupted run resumes from its newest checkpoint. Other settings train
# in a new directory (runs/quickstart-2, -3, ...), as does FRESH=1. Nothing finished is deleted or overwritten;
# the run directory's results/ (and, with --record, results/quickstart/ and the figure) are rewritten from the
# run used.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
limit="${QUICKSTART_EVAL_LIMIT:-20}"
record=0 overrides=()
for arg in "$@"; do
  if [ "$arg" = --record ]; then record=1; else overrides+=("$arg"); fi
done

echo "== [1/4] offline data (idempotent: verified and skipped when already prepared)"
python -m sfl.data.prepare

echo "== [2/4] train"
sfl_train_rerunnable runs/quickstart experiments/quickstart/config.yaml "${FRESH:-0}" ${overrides[@]+"${overrides[@]}"}
run="$SFL_RUN_DIR"

echo "== [3/4] evaluate (lm-eval, 7 tasks, limit $limit)"
evaluated="$run/eval_limit$limit"
if [ -f "$evaluated/eval.json" ]; then
  echo "$evaluated/eval.json: this model was evaluated before with limit $limit; reused"
else
  tmp="$run/.tmp-eval_limit$limit.$$"  # moved into place when complete (a kill never leaves a partial eval)
  rm -rf "$tmp"
  python -m sfl.experiments.trainer.evaluate --model "$run/final" --tasks all --limit "$limit" --batch-size 16 --out "$tmp"
  mv "$tmp" "$evaluated"
fi
mine="$run/results"  # this run's logs, in the results layout the notebooks read
mkdir -p "$mine/quickstart"
cp "$run/train_log.jsonl" "$mine/quickstart/train_log.jsonl"
cp "$evaluated/eval.json" "$mine/quickstart/eval.json"

echo "== [4/4] figure"
python -m sfl.notebooks.run_all --only quickstart --results "$mine"
if [ "$record" = 1 ]; then
  mkdir -p results/quickstart
  cp "$mine/quickstart/train_log.jsonl" "$mine/quickstart/eval.json" results/quickstart/
  python -m sfl.notebooks.run_all --only quickstart
  echo "recorded: results/quickstart/, figures/quickstart_loss_nnz.png, paper_tables/quickstart_*"
fi
echo "done: $run; figure $mine/figures/quickstart_loss_nnz.png, tables $mine/paper_tables/"
