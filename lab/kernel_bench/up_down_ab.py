"""A/B of the large-M up/down step on one TwELL input: gated_up + down (two kernels, fp32 h in device memory),
up_down (one block per row, h in shared memory) and up_list + down_slices (the rows' entries as compact lists, then
y slice-major over W_dT), timed in rotation with the L2 flushed before each call (bench_inference's Timer;
decode_paths' rotation), medians. (At 3bbd7c7 it also ran up_down at 3 blocks per SM, which lost to 4; at b7d99d0
up_list at 4 and 5 blocks per SM, which lost to 6; at c2eeae7 up_list with a 128-thread block, which won on the uniform
profile and lost on the paper-like one; an earlier times slices at 1, 2 and 4 rows per block.) The d2t and the dense FFN are timed beside them for scale.
Writes JSONL rows with provenance.

    PYTHONPATH=. python lab/kernel_bench/up_down_ab.py --out up_down_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, dense_gated, make_case, make_weights
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.0025, 0.0), (65536, "uniform", 0.005, 0.0), (65536, "uniform", 0.01, 0.0),
         (65536, "uniform", 0.02, 0.0), (65536, "uniform", 0.005, 0.01), (65536, "paper", 0.005, 0.001),
         (16384, "uniform", 0.005, 0.0), (16384, "paper", 0.005, 0.001), (4096, "uniform", 0.005, 0.0),
         (4096, "paper", 0.005, 0.001), (8192, "uniform", 0.005, 0.0), (1024, "uniform", 0.0025, 0.0),
         (1024, "uniform", 0.005, 0.0), (8192, "paper", 0.005, 0.001), (32768, "paper", 0.005, 0.001),
         (65536, "paper", 0.01, 0.001), (16384, "paper", 0.01, 0.001)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ext = load_twell()
    timer = Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    wdt = wd.t().contiguous()
    prov = collect({"what": "up_down A/B"})
    empty = torch.empty(0, device=DEV)
    with open(args.out, "w") as f:
        for i, (M, pattern, p, heavy) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=100 + i)
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            hval = torch.empty(M, T, S, device=DEV, dtype=torch.float32)
            ys = {k: torch.empty(M, K, device=DEV, dtype=BF) for k in ("split", "up_down", "list_slices")}
            lcol = torch.empty(M, T * S, device=DEV, dtype=torch.int32)
            lh = torch.empty(M, T * S, device=DEV, dtype=torch.float32)
            lnnz = torch.empty(M, device=DEV, dtype=torch.int32)

            def split():
                ext.gated_up(x, wu, packed, counts, flag, hval, T)
                ext.down(wdt, packed, counts, flag, hval, ys["split"], empty, 4, T, 0)

            def list_slices():
                ext.up_list(x, wu, packed, counts, flag, lcol, lh, lnnz, N)
                ext.down_slices(wdt, lcol, lnnz, flag, lh, ys["list_slices"], 1)

            fns = {"split": split, "list_slices": list_slices,
                   "up_list": lambda: ext.up_list(x, wu, packed, counts, flag, lcol, lh, lnnz, N),
                   "down_slices": lambda: ext.down_slices(wdt, lcol, lnnz, flag, lh, ys["list_slices"], 1),
                   "down_slices_r2": lambda: ext.down_slices(wdt, lcol, lnnz, flag, lh, ys["list_slices"], 2),
                   "down_slices_r4": lambda: ext.down_slices(wdt, lcol, lnnz, flag, lh, ys["list_slices"], 4),
                   "up_down": lambda: ext.up_down(x, wu, wdt, packed, counts, flag, ys["up_down"], 0),
                   "d2t": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0),
                   "dense": lambda: dense_gated(x, wg, wu, wd)}
            for fn in fns.values():   # one warm-up call each
                fn()
            ms = rotate(timer, fns, args.reps)
            ok = ~flag.bool()
            same = torch.equal(ys["up_down"][ok], ys["split"][ok])
            same_list = torch.equal(ys["up_down"][ok], ys["list_slices"][ok])
            nnz = counts.clamp(max=S).sum(1).float()
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "nnz_mean": nnz[ok].mean().item(), "flagged_rows": int((~ok).sum()), "ms": ms,
                   "same_bits": same, "list_same_bits": same_list}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} heavy={heavy} nnz={row['nnz_mean']:.1f} flagged={row['flagged_rows']} "
                  + " ".join(f"{k}={v:.3f}" for k, v in ms.items()) + f" same={same} list_same={same_list}", flush=True)
            del x, wg, packed, counts, flag, hval, ys, lcol, lh, lnnz
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
