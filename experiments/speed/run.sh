#!/usr/bin/env bash
# Speed, energy and memory, dense vs sparse (paper Table 1 efficiency columns; Figs 4, 5). GPU only.
#   (b) the paper's shapes: hidden 2048, N 5632, 32 heads, 8/18/28/38 layers (0.5B/1B/1.5B/2B), random weights with
#       gates calibrated to the paper's mean non-zeros per token at L1 = 2e-5 (39/34*/29/24; *1B interpolated) with
#       a per-layer profile and a heavy tail; inference at 32 x 2048 tokens, decoder core and whole model (lm_head).
#       Training at these shapes is part (c): bench.py's own training rows are withdrawn (experiments/speed/README.md).
#   Dense and sparse are timed in interleaved blocks (ABBA..., --blocks per side; median block reported, spread and
#   per-pair ratios logged), and the paper-shape gates are calibrated on the timed tokens themselves.
#   (a) every trained model found under runs/gpu/{l1_sweep,ablations/*,sparsify_smollm2}/<run>/final, on validation
#       tokens (64 x 512), inference + training.
#   SCALE=gpu bash experiments/speed/run.sh            # ~5-10 min on one H100 (paper shapes ~3 min)
#   SCALE=smoke bash experiments/speed/run.sh          # CPU: prints why it cannot run and exits 0
#   (c) SPEED_PARTS=training: training tokens/s and peak memory as the paper measures them (train_throughput.py:
#       equal and largest micro-batch, checkpointing off; the 1.5B activity sweep), and the memory breakdown of one
#       step (memory_breakdown.py); ~25 min on one H100. Rows in $RESULTS_ROOT/speed/training/.
#   (d) SPEED_PARTS=layers: per-layer FFN times (dense vs forced sparse) at the 1.5B and 1B shapes, the paper's
#       per-layer speed contribution (Figs. 6, 10); ~2 min.
#   (e) SPEED_PARTS=profile: each 1.5B FFN layer's time by phase at the paper's profile (ffn_profile.py); ~1 min.
# Env: SPEED_PARTS="paper trained" (default; "training", "layers" on request); REPEATS=N paper-shape runs with seeds
# 0..N-1 (default 1; the rows of record have 3); PAPER_LAYERS="8 18 28 38"; SPARSE_MODE=auto|sparse;
# RESULTS_ROOT (rows appended to $RESULTS_ROOT/speed/{paper_shapes,trained}.jsonl; the notebook keeps the latest
# row per model and mode). Energy needs nvidia-ml-py (pip install nvidia-ml-py); without it energy is null.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
. experiments/run_lib.sh
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "$SCALE" = gpu ]; then echo "SCALE=gpu: no CUDA GPU visible; the speed experiment needs one" >&2; exit 2; fi
  echo "speed: skipped -- GPU only (model-level tokens/s, energy and memory of the TwELL CUDA kernels)."
  echo "       On the H100 machine: SCALE=gpu bash experiments/speed/run.sh"
  exit 0
fi
read -r -a PARTS <<< "${SPEED_PARTS:-paper trained}"
read -r -a LAYERS <<< "${PAPER_LAYERS:-8 18 28 38}"
MODE="${SPARSE_MODE:-auto}"
OUT="$RESULTS_ROOT/speed"
mkdir -p "$OUT"
python -c "import pynvml" 2>/dev/null || echo "note: pynvml missing (pip install nvidia-ml-py): energy will be null"

for part in "${PARTS[@]}"; do
  case "$part" in
    paper)
      for seed in $(seq 0 $((${REPEATS:-1} - 1))); do  # independent repeats: new weights, calibration, tokens
        echo "== paper shapes: layers ${LAYERS[*]}, seed $seed (decoder core and whole model)"
        python -m sfl.experiments.speed.bench paper --layers "${LAYERS[@]}" --with-lm-head --seed "$seed" \
          --sparse-mode "$MODE" --out "$OUT/paper_repeats.jsonl" || SFL_FAILED+=("paper_shapes_seed$seed")
      done
      ;;
    layers)
      echo "== per-layer FFN times at the paper shapes (1.5B and 1B; 1.5B at the dense model's 911 non-zeros)"
      python -m sfl.experiments.speed.bench paper --layers 28 18 --layer-times --out "$OUT/layer_times.jsonl" &&
      python -m sfl.experiments.speed.bench paper --layers 28 --nnz-sweep 911 --layer-times \
        --out "$OUT/layer_times.jsonl" || SFL_FAILED+=(layer_times)
      ;;
    profile)
      echo "== the FFN at the paper's profile, layer by layer and phase by phase (1.5B shape, 16 x 2048 tokens)"
      python -m sfl.experiments.speed.ffn_profile --out "$OUT/ffn_profile.jsonl" || SFL_FAILED+=(ffn_profile)
      ;;
    trained)
      mapfile -t finals < <(ls -d "$RUNS_ROOT"/l1_sweep/*/final "$RUNS_ROOT"/ablations/*/*/final \
                                  "$RUNS_ROOT"/sparsify_smollm2/*/final 2>/dev/null || true)
      echo "== trained models: ${#finals[@]} found under $RUNS_ROOT"
      i=0
      for f in "${finals[@]}"; do
        i=$((i + 1))
        name=${f#"$RUNS_ROOT"/}; name=${name%/final}
        echo "[$i/${#finals[@]}] $name"
        python -m sfl.experiments.speed.bench trained --model "$f" --name "$name" --sparse-mode "$MODE" \
          --out "$OUT/trained.jsonl" || SFL_FAILED+=("$name")
      done
      ;;
    training)
      mkdir -p "$OUT/training"
      export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
      SIDES=("dense L1=0" "dense L1" sparse "sparse forced")
      for l in "${LAYERS[@]}"; do  # micro-batch 8 x 2048 fits the dense side up to 0.5B, 4 up to 1.5B, 2 at 2B
        mb=$(( l <= 8 ? 8 : (l <= 28 ? 4 : 2) ))
        echo "== training throughput: $l layers, micro-batch $mb and each side's largest"
        python -m sfl.experiments.speed.train_throughput --layers "$l" --micro-batch "$mb" --activation-checkpointing 0 \
          --sides "${SIDES[@]}" --out "$OUT/training/train_throughput.jsonl" || SFL_FAILED+=("train_throughput_$l")
        python -m sfl.experiments.speed.memory_breakdown --layers "$l" --micro-batch "$mb" \
          --out "$OUT/training/memory_breakdown.jsonl" || SFL_FAILED+=("memory_breakdown_$l")
      done
      for mb in 4 8; do
        echo "== training against activity (Fig. 5 counterpart): 1.5B shape, micro-batch $mb"
        python -m sfl.experiments.speed.train_throughput --layers 28 --nnz-sweep 10 20 29 60 120 --micro-batch "$mb" \
          --no-search --activation-checkpointing 0 --sides "dense L1=0" sparse \
          --out "$OUT/training/train_nnz_sweep.jsonl" || SFL_FAILED+=("train_nnz_sweep_$mb")
      done
      ;;
    *) echo "unknown part '$part' in SPEED_PARTS (paper, trained, training, layers, profile)" >&2; exit 2 ;;
  esac
done
if [ ${#SFL_FAILED[@]} -gt 0 ]; then echo "FAILED: ${SFL_FAILED[*]}" >&2; exit 1; fi
echo "rows in $OUT/; figures: python -m sfl.notebooks.run_all --only speed"
