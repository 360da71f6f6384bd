"""The fused d2t's tile shapes and epilogues over M, two ways: in rotation with the L2 flushed before each call
(medians of --reps) and in a steady loop (back-to-back calls, CUDA events over the loop, after the rotation).
Variants (d2t_gemm's epilogue argument): 0 cooperative 128-row tiles, stash; 5 the same, values picked from
registers; 2 ping-pong 64-row tiles, stash; 4 ping-pong, registers, 4 stages; 3 ping-pong, registers, 5 stages;
1 compaction warps (K >= 4096 only). Checks every variant's TwELL bit for bit against 0 on the tests'
adversarial problems and on each case.

    python lab/kernel_bench/d2t_epilogue_sweep.py --out sweep.jsonl
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

sys.path.insert(0, "lab/kernel_bench")
from d2t_pingpong_ab import outputs, same  # noqa: E402

VARIANTS = {"coop": 0, "coop_regs": 5, "pp": 2, "pp_regs4": 4, "pp_regs5": 3}


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
    sys.path.insert(0, "tests")
    from test_twell_cuda import make_problem

    ext, timer = load_twell(), Timer()
    prov = collect({"what": "d2t epilogue sweep"})
    checks = {}
    for M, K, N in ((1000, 2048, 5632), (129, 576, 1536), (7, 2048, 5632), (300, 4096, 11008)):
        for S in (32, 256):
            x, wg, _, _ = make_problem(M, K, N, 0.01, seed=M + K + S)
            checks[f"M{M} K{K} N{N} S{S}"] = all(same(ext, x, wg, S, 0, v) and same(ext, x, wg, S, 0, v, 3)
                                                 for v in VARIANTS.values())
    print(checks, flush=True)
    S, weights = 32, {}
    cases = [(M, 2048, 5632) for M in (1024, 4096, 8192, 16384, 32768, 65536)] + [(4096, 4096, 11008),
                                                                                 (16384, 4096, 11008)]
    with open(args.out, "w") as f:
        for M, K, N in cases:
            if (K, N) not in weights:
                weights[(K, N)] = make_weights(K, N)[0]
            x, wg = make_case(weights[(K, N)], M, K, N, "uniform", 0.005, 0.0, seed=5)
            o = outputs(M, N // 256, S)
            fns = {k: (lambda v=v: ext.d2t_gemm(x, wg, *o, v, 0)) for k, v in VARIANTS.items()}
            if K >= 4096:
                fns["overlap"] = lambda: ext.d2t_gemm(x, wg, *o, 1, 0)
            fns["cublas_gate_gemm"] = lambda: torch.mm(x, wg.t())
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            calls = max(20, int(400 * 16384 / M))
            ms_steady = {k: steady(fn, calls) for k, fn in fns.items()}
            row = {**prov, "M": M, "K": K, "N": N, "pattern": "uniform", "activity": 0.005, "ms": ms,
                   "ms_steady": ms_steady, "steady_calls": calls,
                   "same_twell": all(same(ext, x, wg, S, 0, v) for v in VARIANTS.values()), "checks": checks}
            f.write(json.dumps(row) + "\n")
            print(M, K, N, {k: round(v, 3) for k, v in ms.items()}, {k: round(v, 3) for k, v in ms_steady.items()},
                  row["same_twell"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
