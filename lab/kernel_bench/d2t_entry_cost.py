"""Trial (lab): what the fused d2t's entry writes cost, by profile: the ping-pong d2t as it is against the same kernel
with no entry written (a lab switch: every active tile treated as overflowing, counts and flags only), with
cuBLAS's gate GEMM beside them. Rotation with the L2 flushed, medians; JSONL with provenance.

    PYTHONPATH=. python lab/kernel_bench/d2t_entry_cost.py --out entry_cost.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.005, 0.0), (65536, "paper", 0.005, 0.001), (65536, "uniform", 0.005, 0.01),
         (65536, "uniform", 0.01, 0.0), (65536, "paper", 0.01, 0.001), (16384, "paper", 0.005, 0.001)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32 = make_weights(K, N)[0]
    prov = collect({"what": "the fused d2t's entry writes, by profile"})
    with open(args.out, "w") as f:
        for i, (M, pattern, p, heavy) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=600 + i)
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            fns = {"d2t": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0),
                   "d2t_no_entries": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 1 << 20),
                   "cublas_gate_gemm": lambda: torch.mm(x, wg.t())}
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            c = counts.clamp(max=S).float()
            per_row = c.sum(1)
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "ms": ms, "entries_per_row_mean": per_row.mean().item(),
                   "entries_per_tile_p99": torch.quantile(c.flatten()[:1 << 24], 0.99).item(),
                   "tiles_over_8": (counts > 8).float().mean().item()}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} heavy={heavy} " + " ".join(f"{k}={v:.3f}" for k, v in ms.items()) +
                  f" per_row={row['entries_per_row_mean']:.1f} p99_tile={row['entries_per_tile_p99']:.0f} "
                  f"tiles>8={row['tiles_over_8']:.4f}", flush=True)
            del x, wg, packed, counts, flag
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
