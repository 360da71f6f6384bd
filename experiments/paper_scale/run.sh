#!/usr/bin/env bash
# paper_scale: the paper's 0.5B / 1B / 1.5B / 2B training runs on one node of several GPUs -- FSDP2 through
# torchrun, the one training loop (experiments/trainer/train.py), the paper's hyperparameters (paper.yaml).
#   SIZE=0p5b bash experiments/paper_scale/run.sh                    # all visible GPUs, corpus budget, sparse op
#   SIZE=2b NPROC=8 BUDGET=paper MLP_IMPL=dense bash experiments/paper_scale/run.sh l1_coeff=0
#   SCALE=smoke bash experiments/paper_scale/run.sh                  # CPU: 2 gloo processes, tiny shape (~1 min)
# SIZE: 0p5b | 1b | 1p5b | 2b. BUDGET: corpus (16 steps = 16.8 M tokens, fits the offline corpus; corpus.yaml)
# | paper (10-40 K steps, needs a ~10-42 B-token corpus in data_dir). MLP_IMPL: cuda (the sparse training op) |
# dense. NPROC: processes (default: the visible GPUs). Trailing key=value arguments override config keys.
# Output: runs/paper_scale/<SIZE>_<MLP_IMPL>_<BUDGET>_n<NPROC>/ (train_log.jsonl, DCP checkpoints, final/);
# rerunning the same command resumes from the newest checkpoint, also with another NPROC (same global batch).
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/env.sh
SCALE="${SCALE:-gpu}"
SIZE="${SIZE:-0p5b}"
BUDGET="${BUDGET:-corpus}"
MLP_IMPL="${MLP_IMPL:-cuda}"
HERE=experiments/paper_scale
case "$SIZE" in 0p5b|1b|1p5b|2b) ;; *) echo "SIZE=$SIZE: choose 0p5b, 1b, 1p5b or 2b" >&2; exit 2 ;; esac
case "$BUDGET" in corpus|paper) ;; *) echo "BUDGET=$BUDGET: choose corpus or paper" >&2; exit 2 ;; esac
configs=("$HERE/paper.yaml" "$HERE/$SIZE.yaml")
[ "$BUDGET" = corpus ] && configs+=("$HERE/corpus.yaml")
if [ "$SCALE" = smoke ]; then
  configs+=("$HERE/smoke.yaml")
  MLP_IMPL=dense
  NPROC="${NPROC:-2}"
  SIZE=smoke
else
  NPROC="${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
  if [ "$NPROC" -lt 1 ]; then
    echo "paper_scale: no CUDA GPU visible. On CPU: SCALE=smoke bash experiments/paper_scale/run.sh" >&2
    exit 2
  fi
fi
OUT="${OUT_DIR:-runs/paper_scale/${SIZE}_${MLP_IMPL}_${BUDGET}_n${NPROC}}"
sets=(--set "mlp_impl=$MLP_IMPL" --set "out_dir=$OUT")
for kv in "$@"; do sets+=(--set "$kv"); done
mkdir -p "$OUT"
python -m sfl.experiments.trainer.runs merge "${configs[@]}" "${sets[@]}" -o "$OUT/config.yaml"
export SFL_GIT_COMMIT="${SFL_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
echo "paper_scale: $NPROC process(es), config $OUT/config.yaml"
python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m sfl.experiments.trainer.train --config "$OUT/config.yaml" --resume
