"""Diagnostic (branch lab/d2t-mainloop): the fused d2t against its mainloop alone (max_ctas = -1 skips the TwELL
epilogue, nothing written) and cuBLAS's gate GEMM (bf16 [M, N] output), M 65536, K 2048, N 5632, in rotation with
the L2 flushed, medians of 15: how much of the d2t's time over cuBLAS is its epilogue.
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S = 2048, 5632, 32
    wg32, _, _ = make_weights(K, N)
    prov = collect({"what": "d2t mainloop diagnostic"})
    with open(args.out, "w") as f:
        for M, pattern, p in ((65536, "uniform", 0.005), (65536, "uniform", 0.0025), (65536, "paper", 0.005),
                              (16384, "uniform", 0.005)):
            x, wg = make_case(wg32, M, K, N, pattern, p, 0.0, seed=5)
            T = N // 256
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            fns = {"d2t": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0),
                   "d2t_mainloop_only": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, -1),
                   "cublas_gate_gemm": lambda: torch.mm(x, wg.t())}
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, 15)
            row = {**prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p, "ms": ms}
            f.write(json.dumps(row) + "\n")
            print(M, pattern, p, {k: round(v, 3) for k, v in ms.items()}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
