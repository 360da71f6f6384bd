#!/usr/bin/env bash
# Activation analysis (paper Figs 6, 7, 10, 11) of three l1_sweep models: the dense ReLU model (L1 = 0 -> Fig 10),
# the sparse run whose active fraction is closest to the paper's recommended 29/5632 (-> Fig 6) and the largest
# L1 (-> Fig 11). Per-layer mean/max non-zeros (+ per-layer FFN ms dense vs TwELL on a GPU: the speed-up share),
# lowest/highest-activity tokens, non-zeros against position, per-neuron firing-frequency histograms.
# Needs the l1_sweep models of the same SCALE (runs/<scale>/l1_sweep/<run>/final): run experiments/l1_sweep first.
#   SCALE=smoke bash experiments/activation_analysis/run.sh   # CPU, 4 K tokens per model, ~1-2 min
#   SCALE=gpu   bash experiments/activation_analysis/run.sh   # one H100: all 165 K val tokens, < 1 min per model
# Output: $RESULTS_ROOT/activation_analysis/{per_layer,tokens,position,neurons}.jsonl (rows of a model replaced on
# rerun). Env: AA_MODELS="run1 run2 ..." picks l1_sweep runs by name instead (figure inferred from L1).
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
sfl_require_gpu
if [ "$SCALE" = gpu ]; then ARGS=(--tokens 1048576 --seq-len 512 --batch 32 --device cuda)
else ARGS=(--tokens 4096 --seq-len 64 --batch 16 --device cpu --no-timing); fi
OUT="$RESULTS_ROOT/activation_analysis"

# "run figure" lines: chosen from the finished l1_sweep runs' logs.
mapfile -t PICKS < <(python - "$RESULTS_ROOT/l1_sweep" "${AA_MODELS:-}" <<'PY'
import math, sys
from pathlib import Path
from sfl.experiments.trainer.runs import run_summary
base, wanted = Path(sys.argv[1]), sys.argv[2].split()
# seed 0 only: the other seeds' runs (relu_l1_<L1>_seed<N>) repeat a configuration, they add no figure
runs = [s for d in sorted(base.glob("relu_l1_*")) if "_seed" not in d.name and (s := run_summary(d)) and s["finished"]] \
    if base.is_dir() else []
if wanted:
    runs = [s for s in runs if s["run"] in wanted]
    for s in runs:
        print(s["run"], "")
    sys.exit(0)
nnz = lambda s: s["val_nnz_mean"] if s["val_nnz_mean"] is not None else s["nnz_mean"]
dense = [s for s in runs if not s["l1_coeff"]]
sparse = [s for s in runs if s["l1_coeff"] and nnz(s) and nnz(s) > 0]
if dense:
    print(dense[0]["run"], "fig10")
if sparse:
    top = max(sparse, key=lambda s: s["l1_coeff"])
    rec = min((s for s in sparse if s is not top), default=None,
              key=lambda s: abs(math.log(nnz(s) / s["intermediate_size"]) - math.log(29 / 5632)))
    if rec:
        print(rec["run"], "fig6")
    print(top["run"], "fig11")
PY
)
if [ ${#PICKS[@]} -eq 0 ]; then
  echo "no finished l1_sweep runs under $RESULTS_ROOT/l1_sweep: run SCALE=$SCALE bash experiments/l1_sweep/run.sh first" >&2
  exit 2
fi
i=0
for line in "${PICKS[@]}"; do
  i=$((i + 1))
  read -r run fig <<< "$line"
  model="$RUNS_ROOT/l1_sweep/$run/final"
  echo "[$i/${#PICKS[@]}] l1_sweep/$run${fig:+ -> $fig}"
  if [ ! -f "$model/config.json" ]; then echo "  no model at $model; skipped" >&2; SFL_FAILED+=("$run"); continue; fi
  python -m sfl.experiments.activation_analysis.analyze --model "$model" --name "l1_sweep/$run" --out "$OUT" \
    "${ARGS[@]}" ${fig:+--figure "$fig"} || SFL_FAILED+=("$run")
done
if [ ${#SFL_FAILED[@]} -gt 0 ]; then echo "FAILED: ${SFL_FAILED[*]}" >&2; exit 1; fi
echo "wrote $OUT/{per_layer,tokens,position,neurons}.jsonl; figures: python -m sfl.notebooks.run_all --only activation_analysis"
