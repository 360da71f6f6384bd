"""Where the training op's time goes with and without heavy rows (r9: 0.5% at M = 16384 took 4.21 ms, with 1% heavy
rows 5.45 ms for 164 backup rows). Forced sparse, one fwd+bwd per step, torch.profiler over 5 steps after warm-up:
per-kernel device time and the step's wall time from CUDA events.

    PYTHONPATH=. python lab/speed/profile_train_heavy.py [--m 16384] [--p 0.005]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from profile_train_step import busy_ms  # this folder: the union of the device intervals
from sfl.experiments.kernel_bench.bench_training import make_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--p", type=float, default=0.005)
    a = ap.parse_args()
    from sfl.kernels.train_ffn import sparse_gated_ffn_train

    K, N = 2048, 5632
    for heavy in (0.0, 0.01):
        x, (wg, wu, wd), gy = make_case(a.m, K, N, a.p, heavy, seed=7)
        params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        gl1 = torch.tensor(1000.0, device="cuda")

        def step():
            for t in params:
                t.grad = None
            y, l, st = sparse_gated_ffn_train(*params, mode="sparse", want_stats=False)
            torch.autograd.backward([y, l], [gy, gl1])
            return st

        for _ in range(5):
            st = step()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            step()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        print(f"== heavy {heavy}: backup rows {st['backup_rows']} width {st['width']}: median step "
              f"{statistics.median(times):.3f} ms (min {min(times):.3f})")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.cuda.synchronize()
                step()
            torch.cuda.synchronize()
        busy = busy_ms(prof.events()) / 5  # key_averages' self device times count a kernel under its op too
        print(f"   GPU busy per step {busy:.3f} ms: idle ~{statistics.median(times) - busy:.3f} ms")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
