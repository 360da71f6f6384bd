#!/usr/bin/env bash
# Split eval, CPU half: lm-eval's metrics from the loglikelihoods a GPU machine scored (run.sh, EVAL_MODE=split).
# For every results/<EXP>/<run>/<tag>.scores.npz it writes <run>/<tag>.json (the same eval.json a direct lm-eval
# run writes, with per-document scores) and prints dense vs sparse path per run where both were scored.
#   bash experiments/replay.sh [EXP]     # EXP: sparsify_smollm2 (default) or scratch_accuracy; exports the
#                                        # full-set requests if missing
# Env: EVAL_REQUESTS (default .data/eval_requests_all.npz; exported here with --tasks all, no limit, when missing:
# the export is deterministic and the replay checks its digest against the one the scores were made from);
# RESULTS_ROOT (default results).
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE="${SCALE:-gpu}"  # the scored runs are GPU results: RESULTS_ROOT defaults to results/
. experiments/env.sh
. experiments/run_lib.sh
EXP="${1:-sparsify_smollm2}"
REQ="${EVAL_REQUESTS:-${SFL_DATA_DIR:-.data}/eval_requests_all.npz}"
if [ ! -f "$REQ" ]; then
  echo "== exporting the 7 tasks' requests to $REQ"
  python -m sfl.experiments.trainer.evaluate --model "${SFL_DATA_DIR:-.data}/smollm2-135m" --tasks all \
    --export-requests "$REQ" --out "$(mktemp -d)"
fi
n=0
for scores in "$RESULTS_ROOT"/$EXP/*/*.scores.npz; do
  [ -f "$scores" ] || continue
  dir=$(dirname "$scores"); name=$(basename "$scores" .scores.npz)
  if [ -f "$dir/$name.json" ] && [ "$dir/$name.json" -nt "$scores" ]; then continue; fi
  tmp=$(mktemp -d)
  echo "== $(basename "$dir") $name"
  python -m sfl.experiments.trainer.evaluate --replay "$scores" --requests "$REQ" --out "$tmp"
  mv "$tmp/eval.json" "$dir/$name.json"
  rm -rf "$tmp"
  n=$((n + 1))
done
echo "replayed $n score files"
python -m sfl.experiments.trainer.runs compare-paths "$RESULTS_ROOT/$EXP"
python -m sfl.experiments.trainer.runs summarize "$RESULTS_ROOT/$EXP" || true
