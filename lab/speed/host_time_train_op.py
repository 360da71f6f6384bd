"""Host (enqueue) time of the training op's forward and backward against dense autograd's, the GPU kept busy by a
long kernel so that only host work is timed (the backward after a sync: its one event wait is then free), medians
over reps; then cProfile of each half, top functions by own time. M = 8192 (a 4 x 2048 micro-batch), 0.5%.

    PYTHONPATH=. python lab/speed/host_time_train_op.py
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch

from sfl.experiments.kernel_bench.bench_training import dense_block, make_case


def halves(fwd, reps: int = 30) -> tuple[float, float]:
    """Median host microseconds of fwd() and of the backward of its outputs."""
    tf, tb = [], []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        outs, grads = fwd()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t2 = time.perf_counter()
        torch.autograd.backward(outs, grads)
        t3 = time.perf_counter()
        if i >= 3:
            tf.append((t1 - t0) * 1e6)
            tb.append((t3 - t2) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(tf), statistics.median(tb)


def profile(fwd, label: str, reps: int = 30) -> None:
    for half in ("forward", "backward"):
        pr = cProfile.Profile()
        for _ in range(reps):
            torch.cuda.synchronize()
            if half == "forward":
                pr.enable()
            outs, grads = fwd()
            pr.disable()
            torch.cuda.synchronize()
            if half == "backward":
                pr.enable()
            torch.autograd.backward(outs, grads)
            pr.disable()
        print(f"== {label} {half}: cProfile, {reps} calls, by own time")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def main() -> int:
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    M, K, N = 8192, 2048, 5632
    x, (wg, wu, wd), gy = make_case(M, K, N, 0.005, 0.0, seed=11)
    params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    gl1 = torch.tensor(1000.0, device="cuda")
    st = DispatchState()

    def ours():
        for t in params:
            t.grad = None
        y, l, _ = sparse_gated_ffn_train(*params, mode="auto", state=st, want_stats=False)
        return [y, l], [gy, gl1]

    def dense():
        for t in params:
            t.grad = None
        y, l = dense_block(*params)
        return [y, l], [gy, gl1]

    for _ in range(5):
        o, g = ours()
        torch.autograd.backward(o, g)
    torch.cuda.synchronize()
    print(f"path {st.last_path}")
    for name, fn in (("ours (auto)", ours), ("dense autograd + L1", dense)):
        f, b = halves(fn)
        print(f"{name}: host us forward {f:.0f}, backward {b:.0f}", flush=True)
    profile(ours, "ours")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
