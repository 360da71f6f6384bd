#!/usr/bin/env bash
# run_parallel.sh JOBS_FILE: run independent jobs (one shell command per line) over the visible GPUs.
# WORKERS_PER_GPU workers per GPU (default 1) each take the next unclaimed line until none is left, with
# CUDA_VISIBLE_DEVICES set to their GPU; job n's output goes to LOG_DIR/job_<n>.log (default: a temp dir) and one
# line per job start/end to stdout. Exits non-zero when any job failed. Jobs must not write the same run directory:
# give each its own (L1 value, seed). Several workers on one GPU add throughput for small models whose steps leave
# the GPU partly idle; timings measured by such jobs are not timings of record.
set -uo pipefail
JOBS_FILE=${1:?usage: run_parallel.sh JOBS_FILE}
WORKERS_PER_GPU=${WORKERS_PER_GPU:-1}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/sfl_jobs.XXXXXX")}
mkdir -p "$LOG_DIR"
n_gpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"
else GPUS=(); for ((g = 0; g < n_gpu; g++)); do GPUS+=("$g"); done; fi
[ ${#GPUS[@]} -gt 0 ] || GPUS=("")  # no GPU: workers run on the CPU
mapfile -t JOBS < <(grep -v '^[[:space:]]*\(#\|$\)' "$JOBS_FILE")
next="$LOG_DIR/.next"; echo 0 > "$next"
claim() {  # prints the index of the next unclaimed job, or nothing
  ( flock 9; i=$(cat "$next"); [ "$i" -lt ${#JOBS[@]} ] && { echo $((i + 1)) > "$next"; echo "$i"; } ) 9>"$next.lock"
}
worker() {
  local gpu=$1 i rc t0
  while i=$(claim) && [ -n "$i" ]; do
    t0=$SECONDS
    echo "[gpu ${gpu:-cpu}] job $i start: ${JOBS[$i]}"
    CUDA_VISIBLE_DEVICES=$gpu bash -c "${JOBS[$i]}" > "$LOG_DIR/job_$i.log" 2>&1; rc=$?
    echo "[gpu ${gpu:-cpu}] job $i end rc=$rc after $((SECONDS - t0)) s: $(grep -E 'done --|FAILED|skipped --' "$LOG_DIR/job_$i.log" | tail -1)"
    [ "$rc" = 0 ] || echo "$i" >> "$LOG_DIR/.failed"
  done
}
echo "== ${#JOBS[@]} jobs on GPU(s) ${GPUS[*]:-cpu}, $WORKERS_PER_GPU worker(s) each; logs in $LOG_DIR"
for gpu in "${GPUS[@]}"; do for ((w = 0; w < WORKERS_PER_GPU; w++)); do worker "$gpu" & done; done
wait
if [ -s "$LOG_DIR/.failed" ]; then echo "FAILED jobs: $(tr '\n' ' ' < "$LOG_DIR/.failed")(logs in $LOG_DIR)" >&2; exit 1; fi
echo "all ${#JOBS[@]} jobs finished"
