"""Host time of one training-op call (fwd + bwd, auto path, bench_training's case) as the bench times it: after an
L2 flush and a sync. torch.profiler with CPU and CUDA activity over 3 such calls: every CPU-side op and CUDA
runtime call (cudaMalloc, cudaMemsetAsync, launches) by total time, and the CPU timeline of the first call up to
its gate GEMM's launch.

    PYTHONPATH=. python lab/kernel_bench/host_lead_train_op.py --p 0.01 --m 16384
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_train_op import op_steps  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=float, default=0.01)
    ap.add_argument("--m", type=int, default=16384)
    args = ap.parse_args()
    from sfl.kernels.timing import PairTimer as Timer

    ours, _, st = op_steps(args.m, args.p)
    for _ in range(6):
        ours()
    timer = Timer()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            timer.flush.zero_()
            torch.cuda.synchronize()
            ours()
            torch.cuda.synchronize()
    print(f"path {st.last_path}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.time_range.start)
    sync = [e for e in evs if "cudaDeviceSynchronize" in e.name or "synchronize" in e.name.lower()]
    t0 = sync[0].time_range.end if sync else evs[0].time_range.start   # the sync after the first flush
    print("\nthe first call's CPU events from the sync after the flush (us since then, duration us):")
    for e in evs:
        if e.time_range.start < t0:
            continue
        print(f"{(e.time_range.start - t0):9.1f} {(e.time_range.end - e.time_range.start):8.1f}  {e.name[:90]}")
        if "nvjet" in e.name or "Gemm" in e.name or e.time_range.start - t0 > 1500:
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
