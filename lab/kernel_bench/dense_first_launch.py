"""Trial (lab): why single dense-dispatched calls at M = 4096 read 0.90-0.94x on some H100s (bench r24) while the
steady state reads 1.01-1.04x: the host's time from the start of a call to its first kernel launch, HF's
F.linear chain against our op (auto, dense-dispatched after warm-up), from the profiler's CPU timeline of single
calls made on an idle GPU; beside it each side's single-call CUDA-event time. GPU only; prints a table.

    PYTHONPATH=. python lab/kernel_bench/dense_first_launch.py
"""
from __future__ import annotations

import statistics

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sfl.experiments.kernel_bench.bench_inference import BF, dense_gated, make_case, make_weights
from sfl.kernels.timing import PairTimer as Timer
from sfl.kernels.config import KernelConfig
from sfl.kernels.twell import ops

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemsetAsync",
          "cudaMemcpyAsync", "cudaEventRecord")


def first_launch_us(prof, tag: str) -> list[float]:
    evs = sorted(prof.events(), key=lambda e: e.time_range.start)
    out = []
    for m in (e for e in evs if e.name == tag):
        t0, t1 = m.time_range.start, m.time_range.end
        launches = [e.time_range.start for e in evs if t0 <= e.time_range.start <= t1 and e.name in LAUNCH]
        if launches:
            out.append(min(launches) - t0)
    return out


def main() -> None:
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    timer = Timer()
    ops.load()  # registers the op
    for p in (0.01, 0.02):
        x, wg = make_case(wg32, 4096, K, N, "uniform", p, 0.0, seed=7)
        plan = ops.Plan(KernelConfig())
        sides = {"hf": lambda: dense_gated(x, wg, wu, wd), "ours": lambda: ops.ffn(x, wg, wu, wd, plan)}
        with torch.inference_mode():
            for _ in range(60):  # the plan measures, times both paths and settles on dense
                sides["ours"]()
                sides["hf"]()
            torch.cuda.synchronize()
            single = {k: timer.time(fn, 21) for k, fn in sides.items()}
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(15):
                    for k, fn in sides.items():
                        torch.cuda.synchronize()
                        with record_function(f"call_{k}"):
                            fn()
                        torch.cuda.synchronize()
        info = plan.info()
        print(f"p={p} ours path {info.get('path')}; single-call ms: " +
              " ".join(f"{k} {v:.3f}" for k, v in single.items()))
        for k in sides:
            us = first_launch_us(prof, f"call_{k}")
            print(f"  {k:5s} first launch after {statistics.median(us):6.1f} us (min {min(us):.1f}, n {len(us)})")
        if p == 0.01:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))


if __name__ == "__main__":
    main()
