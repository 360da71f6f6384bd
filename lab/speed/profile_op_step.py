"""Trial (lab): one training step of the FFN block at one configuration of bench_training (its TrainCase), to compare
source trees kernel by kernel. Dense autograd against forced sparse and against auto, each pair timed in alternation
(CUDA events, L2 flush, medians), then the forced-sparse step under torch.profiler: every kernel it launches with its
GPU time per step, and the launch count.

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


def kernel_table(step, steps: int) -> tuple[list[tuple[str, float, int]], float]:
    """(name, GPU us per step, launches per step) of every kernel, longest first, and the total GPU us per step."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    us, n = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name] += ev.device_time / steps
            n[ev.name] += 1
    rows = sorted(((k, us[k], n[k] // steps) for k in us), key=lambda r: -r[1])
    return rows, sum(us.values())


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
    rows, total = kernel_table(lambda: case.ours_step("sparse"), 10)
    print(f"forced sparse under the profiler: {total:.0f} us of kernels per step, "
          f"{sum(r[2] for r in rows)} launches per step")
    for name, us, n in rows[:25]:
        print(f"{us:9.1f} us {n:4d}x  {name[:110]}")


if __name__ == "__main__":
    main()
