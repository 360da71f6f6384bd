"""A/B (branch lab/d2t-mask): the fused d2t's epilogue with its activity masks from float compares (overlap=2)
against the emulated SIMD compares (overlap=0). Checks the TwELL bit for bit (counts, flags, stored words) on the
benchmark cases and on the tests' adversarial problem (heavy, whole-tile, all-active, zero, NaN/+-Inf rows, odd M);
times both in rotation with the L2 flushed, medians of 15.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell


def outputs(M, T, S):
    return (torch.full((M, T, S), -7, device=DEV, dtype=torch.int32),
            torch.full((M, T), -7, device=DEV, dtype=torch.int32), torch.zeros(M, device=DEV, dtype=torch.int32))


def same(ext, x, wg, S) -> bool:
    M, N = x.shape[0], wg.shape[0]
    T = N // 256
    a, b = outputs(M, T, S), outputs(M, T, S)
    ext.d2t_gemm(x, wg, *a, 0, 0)
    ext.d2t_gemm(x, wg, *b, 2, 0)
    torch.cuda.synchronize()
    valid = torch.arange(S, device=DEV)[None, None, :] < a[1].clamp(max=S)[:, :, None]
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[0][valid], b[0][valid])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, "tests")
    from test_twell_cuda import make_problem

    ext, timer = load_twell(), Timer()
    prov = collect({"what": "d2t epilogue mask A/B"})
    checks = {}
    for M, K, N in ((1000, 2048, 5632), (129, 576, 1536), (7, 2048, 5632), (4096, 2048, 8192)):
        for S in (32, 256):
            x, wg, _, _ = make_problem(M, K, N, 0.01, seed=M + K + S)
            checks[f"adversarial M{M} K{K} N{N} S{S}"] = same(ext, x, wg, S)
    print(checks, flush=True)
    K, N, S = 2048, 5632, 32
    wg32, _, _ = make_weights(K, N)
    with open(args.out, "w") as f:
        for M, pattern, p in ((65536, "uniform", 0.005), (65536, "uniform", 0.0025), (65536, "paper", 0.005),
                              (65536, "uniform", 0.01), (16384, "uniform", 0.005), (4096, "uniform", 0.005)):
            x, wg = make_case(wg32, M, K, N, pattern, p, 0.0, seed=5)
            T = N // 256
            o = outputs(M, T, S)
            fns = {"d2t": lambda: ext.d2t_gemm(x, wg, *o, 0, 0), "d2t_fastmask": lambda: ext.d2t_gemm(x, wg, *o, 2, 0),
                   "cublas_gate_gemm": lambda: torch.mm(x, wg.t())}
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, 15)
            row = {**prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p, "ms": ms,
                   "same_twell": same(ext, x, wg, S), "checks": checks}
            f.write(json.dumps(row) + "\n")
            print(M, pattern, p, {k: round(v, 3) for k, v in ms.items()}, row["same_twell"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
