#!/usr/bin/env bash
# Paper-scale training throughput at the paper's activity: tokens/s and peak memory per GPU through the same
# trainer, launcher and FSDP2 wrapping as run.sh, for the paper's dense baseline (L1 = 0), dense with L1 and the
# sparse op, starting from a paper_init checkpoint (gates calibrated to the paper's per-layer activity).
#   SIZES="0p5b 1p5b" bash experiments/paper_scale/throughput.sh            # all visible GPUs
#   NPROC=1 SIZES=0p5b ARMS=sparse AC="true false" MP="false true" bash experiments/paper_scale/throughput.sh
#   REPEATS=3 SIZES=1p5b bash experiments/paper_scale/throughput.sh      # every arm 3 times, arms interleaved
# The activity is held by lr = 1e-12 (AdamW's whole update; no fp32 weight moves), and every step logs it.
# Data: DATA_DIR/tokens_synthetic (uniform random ids; paper_scale/synthetic_tokens.py writes it) unless TOKENS_SUBDIR names
# a prepared corpus. Global batch = 2 micro-batches of 8 x 2048 per GPU (GBS overrides); STEPS optimizer steps, the
# first WARM not counted. Rows: $OUT (default results/paper_scale/throughput_<gpu>_n<NPROC>.jsonl), one per run.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
HERE=experiments/paper_scale
NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
SIZES="${SIZES:-0p5b}" ARMS="${ARMS:-dense_l1_0 dense_l1 sparse}" AC="${AC:-true}" MP="${MP:-false}"
STEPS="${STEPS:-6}" WARM="${WARM:-2}" GBS="${GBS:-$((16 * NPROC))}" REPEATS="${REPEATS:-1}"
DATA_DIR="${DATA_DIR:-.data}" TOKENS_SUBDIR="${TOKENS_SUBDIR:-tokens_synthetic}"
ROOT="${ROOT:-runs/paper_scale_throughput}"
[ -f "$DATA_DIR/$TOKENS_SUBDIR/meta.json" ] || python -m sfl.experiments.paper_scale.synthetic_tokens "$DATA_DIR"
declare -A LAYERS=([0p5b]=8 [1b]=18 [1p5b]=28 [2b]=38)
runs=()
for size in $SIZES; do
  init="$ROOT/init_$size"
  [ -f "$init/paper_init.json" ] || python -m sfl.experiments.speed.paper_init --layers "${LAYERS[$size]}" --out "$init"
  for rep in $(seq 1 "$REPEATS"); do  # the outer loop: a drift of the GPU over the runs hits every arm alike
  suffix=$([ "$REPEATS" -gt 1 ] && echo "_r$rep" || true)
  for arm in $ARMS; do
    case "$arm" in
      dense_l1_0) impl=dense; l1=0 ;;
      dense_l1) impl=dense; l1=2.0e-5 ;;
      sparse) impl=cuda; l1=2.0e-5 ;;
      *) echo "ARMS: dense_l1_0, dense_l1 or sparse, not $arm" >&2; exit 2 ;;
    esac
    for ac in $AC; do for mp in $MP; do
      out="$ROOT/${size}_${arm}_ac${ac}_mp${mp}_n${NPROC}${suffix}"
      rm -rf "$out"
      echo "== $out"
      OUT_DIR="$out" NPROC="$NPROC" SIZE="$size" MLP_IMPL="$impl" bash "$HERE/run.sh" \
        "init_from=$init" "l1_coeff=$l1" lr=1.0e-12 min_lr=0.0 warmup_steps=0 "max_steps=$STEPS" \
        "global_batch_size=$GBS" eval_every=0 ckpt_every=0 ckpt_last=false save_final=false ckpt_hf=false log_every=1 \
        "data_dir=$DATA_DIR" "tokens_subdir=$TOKENS_SUBDIR" "activation_checkpointing=$ac" \
        "fsdp_mixed_precision=$mp" progress=false || echo "run failed: $out" >&2
      runs+=("$out")
    done; done
  done
  done
done
gpu=$(python -c 'import torch; print(torch.cuda.get_device_name().split()[-1].lower())')
python -m sfl.experiments.paper_scale.throughput_rows --warm "$WARM" --out "${OUT:-results/paper_scale/throughput_${gpu}_n${NPROC}.jsonl}" "${runs[@]}"
