"""Trial (lab): batch-1 prefill (1 x 2048 tokens, `model.model`), HF's Llama against ours, to place the 0.89-0.94x
of real_path r5 / r6: ours with mlp_impl "cuda" (auto dispatch, statistics on as in real_path, and off) and with
mlp_impl "dense" (three F.linear, HF's MLP math: what remains is the rest of our model). Sides alternate per
block (A B B A), 12 blocks of 5 calls after 2 untimed ones, CUDA events around each call after a sync; medians. GPU only.

    PYTHONPATH=. python lab/speed/prefill_b1_gap.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_generate import calibrated_pair  # noqa: E402


def one(fn) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main() -> None:
    dev = torch.device("cuda")
    ours, hf, g, vocab = calibrated_pair(28, dev)
    ids = torch.randint(0, vocab, (1, 2048), generator=g).to(dev)
    def setup(impl: str | None, stats: bool = False):
        def run():
            if impl is not None:
                ours.set_mlp_impl(impl)
                ours.config.track_sparsity_stats = stats
        return run

    sides = {"hf": (setup(None), lambda: hf.model(input_ids=ids)),
             "cuda_stats": (setup("cuda", True), lambda: ours.model(input_ids=ids)),
             "cuda_nostats": (setup("cuda", False), lambda: ours.model(input_ids=ids)),
             "dense_impl": (setup("dense", False), lambda: ours.model(input_ids=ids))}
    times = {k: [] for k in sides}
    with torch.inference_mode():
        for blk in range(13):
            order = list(sides) if blk % 2 == 0 else list(reversed(sides))
            for k in order:
                prep, fn = sides[k]
                prep()
                for _ in range(2):  # warm-up after a switch (the plans' first calls measure)
                    fn()
                for _ in range(5):
                    if blk:  # block 0: warm-up only
                        times[k].append(one(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:14s} {v:7.2f} ms  hf/this {med['hf'] / v:.3f}x  (p10 {sorted(times[k])[len(times[k]) // 10]:.2f})")


if __name__ == "__main__":
    main()
