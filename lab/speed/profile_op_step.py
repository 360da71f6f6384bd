"""Trial (lab): one training step of the FFN block at one configuration of bench_training (its TrainCase), to compare
source trees kernel by kernel. Dense autograd against forced sparse and against auto, each pair timed in alternation
(CUDA events, L2 flush, medians), then the forced-sparse step under torch.profiler: every kernel it launches with its
GPU time per step, and every host op and CUDA runtime call with its host time.

    PYTHONPATH=<tree> python lab/speed/profile_op_step.py [--m 8192 --p 0.005 --heavy 0.01]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.experiments.kernel_bench.bench_training import TrainCase
from sfl.kernels.config import KernelConfig
from sfl.kernels.timing import PairTimer


def event_tables(step, steps: int) -> dict[str, list[tuple[str, float, int]]]:
    """Per step, longest first: "gpu", every kernel (name, GPU us, launches); "cpu", every host op and CUDA runtime
    call (name, self host us, calls)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    tables = {}
    for side in ("gpu", "cpu"):
        us, n = collections.Counter(), collections.Counter()
        for ev in prof.events():
            on_gpu = ev.device_type == torch.autograd.DeviceType.CUDA
            if on_gpu == (side == "gpu"):
                us[ev.name] += (ev.device_time if on_gpu else ev.self_cpu_time_total) / steps
                n[ev.name] += 1
        tables[side] = sorted(((k, us[k], n[k] // steps) for k in us), key=lambda r: -r[1])
    return tables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--p", type=float, default=0.005)
    ap.add_argument("--heavy", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    case = TrainCase(args.m, 2048, 5632, args.p, args.heavy, KernelConfig(), "neuron_major")
    timer = PairTimer()
    for mode in ("sparse", "auto"):
        for _ in range(5):  # the history (width, backup block) settles
            case.ours_step(mode)
        d, s = timer.time_pair(case.dense_step, lambda: case.ours_step(mode), args.reps)
        print(f"M={args.m} p={args.p} heavy={args.heavy} {mode}: dense {d:.3f} ms, ours {s:.3f} ms, "
              f"speedup {d / s:.2f}x ({case.st_auto.last_path if mode == 'auto' else 'sparse'})")
    tables = event_tables(lambda: case.ours_step("sparse"), 10)
    for side, what in (("gpu", "of kernels"), ("cpu", "of host self time")):
        rows = tables[side]
        print(f"forced sparse under the profiler: {sum(r[1] for r in rows):.0f} us {what} per step, "
              f"{sum(r[2] for r in rows)} {'launches' if side == 'gpu' else 'host events'} per step")
        for name, us, n in rows[:25]:
            print(f"{us:9.1f} us {n:4d}x  {name[:110]}")

if __name__ == "__main__":
    main()
