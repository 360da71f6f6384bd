#!/usr/bin/env bash
# The main job, end to end on a fresh machine: environment, offline data, a tiny sparse model trained from
# scratch (GPU if present, else CPU), lm-eval on the 7 tasks with a small --limit, the quickstart figure.
# ~10-15 min on 2 CPU cores the first time (data preparation included), ~6 min after.
# Outputs: runs/quickstart/ (checkpoints, final model), results/quickstart/{train_log.jsonl,eval.json},
# figures/quickstart_loss_nnz.png.  Extra arguments go to train.py as --set overrides (e.g. max_steps=50).
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
export SFL_GIT_COMMIT="${SFL_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
limit="${QUICKSTART_EVAL_LIMIT:-20}"

echo "== [1/4] offline data (idempotent: verified and skipped when already prepared)"
python -m sfl.data.prepare

echo "== [2/4] train"
extra=(); for kv in "$@"; do extra+=(--set "$kv"); done
python -m sfl.experiments.train --config experiments/quickstart/config.yaml "${extra[@]}"

echo "== [3/4] evaluate (lm-eval, 7 tasks, limit $limit)"
mkdir -p results/quickstart
cp runs/quickstart/train_log.jsonl results/quickstart/train_log.jsonl
python -m sfl.experiments.evaluate --model runs/quickstart/final --tasks all --limit "$limit" \
  --batch-size 16 --out results/quickstart

echo "== [4/4] figure"
python -m sfl.notebooks.run_all --only quickstart
echo "done: results/quickstart/, figures/quickstart_loss_nnz.png"
