#!/usr/bin/env bash
# Trial (lab): the training op of several source trees side by side in one device call, so that one machine's host
# and GPU time them all: each tree's training step against dense with its kernels (profile_train_heavy.py) in two rounds
# that alternate the trees, and once its host time per half (host_time_train_op.py --halves-only) and its training
# bench rows at one M. Trees: this checkout (".") and branch snapshots, made here with
#   for b in train-capture one-engine engine-direct; do mkdir -p .carry/$b && git archive $b | tar -x -C .carry/$b &&
#     git rev-parse $b > .carry/$b/COMMIT; done
# (only kernels/ experiments/ tests/ sfl/ data/ models/ notebooks/ pyproject.toml are needed) and carried (carry
# [".carry"]). On the device machine:
#   . lab/gpu_env.sh; bash lab/speed/ab_trees.sh $OUT 8192 . .carry/train-capture .carry/one-engine .carry/engine-direct
# Writes one tar, $OUT/ab_trees.tar (the device tool returns at most 8 files), with a log per tree and round; the
# second round takes the trees in the reverse order. A tree's logs name the commit in its COMMIT file, else
# $SFL_GIT_COMMIT.
set -uo pipefail
out="$1"; m="$2"; shift 2
root="$PWD"; work="$out/ab"; mkdir -p "$work"
name() { basename "$(cd "$1" && pwd)"; }
commit_of() { if [ -f "$1/COMMIT" ]; then cat "$1/COMMIT"; else echo "${SFL_GIT_COMMIT:-unknown}"; fi; }
for t in "$@"; do   # builds in parallel, each tree into its own cache
  log="$work/build_$(name "$t").txt"
  (cd "$t" && SFL_KERNEL_BUILD_DIR="$PWD/.torch_extensions" PYTHONPATH="$PWD" python3 -c \
    "from sfl.kernels.twell.ops import load; load(); from sfl.kernels.train.ops import load_ext; load_ext()" \
    > "$log" 2>&1) &
done
wait
trees=("$@")
reversed=(); for ((i = ${#trees[@]} - 1; i >= 0; i--)); do reversed+=("${trees[i]}"); done
for round in 1 2; do   # first pass: the op's step profile, host time, bench rows; second (reversed): the profile
  if [ "$round" = 1 ]; then order=("${trees[@]}"); else order=("${reversed[@]}"); fi
  for t in "${order[@]}"; do
    n=$(name "$t")
    (cd "$t" && export SFL_KERNEL_BUILD_DIR="$PWD/.torch_extensions" PYTHONPATH="$PWD" \
        SFL_GIT_COMMIT="$(commit_of .)" &&
      timeout 60 python3 "$root/lab/speed/profile_train_heavy.py" --m "$m" --heavy 0.01 > "$work/profile_${n}_r$round.txt" 2>&1
      if [ "$round" = 1 ]; then
        timeout 60 python3 "$root/lab/speed/host_time_train_op.py" --m "$m" --mode sparse --reps 20 --halves-only \
          > "$work/host_${n}_r$round.txt" 2>&1
        timeout 120 python3 -m sfl.experiments.kernel_bench.bench_training --out "$work/training_${n}_r$round.jsonl" \
          --ms "$m" > "$work/training_${n}_r$round.txt" 2>&1
      fi)
    echo "[$n round $round] $(grep -h 'speedup' "$work/profile_${n}_r$round.txt" | tr '\n' ' ')"
  done
done
tar -C "$out" -cf "$out/ab_trees.tar" ab && rm -rf "$work"
