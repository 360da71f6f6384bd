"""The fused d2t's two epilogues against each other by K (what `d2t_overlap_min_k` picks between): ping-pong tiles
whose consumers write TwELL (overlap=False) and 128-row tiles with compaction warps (overlap=True), with cuBLAS's
gate GEMM beside them; uniform 0.5% activity. Checks both epilogues' TwELL bit for bit against each other; times in
rotation with the L2 flushed (medians of --reps) and in a steady loop of back-to-back calls.

    python lab/kernel_bench/d2t_epilogue_by_k.py --out by_k.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, make_case, make_weights
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(M, 2048, 5632) for M in (4096, 65536)] + [(M, 4096, 11008) for M in (4096, 16384, 65536)] + \
        [(M, 8192, 28672) for M in (4096, 16384)]


def outputs(M: int, T: int, S: int):
    return (torch.full((M, T, S), -7, device=DEV, dtype=torch.int32),
            torch.full((M, T), -7, device=DEV, dtype=torch.int32), torch.zeros(M, device=DEV, dtype=torch.int32))


def steady(fn, calls: int) -> float:
    fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    prov = collect({"what": "d2t epilogues by K"})
    S = 32
    with open(args.out, "w") as f:
        for M, K, N in CASES:
            wg32 = make_weights(K, N)[0]
            x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=5)
            del wg32
            a, b = outputs(M, N // 256, S), outputs(M, N // 256, S)
            fns = {"pingpong": lambda: ext.d2t_gemm(x, wg, *a, False, 0),
                   "overlap": lambda: ext.d2t_gemm(x, wg, *b, True, 0),
                   "cublas_gate_gemm": lambda: torch.mm(x, wg.t())}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            valid = torch.arange(S, device=DEV)[None, None, :] < a[1].clamp(max=S)[:, :, None]
            same = torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[0][valid], b[0][valid])
            ms = rotate(timer, fns, args.reps)
            flops = 2.0 * M * K * N
            ms_steady = {k: steady(fn, max(10, int(2e13 / flops))) for k, fn in fns.items()}
            row = {**prov, "M": M, "K": K, "N": N, "activity": 0.005, "ms": ms, "ms_steady": ms_steady,
                   "same_twell": same}
            f.write(json.dumps(row) + "\n")
            print(M, K, N, {k: round(v, 3) for k, v in ms.items()}, {k: round(v, 3) for k, v in ms_steady.items()},
                  same, flush=True)
            del x, wg, a, b
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
