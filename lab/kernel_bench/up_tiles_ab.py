"""A/B of the large-M up step: up_list (a block per row, every entry's W_u row read whole from the L2) against
up_tiles (blocks of bt rows x 4 tiles, K-sliced, each W_u and x slice read once per block) at bt 1024 and 512, on
one TwELL input from the fused d2t; down_slices and the d2t timed beside them. Checks that up_tiles writes
up_list's counts and columns, h within fp32 reordering, and the y of down_slices from both lists against each
other. Rotation with the L2 flushed (medians of --reps), JSONL rows with provenance.

    PYTHONPATH=. python lab/kernel_bench/up_tiles_ab.py --out up_tiles_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.0025, 0.0), (65536, "uniform", 0.005, 0.0), (65536, "uniform", 0.01, 0.0),
         (65536, "uniform", 0.02, 0.0), (65536, "uniform", 0.005, 0.01), (65536, "paper", 0.005, 0.001),
         (32768, "uniform", 0.005, 0.0), (16384, "uniform", 0.005, 0.0), (16384, "paper", 0.005, 0.001)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
    prov = collect({"what": "up_list against up_tiles"})
    with open(args.out, "w") as f:
        for i, (M, pattern, p, heavy) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=300 + i)
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            lists = {k: (torch.empty(M, T * S, device=DEV, dtype=torch.int32),
                         torch.empty(M, T * S, device=DEV, dtype=torch.float32),
                         torch.empty(M, device=DEV, dtype=torch.int32)) for k in ("list", "tiles")}
            ys = {k: torch.empty(M, K, device=DEV, dtype=BF) for k in lists}
            fns = {"d2t": lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0),
                   "up_list": lambda: ext.up_list(x, wu, packed, counts, flag, *lists["list"], N),
                   "up_tiles_1024": lambda: ext.up_tiles(x, wu, packed, counts, flag, *lists["tiles"], 1024),
                   "up_tiles_512": lambda: ext.up_tiles(x, wu, packed, counts, flag, *lists["tiles"], 512),
                   "diag_copies_only": lambda: ext.up_tiles(x, wu, packed, counts, flag, *lists["tiles"], 1024 | 65536),
                   "diag_sums_only": lambda: ext.up_tiles(x, wu, packed, counts, flag, *lists["tiles"], 1024 | 131072),
                   "down_slices": lambda: ext.down_slices(wdt, lists["list"][0], lists["list"][2], flag,
                                                          lists["list"][1], ys["list"], 1)}
            for fn in fns.values():
                fn()
            ext.up_tiles(x, wu, packed, counts, flag, *lists["tiles"], 1024)
            ext.down_slices(wdt, lists["tiles"][0], lists["tiles"][2], flag, lists["tiles"][1], ys["tiles"], 1)
            torch.cuda.synchronize()
            ok = ~flag.bool()
            (c0, h0, n0), (c1, h1, n1) = lists["list"], lists["tiles"]
            listed = (torch.arange(T * S, device=DEV)[None, :] < n0.clamp(min=0)[:, None]) & ok[:, None]
            same_lists = torch.equal(n0[ok], n1[ok]) and torch.equal(c0[listed], c1[listed])
            h_rel = ((h1[listed] - h0[listed]).abs().max() / h0[listed].abs().max()).item()
            y_rel = ((ys["tiles"][ok].float() - ys["list"][ok].float()).norm() / ys["list"][ok].float().norm()).item()
            ms = rotate(timer, fns, args.reps)
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "pairs": int(n0[ok].sum()), "flagged_rows": int((~ok).sum()), "ms": ms,
                   "same_lists": same_lists, "h_max_rel_diff": h_rel, "y_rel_diff": y_rel}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} heavy={heavy} pairs={row['pairs']} " +
                  " ".join(f"{k}={v:.3f}" for k, v in ms.items()) +
                  f" same={same_lists} h_rel={h_rel:.1e} y_rel={y_rel:.1e}", flush=True)
            del x, wg, packed, counts, flag, lists, ys
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
