"""Trial (lab): the training op's host time per call against dense autograd's, the GPU kept busy so that no launch
waits (the backward after a sync: its one event wait is then free), medians over reps; ffn_fwd_gate's steps one at
a time; then cProfile of each side's fwd+bwd, microseconds per call by own time. Defaults: M = 8192 (a 4 x 2048
micro-batch), 0.5%; the earlier logs ran M = 16384 at 0.5% and 1% (lab/results/speed.tar.xz: host_time/).

    PYTHONPATH=. python lab/speed/host_time_train_op.py [--m 16384 --p 0.01]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from sfl.experiments.kernel_bench.bench_training import dense_block, make_case


def timed_halves(fwd, bwd, reps: int) -> tuple[float, float]:
    tf, tb = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: every launch below is queued, none waits
        t0 = time.perf_counter()
        out = fwd()
        tf.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        bwd(out)
        tb.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(tf) * 1e6, statistics.median(tb) * 1e6


def host_us(fn, reps: int = 30) -> float:
    """Median host time of fn() in us with the GPU busy (nothing waits for a launch)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(5_000_000)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def pieces(ps, M: int, N: int) -> None:
    """Host time of what ffn_fwd_gate does, one piece at a time (the op's arguments)."""
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    x, wg = ps[0].detach(), ps[1].detach()
    scratch = torch.empty(M, N, device="cuda", dtype=x.dtype)
    small = torch.zeros(4, device="cuda", dtype=torch.int64)
    res = {
        "ffn_fwd_gate": lambda: ext.ffn_fwd_gate(wg, x, 72, 128, M, True),
        "mm_out (the gate GEMM)": lambda: torch.mm(x, wg.t(), out=scratch),
        "empty [M, N] bf16": lambda: torch.empty(M, N, device="cuda", dtype=x.dtype),
        "empty [M, 72] int32 x2, [M] x2": lambda: [torch.empty(*s, device="cuda", dtype=torch.int32)
                                                  for s in ((M, 72), (M, 72), (M,), (M,))],
        "pinned empty(4) + copy_": lambda: torch.empty(4, dtype=torch.int64, pin_memory=True).copy_(small,
                                                                                                  non_blocking=True),
        "is_pinned": lambda: torch.empty(4, dtype=torch.int64).is_pinned(),
        "torch.cuda.Event().record()": lambda: torch.cuda.Event().record(),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
    }
    W, i32, i64 = 72, torch.int32, torch.int64

    def replica(upto: int):  # ffn_fwd_gate's steps in order, from Python, up to step `upto`
        ell_col, ell_a = torch.empty(M, W, device="cuda", dtype=i32), torch.empty(M, W, device="cuda", dtype=x.dtype)
        nnz, flag = torch.empty(M, device="cuda", dtype=i32), torch.empty(M, device="cuda", dtype=i32)
        summary = torch.zeros(4, device="cuda", dtype=i64)
        g = torch.empty(M, N, device="cuda", dtype=x.dtype)
        if upto >= 1:
            torch.mm(x, wg.t(), out=g)
        if upto >= 2:
            ext.compact(g, N, ell_col, ell_a, nnz, flag, summary, 128)
        if upto >= 3:
            torch.empty(4, dtype=i64, pin_memory=True).copy_(summary, non_blocking=True)

    for k, what in enumerate(("allocations + memset", "+ gate GEMM", "+ compact", "+ pinned copy")):
        res[f"replica: {what}"] = lambda k=k: replica(k)
    print("host us per piece (GPU busy, medians of 30):")
    for name, fn in res.items():
        print(f"  {host_us(fn):8.1f}  {name}")


def main() -> int:
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--p", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--mode", default="auto", choices=["auto", "sparse", "dense"])
    ap.add_argument("--halves-only", action="store_true", help="the fwd/bwd host medians only (any version)")
    args = ap.parse_args()
    K, N = 2048, 5632
    x, (wg, wu, wd), gy = make_case(args.m, K, N, args.p, 0.0, seed=3)
    wd_nm = wd.t().contiguous().t()
    ps = [t.clone().requires_grad_(True) for t in (x, wg, wu)] + [wd_nm.clone().requires_grad_(True)]
    pd = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    gl1 = torch.tensor(1000.0, device="cuda")
    st = DispatchState()

    def ours_fwd():
        for t in ps:
            t.grad = None
        return sparse_gated_ffn_train(*ps, mode=args.mode, state=st)[:2]

    def ours_bwd(out):
        torch.autograd.backward(list(out), [gy, gl1])

    def dense_fwd():
        for t in pd:
            t.grad = None
        return dense_block(*pd, l1=False)[0]

    def dense_bwd(y):
        torch.autograd.backward([y], [gy])

    for _ in range(5):
        ours_bwd(ours_fwd())
        dense_bwd(dense_fwd())
    torch.cuda.synchronize()
    print(f"path {st.last_path}, M {args.m}, p {args.p}")
    of, ob = timed_halves(ours_fwd, ours_bwd, args.reps)
    df, db = timed_halves(dense_fwd, dense_bwd, args.reps)
    print(f"host us, medians of {args.reps}: ours fwd {of:.0f} bwd {ob:.0f} | dense fwd {df:.0f} bwd {db:.0f}")
    if args.halves_only:
        return 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # a host sync inside the forward would print a warning here
    out = ours_fwd()
    torch.cuda.set_sync_debug_mode(0)
    ours_bwd(out)
    pieces(ps, args.m, N)
    for name, fwd, bwd in (("ours", ours_fwd, ours_bwd), ("dense", dense_fwd, dense_bwd)):
        prof = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            prof.enable()
            out = fwd()
            prof.disable()
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            prof.enable()
            bwd(out)
            prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof, stream=io.StringIO()).stats
        rows = sorted(((tt, ct, nc, f"{fn[0].split('/')[-1]}:{fn[1]}({fn[2]})") for fn, (_, nc, tt, ct, _) in
                       stats.items()), reverse=True)[:28]
        print(f"\n==== cProfile, {name}: per fwd+bwd, us (own time, with callees, calls) ====")
        for tt, ct, nc, where in rows:
            print(f"{tt / 10 * 1e6:9.1f} {ct / 10 * 1e6:9.1f} {nc / 10:5.1f}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
