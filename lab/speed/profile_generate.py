"""Trial (lab): where does generate() at batch 32 lose time against HF's Llama? Profiles a few decode steps of both
sides (torch.profiler, CPU + CUDA) and times generate with our KernelConfig's modes. GPU only; output on stdout."""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.experiments.speed.bench import build_paper_model, calibrate_paper_model, paper_profile
from sfl.experiments.speed.real_path import dense_twin
from sfl.kernels.config import KernelConfig


def timed(fn, n=3):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def calibrated_pair(layers: int, dev: torch.device):
    """(ours with mlp_impl cuda, HF's ReLU Llama with the same weights, the token generator, vocab): the paper's shape,
    gates calibrated to 29 non-zeros per token with a 1% heavy-token tail."""
    ours = build_paper_model(layers, dev, torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    heavy = torch.randperm(vocab, generator=g)[: int(0.01 * vocab)]
    calib = torch.randint(0, vocab, (4, 2048), generator=g).to(dev)
    calibrate_paper_model(ours, paper_profile(layers, 29.0), calib, heavy_ids=heavy)
    hf = dense_twin(ours)
    ours.set_mlp_impl("cuda")
    return ours, hf, g, vocab


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 28
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8, 32]
    dev = torch.device("cuda")
    ours, hf, g, vocab = calibrated_pair(layers, dev)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    for b in batches:
        ids = torch.randint(1, vocab, (b, 128), generator=g).to(dev)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            gen = {"hf": lambda: hf.generate(input_ids=ids, attention_mask=mask, **kw),
                   "ours": lambda: ours.generate(input_ids=ids, attention_mask=mask, **kw)}
            for k in gen:
                gen[k]()
            for mode in ("auto", "dense", "sparse"):
                ours.set_kernel_config(KernelConfig(mode=mode))
                gen["ours"](); gen["ours"]()
                print(f"b{b} mode {mode}: hf {timed(gen['hf'])*1e3:.1f} ms ours {timed(gen['ours'])*1e3:.1f} ms", flush=True)
                mlps = list(ours.sparse_mlps())
                for i in (0, 1, layers // 2, layers - 1):
                    print(f"   layer {i}: {mlps[i].plan.info()}")
            ours.set_kernel_config(KernelConfig())
            gen["ours"](); gen["ours"]()
            for k in gen:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    gen[k]()
                    torch.cuda.synchronize()
                ka = prof.key_averages()
                print(f"==== b{b} {k}: by device time")
                print(ka.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
                print(f"==== b{b} {k}: by CPU self time")
                print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
