"""A/B: the fused d2t with 64-row ping-pong tiles (epilogue 2: one warpgroup's TwELL epilogue runs under the other's
mainloop; 3: the same with 5 stages, the entries' values picked from registers, no stash) against 128-row cooperative tiles (epilogue 0; epilogue 1 = compaction warps, timed too) and cuBLAS's
gate GEMM. Checks the TwELL bit for bit (counts, flags, stored words) between 0 and 2 on the benchmark cases and on
the tests' adversarial problems; times in rotation with the L2 flushed (medians of 15) and in a steady loop of back-to-back calls.

    python lab/kernel_bench/d2t_pingpong_ab.py --out pp.jsonl
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


def same(ext, x, wg, S, ea=0, eb=2, ctas=0) -> bool:
    M, N = x.shape[0], wg.shape[0]
    T = N // 256
    a, b = outputs(M, T, S), outputs(M, T, S)
    ext.d2t_gemm(x, wg, *a, ea, 0)
    ext.d2t_gemm(x, wg, *b, eb, ctas)
    torch.cuda.synchronize()
    valid = torch.arange(S, device=DEV)[None, None, :] < a[1].clamp(max=S)[:, :, None]
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and torch.equal(a[0][valid], b[0][valid])


CASES = ((65536, 2048, 5632, "uniform", 0.005, 0.0), (65536, 2048, 5632, "uniform", 0.0025, 0.0),
         (65536, 2048, 5632, "paper", 0.005, 0.0), (65536, 2048, 5632, "uniform", 0.01, 0.0),
         (65536, 2048, 5632, "uniform", 0.005, 0.01), (16384, 2048, 5632, "uniform", 0.005, 0.0),
         (4096, 2048, 5632, "uniform", 0.005, 0.0), (1024, 2048, 5632, "uniform", 0.005, 0.0),
         (16384, 4096, 11008, "uniform", 0.005, 0.0), (16384, 576, 1536, "uniform", 0.005, 0.0))


def steady(fn, calls: int) -> float:
    """ms per call over back-to-back calls (CUDA events around the loop)"""
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
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--variants", default="coop:0,pp_regs4:4,overlap:1",
                    help="name:epilogue pairs (epilogue 1 runs at K >= 4096 only)")
    args = ap.parse_args()
    args.variants = {k: int(v) for k, v in (item.split(":") for item in args.variants.split(","))}
    sys.path.insert(0, "tests")
    from test_twell_cuda import make_problem

    ext, timer = load_twell(), Timer()
    prov = collect({"what": "d2t ping-pong A/B"})
    checks = {}
    for M, K, N in ((1000, 2048, 5632), (129, 576, 1536), (7, 2048, 5632), (4096, 2048, 8192), (300, 4096, 11008)):
        for S in (32, 256):
            x, wg, _, _ = make_problem(M, K, N, 0.01, seed=M + K + S)
            checks[f"adversarial M{M} K{K} N{N} S{S}"] = all(same(ext, x, wg, S, 0, v) and same(ext, x, wg, S, 0, v, 3)
                                                             for v in args.variants.values())
    print(checks, flush=True)
    S = 32
    weights = {}
    with open(args.out, "w") as f:
        for M, K, N, pattern, p, heavy in CASES:
            if (K, N) not in weights:
                weights[(K, N)] = make_weights(K, N)[0]
            x, wg = make_case(weights[(K, N)], M, K, N, pattern, p, heavy, seed=5)
            o = outputs(M, N // 256, S)
            fns = {name: (lambda v=v: ext.d2t_gemm(x, wg, *o, v, 0)) for name, v in args.variants.items()
                   if v != 1 or K >= 4096}
            fns["cublas_gate_gemm"] = lambda: torch.mm(x, wg.t())
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            calls = max(20, int(400 * 16384 / M))
            ms_steady = {k: steady(fn, calls) for k, fn in fns.items()}
            row = {**prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p, "heavy_rows": heavy, "ms": ms,
                   "ms_steady": ms_steady, "steady_calls": calls, "variants": args.variants,
                   "same_twell": all(same(ext, x, wg, S, 0, v) for v in args.variants.values()), "checks": checks}
            f.write(json.dumps(row) + "\n")
            print(M, K, N, pattern, p, heavy, {k: round(v, 3) for k, v in ms.items()},
                  {k: round(v, 3) for k, v in ms_steady.items()}, row["same_twell"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
