"""Where a model training step waits: one paper-shape model (train_throughput's build and calibration), each side's
optimizer step profiled after warm-up: wall time per step, the GPU's busy time (union of kernel intervals), and every
host synchronisation the step makes (CUDA sync calls and the torch ops that imply one), with the repository frame
that called it.

    PYTHONPATH=. python lab/speed/profile_train_step.py [--layers 28] [--micro-batch 4] [--sides "dense L1=0" sparse]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
              "aten::nonzero", "aten::item", "cudaMemcpy", "cudaMemcpyAsync", "aten::nonzero_static")


def busy_ms(events) -> float:
    """Union of the device intervals, ms."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1000


def gaps(events, min_us: float = 30.0, top: int = 15) -> list[tuple[float, int, str]]:
    """Device idle gaps longer than min_us, summed by (kernel before -> kernel after): where the GPU waits."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    agg: dict[str, list[float]] = collections.defaultdict(list)
    end, prev = None, None
    for s, e, n in ks:
        if end is not None and s - end > min_us:
            agg[f"{prev[:60]} -> {n[:60]}"].append(s - end)
        if end is None or e > end:
            end, prev = e, n
    out = sorted(((sum(v), len(v), k) for k, v in agg.items()), reverse=True)
    return out[:top]


def repo_frame(stack: list[str]) -> str:
    for f in stack:
        if any(k in f for k in ("kernels/", "models/", "experiments/")) and "profile_train_step" not in f:
            return f
    return stack[0] if stack else "?"


def main() -> None:
    from sfl.experiments.speed.bench import PAPER_NNZ, build_paper_model, calibrate_paper_model, paper_profile
    from sfl.experiments.speed.train_throughput import Trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--sides", nargs="+", default=["dense L1=0", "sparse"])
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_paper_model(a.layers, dev, torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    heavy = torch.randperm(vocab, generator=g)[: max(1, vocab // 100)]
    ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), generator=g).to(dev)
    calibrate_paper_model(model, paper_profile(a.layers, PAPER_NNZ.get(a.layers, 30.0)), ids[:, :-1], heavy_ids=heavy)
    model.config.l1_reduction = "sum"
    model.float().train()
    tr = Trainer(model, ids, dev)
    for side in a.sides:
        for _ in range(3):
            tr.step(side, a.micro_batch)
        host = []
        for _ in range(3):  # host time: until the step's last launch returns (the GPU may still be working)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tr.step(side, a.micro_batch)
            host.append((time.perf_counter() - t0) * 1000)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            tr.step(side, a.micro_batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3 * 1000
        print(f"   host time to issue one step (after a sync): {min(host):.1f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(a.steps):
                tr.step(side, a.micro_batch)
            torch.cuda.synchronize()
        ev = prof.events()
        busy = busy_ms(ev) / a.steps
        print(f"== {side}: wall {wall:.1f} ms/step (unprofiled), GPU busy {busy:.1f} ms/step "
              f"({100 * busy / wall:.1f}%)")
        syncs = collections.Counter()
        for e in ev:
            if e.name in SYNC_NAMES:
                syncs[(e.name, repo_frame(e.stack or []))] += 1
        for (name, where), n in syncs.most_common(25):
            print(f"   {n / a.steps:6.1f}/step  {name:28s} {where}")
        for total, n, k in gaps(ev):
            print(f"   gap {total / 1000 / a.steps:7.2f} ms/step in {n / a.steps:5.1f}/step: {k}")


if __name__ == "__main__":
    main()
