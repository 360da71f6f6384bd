#!/usr/bin/env bash
# One short device call: build both extensions, FSDP2 evaluation through the sparse op (tests/fsdp_eval_check.py),
# a tiny FSDP2 training run with the CUDA op (torchrun, one GPU: a process group of one) that checkpoints, resumes
# and saves its final model, then the C++ config tests. Everything under $OUT.
set -uo pipefail
. lab/gpu_env.sh  # the device machine's python, NVLink multicast off, build()
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/smoke.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/smoke.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/smoke.txt"
build | tee -a "$OUT/smoke.txt"
python3 -m torch.distributed.run --standalone --nproc_per_node=1 tests/fsdp_eval_check.py > "$OUT/fsdp_eval.txt" 2>&1
log "fsdp_eval rc=$?: $(grep FSDP_EVAL "$OUT/fsdp_eval.txt")"
python3 -m sfl.experiments.paper_scale.synthetic_tokens .data --subdir tokens_tiny --vocab 512 \
  --train-tokens 200000 --val-tokens 20000
run() { python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m sfl.experiments.trainer.train --set data_dir=.data \
  --set tokens_subdir=tokens_tiny --set out_dir=runs/smoke_fsdp --set device=cuda --set parallel=fsdp --set mlp_impl=cuda \
  --set hidden_size=256 --set intermediate_size=1024 --set num_hidden_layers=2 --set num_attention_heads=4 \
  --set seq_len=64 --set micro_batch_size=4 --set grad_accum=2 --set max_steps=$1 --set ckpt_every=2 --set eval_every=2 \
  --set log_every=1 --set warmup_steps=1 --set 'kernel={mode: sparse, train_mode: sparse, train_sparse_min_m: 1}' --set progress=false "${@:2}"; }
run 2 >> "$OUT/train_fsdp.txt" 2>&1; log "train to 2 rc=$?"
run 4 --resume >> "$OUT/train_fsdp.txt" 2>&1; log "resume to 4 rc=$?"
cp runs/smoke_fsdp/train_log.jsonl "$OUT/train_fsdp_log.jsonl" 2>/dev/null
python3 -c "
import sfl.models, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained('runs/smoke_fsdp/final')
print('final loads:', m.model.layers[0].mlp.down_proj.weight.shape, bool(torch.isfinite(m(input_ids=torch.arange(8)[None]).logits).all()))
" >> "$OUT/smoke.txt" 2>&1; log "final load rc=$?"
timeout 120 python3 -m pytest tests/test_twell_cuda.py tests/test_model_cuda.py -x -q -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
log "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.txt")"
