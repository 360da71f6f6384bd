"""What forcing a path costs: the functional op with mode "dense" and "sparse" beside mode "auto" and beside three
plain F.linear calls (the dense math a caller would write), single calls and steady state. GPU only.

    python -m sfl.experiments.kernel_bench.forced_modes --out runs/kernel_bench/forced_modes.jsonl

A forced path should cost no more than that path does under auto dispatch (auto's row names the path it took), and
explicit dense no more than the three F.linear calls. Each row: one shape, activity and M; per side the median of
single calls (a sync before each), the steady-state time of back-to-back calls and the host time per call
(ffn_call.time_side), each the median over interleaved rounds, and the ratios against F.linear and against auto.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from sfl.kernels.config import KernelConfig
from sfl.kernels.ffn import plan_for, sparse_gated_ffn

from ..trainer.provenance import collect
from .ffn_call import make_weights, time_side

MS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
SHAPES = ((2048, 5632, 0.005), (576, 1536, 0.01))
BUSY_CYCLES = int(2e8)  # ~0.1 s of GPU sleep under each side's host-time loop: longer than the loop's enqueueing


def sides(wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    cfg = KernelConfig()
    return {"three F.linear": lambda x: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
            "auto": lambda x: sparse_gated_ffn(x, wg, wu, wd, config=cfg),
            "forced dense": lambda x: sparse_gated_ffn(x, wg, wu, wd, config=cfg, mode="dense"),
            "forced sparse": lambda x: sparse_gated_ffn(x, wg, wu, wd, config=cfg, mode="sparse")}


def measure(K: int, N: int, p: float, M: int, reps: int, rounds: int) -> dict:
    """One row: every side timed once per round, the sides' order rotated each round (drift in clocks or host load
    falls on all sides alike), and per side the median over rounds of each of its times."""
    wg, wu, wd = make_weights(K, N, p, seed=K + N)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    x[:, 0] = 1  # the gate's bias channel (make_weights)
    r: dict = {"K": K, "N": N, "activity_target": p, "M": M, "rounds": rounds,
               "measured_activity": float((F.linear(x, wg) > 0).float().mean())}
    named = list(sides(wg, wu, wd).items())
    samples: dict[str, list[dict]] = {name: [] for name, _ in named}
    for i in range(rounds):
        for name, side in named[i % len(named):] + named[:i % len(named)]:
            samples[name].append(time_side(side, x, reps, busy_cycles=BUSY_CYCLES))
    for name, got in samples.items():
        r[name] = {k: statistics.median(s[k] for s in got) for k in got[0]}
    r["auto_path"] = plan_for(wg, KernelConfig(), True).info().get("path")
    lin, auto = r["three F.linear"], r["auto"]
    forced_same = r["forced sparse" if r["auto_path"] in ("sparse", "sparse-syncfree") else "forced dense"]
    for kind in ("single_ms", "steady_ms"):
        r[f"forced_dense_vs_linear_{kind[:-3]}"] = lin[kind] / r["forced dense"][kind]
        r[f"forced_same_path_vs_auto_{kind[:-3]}"] = auto[kind] / forced_same[kind]
    return r


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/kernel_bench/forced_modes.jsonl"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="times each side is measured, interleaved")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("forced_modes times the CUDA kernels: run it on a GPU (torch.cuda.is_available() is False)")
    prov = collect()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for K, N, p in SHAPES:
        for M in a.ms:
            r = measure(K, N, p, M, a.reps, a.rounds)
            with a.out.open("a") as f:  # a row per case: a run cut short keeps what it measured
                f.write(json.dumps({**r, **prov}) + "\n")
            print(f"K {K} N {N} p {p} M {M:6d}: forced dense / F.linear single "
                  f"{r['forced_dense_vs_linear_single']:.2f}x steady {r['forced_dense_vs_linear_steady']:.2f}x; "
                  f"auto ({r['auto_path']}) / forced same path single {r['forced_same_path_vs_auto_single']:.2f}x "
                  f"steady {r['forced_same_path_vs_auto_steady']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
