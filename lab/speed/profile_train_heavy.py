"""Where the training op's time goes with and without heavy rows (r9: 0.5% at M = 16384 took 4.21 ms, with 1% heavy
rows 5.45 ms for 164 backup rows), at one configuration of bench_training (its TrainCase). Per heavy-row fraction:
dense autograd against forced sparse and against auto, each pair timed in alternation (CUDA events, L2 flush,
medians); then the forced-sparse step under torch.profiler: how busy the GPU is per step, every kernel with its GPU
time and launches per step, and every host op and CUDA runtime call with its host time. Comparing source trees
kernel by kernel: lab/speed/ab_trees.sh runs it in each.

    PYTHONPATH=<tree> python lab/speed/profile_train_heavy.py [--m 16384] [--p 0.005] [--heavy 0 0.01]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from profile_train_step import busy_ms  # this folder: the union of the device intervals
from sfl.experiments.kernel_bench.bench_training import TrainCase
from sfl.kernels.config import KernelConfig
from sfl.kernels.timing import PairTimer


def event_tables(prof, steps: int) -> dict[str, list[tuple[str, float, int]]]:
    """Per step, longest first: "gpu", every kernel (name, GPU us, launches); "cpu", every host op and CUDA runtime
    call (name, self host us, calls)."""
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


def profile_case(m: int, p: float, heavy: float, reps: int, timer: PairTimer) -> None:
    case = TrainCase(m, 2048, 5632, p, heavy, KernelConfig(), "neuron_major")
    label = f"M={m} p={p} heavy={heavy}"
    for mode in ("sparse", "auto"):
        for _ in range(5):  # the history (width, backup block) settles
            case.ours_step(mode)
        d, s = timer.time_pair(case.dense_step, lambda: case.ours_step(mode), reps)
        print(f"{label} {mode}: dense {d:.3f} ms, ours {s:.3f} ms, speedup {d / s:.2f}x "
              f"({case.st_auto.last_path if mode == 'auto' else 'sparse'})")
    steps = 10
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            case.ours_step("sparse")
        torch.cuda.synchronize()
    print(f"{label} forced sparse under the profiler: GPU busy {busy_ms(prof.events()) / steps:.3f} ms per step")
    tables = event_tables(prof, steps)
    for side, what in (("gpu", "of kernels"), ("cpu", "of host self time")):
        rows = tables[side]
        print(f"  {sum(r[1] for r in rows):.0f} us {what} per step, "
              f"{sum(r[2] for r in rows)} {'launches' if side == 'gpu' else 'host events'} per step")
        for name, us, n in rows[:25]:
            print(f"  {us:9.1f} us {n:4d}x  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--p", type=float, default=0.005)
    ap.add_argument("--heavy", type=float, nargs="+", default=[0.0, 0.01])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    timer = PairTimer()
    for heavy in args.heavy:
        profile_case(args.m, args.p, heavy, args.reps, timer)


if __name__ == "__main__":
    main()
