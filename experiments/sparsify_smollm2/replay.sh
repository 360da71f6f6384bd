#!/usr/bin/env bash
# Split eval, CPU half: lm-eval's metrics from the loglikelihoods a GPU machine scored (run.sh, EVAL_MODE=split).
# For every results/sparsify_smollm2/<run>/{eval,eval_sparse}.scores.npz it writes <run>/{eval,eval_sparse}.json
# (the same eval.json a direct lm-eval run writes) and prints dense vs sparse per run.
#   bash experiments/sparsify_smollm2/replay.sh                     # exports the full-set requests if missing
# Env: EVAL_REQUESTS (default .data/eval_requests_all.npz; exported here with --tasks all, no limit, when missing:
# the export is deterministic and the replay checks its digest against the one the scores were made from);
# RESULTS_ROOT (default results).
set -euo pipefail
cd "$(dirname "$0")/../.."
SCALE="${SCALE:-gpu}"  # the scored runs are GPU results: RESULTS_ROOT defaults to results/
. experiments/env.sh
. experiments/run_lib.sh
EXP=sparsify_smollm2
REQ="${EVAL_REQUESTS:-${SFL_DATA_DIR:-.data}/eval_requests_all.npz}"
if [ ! -f "$REQ" ]; then
  echo "== exporting the 7 tasks' requests to $REQ"
  python -m experiments.evaluate --model "${SFL_DATA_DIR:-.data}/smollm2-135m" --tasks all \
    --export-requests "$REQ" --out "$(mktemp -d)"
fi
n=0
for scores in "$RESULTS_ROOT"/$EXP/*/*.scores.npz; do
  [ -f "$scores" ] || continue
  dir=$(dirname "$scores"); name=$(basename "$scores" .scores.npz)
  if [ -f "$dir/$name.json" ] && [ "$dir/$name.json" -nt "$scores" ]; then continue; fi
  tmp=$(mktemp -d)
  echo "== $(basename "$dir") $name"
  python -m experiments.evaluate --replay "$scores" --requests "$REQ" --out "$tmp"
  mv "$tmp/eval.json" "$dir/$name.json"
  rm -rf "$tmp"
  n=$((n + 1))
done
echo "replayed $n score files"
python - "$RESULTS_ROOT/$EXP" <<'PY'
import json, sys
from pathlib import Path
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if (p / "eval.json").is_file() and (p / "eval_sparse.json").is_file()):
    a, b = (json.loads((d / f).read_text()) for f in ("eval.json", "eval_sparse.json"))
    diffs = {t: b["tasks"][t]["acc"] - a["tasks"][t]["acc"] for t in a["tasks"] if t in b["tasks"]}
    worst = max(diffs.items(), key=lambda kv: abs(kv[1]))
    print(f"{d.name}: mean acc dense {100 * a['mean_acc']:.2f} vs sparse {100 * b['mean_acc']:.2f} "
          f"(largest per-task change {worst[0]} {100 * worst[1]:+.2f} points); nnz/token {a['nnz_per_token_mean']:.1f}")
PY
python -m experiments.runs summarize "$RESULTS_ROOT/$EXP" || true
