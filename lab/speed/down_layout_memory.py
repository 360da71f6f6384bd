"""Trial (lab): what storing W_d neuron-major (kernels/layout.py) saves a model in inference, measured.

The paper's 1.5B shape (28 layers, hidden 2048, N 5632), gates calibrated as in experiments/speed/real_path.py (29
non-zeros per token, a heavy tail), mlp_impl="cuda". For each layout of every layer's down_proj.weight (fresh plans
each time): memory allocated before, after a prefill of 4 x 2048 tokens and after an eager generate() of 64 tokens
at batch 8 (the calls that make a row-major W_d's copy), peak memory, the plans' W_d copies (Plan.info()), and the
wall time of the generate. One JSONL row per layout with provenance.

    PYTHONPATH=. python lab/speed/down_layout_memory.py --out /tmp/down_layout_memory.jsonl
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from sfl.experiments.trainer.provenance import collect
from sfl.experiments.speed.bench import build_paper_model, calibrate_paper_model, paper_profile, require_cuda


def main() -> int:
    from sfl.kernels.layout import set_down_layout_

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    dev = require_cuda()
    model = build_paper_model(args.layers, dev, torch.bfloat16)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    heavy = torch.randperm(vocab, generator=g)[: vocab // 100]
    calib = torch.randint(0, vocab, (4, 2048), generator=g).to(dev)
    achieved = calibrate_paper_model(model, paper_profile(args.layers, 29.0), calib, heavy_ids=heavy)
    model.set_mlp_impl("cuda")
    prompt = torch.randint(1, vocab, (8, 128), generator=g).to(dev)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64, do_sample=False,
              pad_token_id=0)
    prov = collect({"what": "model memory by W_d's layout"})
    rows = []
    for layout in ("neuron_major", "row_major", "neuron_major"):
        for mlp in model.sparse_mlps():
            set_down_layout_(mlp.down_proj, neuron_major=layout == "neuron_major")
            mlp.refresh_plan()  # fresh plans: no copy from the previous layout survives
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            model.model(input_ids=calib)
            torch.cuda.synchronize()
            after_prefill = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            seq = model.generate(prompt, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        copies = sum(mlp.plan.info().get("down_copy_bytes", 0) for mlp in model.sparse_mlps())
        r = {"layout": layout, "layers": args.layers, "calibration_nnz_mean": sum(achieved) / len(achieved),
             "allocated_before_gb": before / 1e9, "allocated_after_prefill_gb": after_prefill / 1e9,
             "allocated_after_generate_gb": torch.cuda.memory_allocated() / 1e9,
             "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "down_copy_bytes": copies,
             "generate_wall_s": wall, "generated": list(seq.shape), "provenance": prov}
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "provenance"}), flush=True)
        del seq
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
