"""Where a training-op step's time goes, kernel by kernel: the auto path's forward + backward at 0.5% activity
(bench_training's case, its history warmed up), traced with torch.profiler over several back-to-back steps: per
kernel its launches and GPU time per step, the step's span and how much of it the GPU was busy. Then the forward's
light-row kernel against a split of it (the dots alone, the y sum slice-major), by proxies that exist today:
bwd_block's coefficient mode (one dot per pair against W_dT rows, the shape of u = x . W_u[j]) and dx_slices
non-gated over W_dT (y = sum h W_dT[j]); back to back, no flush, as the op runs them.

    PYTHONPATH=. python lab/kernel_bench/trace_train_op.py --out trace_train_op.jsonl
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.experiments.kernel_bench.bench_training import BF, DEV, light_rows_case, make_case
from sfl.experiments.trainer.provenance import collect


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))
from profile_train_step import busy_ms, gaps  # noqa: E402  (the union of kernel intervals; idle gaps by kernel pair)


def op_steps(M: int, p: float):
    """bench_training's case at (M, p): the auto op's fwd+bwd step (its layer history kept across calls) and dense
    autograd's without the L1 term, on the same inputs."""
    from sfl.experiments.kernel_bench.bench_training import dense_block
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    x, (wg, wu, wd), gy = make_case(M, 2048, 5632, p, 0.0, seed=int(p * 1e5) + M)
    params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    gl1 = torch.tensor(1000.0, device=DEV)
    st = DispatchState()

    def ours():
        for t in params:
            t.grad = None
        y, l, _ = sparse_gated_ffn_train(*params, mode="auto", state=st, want_stats=False)
        torch.autograd.backward([y, l], [gy, gl1])

    def dense():
        for t in params:
            t.grad = None
        y, _ = dense_block(*params, l1=False)
        torch.autograd.backward([y], [gy])

    return ours, dense, st


def trace_steps(M: int, p: float, steps: int) -> dict:
    step, _, st = op_steps(M, p)
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    evs = []
    for _ in range(steps):  # event-timed steps, back to back (the host may run ahead)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        evs.append((s, e))
    torch.cuda.synchronize()
    step_ms = statistics.median(s.elapsed_time(e) for s, e in evs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in kern:
        by[e.name[:90]][0] += 1
        by[e.name[:90]][1] += e.time_range.end - e.time_range.start
    span = max(e.time_range.end for e in kern) - min(e.time_range.start for e in kern)
    table = sorted(((n, c / steps, t / steps / 1e3) for n, (c, t) in by.items()), key=lambda r: -r[2])
    return {"M": M, "p": p, "path": st.last_path, "step_ms_events": step_ms, "traced_span_ms": span / steps / 1e3,
            "gpu_busy_ms": busy_ms(kern) / steps, "launches": len(kern) / steps,
            "kernels": [{"name": n, "per_step": c, "ms": round(t, 4)} for n, c, t in table]}


def single_calls(M: int, p: float, reps: int) -> dict:
    """bench_training's regime (one call after an L2 flush and a sync) against the steady state (4 calls back to
    back per timed repetition), ours (auto) and dense without the L1 term alternating; then a profiled single call
    of each: the GPU's idle gaps inside it (host time it waited for), by the kernels around them."""
    from sfl.kernels.timing import PairTimer as Timer

    ours, dense, st = op_steps(M, p)
    for _ in range(6):
        ours()
    timer = Timer()
    one = timer.time_pair(ours, dense, reps)
    four = timer.time_pair(ours, dense, reps, calls=4)
    res = {"M": M, "p": p, "path": st.last_path, "single_call_ms": {"ours": one[0], "dense_noL1": one[1]},
           "four_calls_ms": {"ours": four[0], "dense_noL1": four[1]}}
    for name, fn in (("ours", ours), ("dense_noL1", dense)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                timer.flush.zero_()
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
        evs = prof.events()  # the gaps before the flush's fill kernel are the syncs between calls, not the call's
        res[name + "_busy_ms_per_call_with_flush"] = busy_ms(evs) / 3
        res[name + "_gaps_us"] = [(round(t / 3, 1), c / 3, k) for t, c, k in gaps(evs, min_us=5.0, top=12)]
    return res


def split_proxy(M: int, p: float, reps: int) -> dict:
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    x, (wg, wu, wd), gy, out = light_rows_case(M, 2048, 5632, p)
    ell_col, ell_a, ell_u, nnz, flag = out[2:7]
    W = ell_col.shape[1]
    wdt = wd.t().contiguous()
    l1c = torch.ones(1, device=DEV)
    cg, cu = torch.empty(M, W, device=DEV), torch.empty(M, W, device=DEV)
    y = torch.empty(M, 2048, device=DEV, dtype=BF)
    ra = torch.empty(M, device=DEV)
    none = y.new_empty(0, 2048)
    fns = {
        "fwd_block": lambda: ext.fwd_block(True, x, wu, wdt, ell_col, ell_a, nnz, flag, ell_u, y, ra),
        "dots_proxy": lambda: ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu,
                                            none),
        "y_slices_proxy": lambda: ext.dx_slices(False, wg, wdt, ell_col, nnz, flag, cg, cu, y),
        "dx_slices": lambda: ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, y),
    }
    res = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 5)
        res[name] = round(statistics.median(ts), 4)
    return {"M": M, "p": p, "ell_width": W, "pairs": int(nnz[~flag.bool()].sum()), "ms_back_to_back": res}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--p", type=float, default=0.005)
    ap.add_argument("--ms", default="16384,65536")
    args = ap.parse_args()
    prov = collect({"what": "training op step traced per kernel; forward split proxies"})
    with open(args.out, "w") as f:
        for M in map(int, args.ms.split(",")):
            r = trace_steps(M, args.p, args.steps)
            f.write(json.dumps({**prov, "trace": r}) + "\n")
            print(f"M {M}: path {r['path']} step {r['step_ms_events']:.3f} ms, traced span {r['traced_span_ms']:.3f}"
                  f", busy {r['gpu_busy_ms']:.3f}, {r['launches']:.0f} launches", flush=True)
            for k in r["kernels"]:
                print(f"   {k['ms']:8.4f} ms {k['per_step']:5.1f}x  {k['name']}")
            q = single_calls(M, args.p, 15)
            f.write(json.dumps({**prov, "single_calls": q}) + "\n")
            print(json.dumps(q, indent=1), flush=True)
            q = split_proxy(M, args.p, 15)
            f.write(json.dumps({**prov, "split_proxy": q}) + "\n")
            print(q, flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
