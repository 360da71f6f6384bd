"""A/B of the large-M gated path's first two steps: the fused d2t then up_list (today's path) against the fused d2t
with the up step inside (d2t_up: gather warps list the rows of finished row bands during the GEMM; a follow-up
up_list takes the rest), each followed by the same down step (down_slices). Also d2t_up with its gather warps off
(the GEMM at 3 stages alone) to separate the ring's cost from the overlap, and both paths with the d2t's CTA pairs
sharing each W_g tile (d2t_cluster 2). Checks, per case, that both paths give
the same TwELL counts and flags, the same lists and the same y bits on every unflagged row; logs the share of rows
the gather warps listed. Timed in rotation with the L2 flushed before each call, medians. JSONL with provenance.

    PYTHONPATH=. python lab/kernel_bench/d2t_up_ab.py --out d2t_up_ab.jsonl

The variants it times left the production path after these measurements (kernels/README.md, round 13;
kernels/lab/README.md): run it against the sources of commit 063b7da (`git worktree add ../d2t_up 063b7da`), which
have d2t_up, the d2t's `cluster` argument and up_list's `rest`. Logs: lab/results/kernel_bench/d2t_up/.
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, Timer, dense_gated, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.005, 0.0), (65536, "paper", 0.005, 0.001), (65536, "uniform", 0.0025, 0.0),
         (65536, "uniform", 0.01, 0.0), (65536, "uniform", 0.005, 0.01), (16384, "uniform", 0.005, 0.0),
         (16384, "paper", 0.005, 0.001), (32768, "paper", 0.005, 0.001), (65536, "paper", 0.01, 0.001)]


def same_lists(lnnz0, lcol0, lh0, lnnz1, lcol1, lh1, ok) -> bool:
    if not torch.equal(lnnz0[ok], lnnz1[ok]):
        return False
    width = lcol0.shape[1]
    valid = (torch.arange(width, device=DEV)[None, :] < lnnz0[:, None]) & ok[:, None]
    return torch.equal(lcol0[valid], lcol1[valid]) and torch.equal(lh0[valid].view(torch.int32),
                                                                   lh1[valid].view(torch.int32))


def in_kernel(ws: torch.Tensor, m_tiles: int, M: int) -> float:
    """Share of the rows d2t_up's gather warps listed: the claimed units less the abandoned ones."""
    units = (M + 7) // 8
    return (min(int(ws[m_tiles].item()), units) - int(ws[m_tiles + 1].item())) * 8 / M


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    args = ap.parse_args()
    ext = load_twell()
    timer = Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    wdt = wd.t().contiguous()
    prov = collect({"what": "d2t_up A/B"})
    cases = CASES[:2] if args.quick else CASES
    with open(args.out, "w") as f:
        for i, (M, pattern, p, heavy) in enumerate(cases):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=100 + i)
            m_tiles = (M + 127) // 128
            bufs = []
            for _ in range(2):   # [0]: d2t + up_list, [1]: d2t_up + the follow-up
                bufs.append(dict(packed=torch.empty(M, T, S, device=DEV, dtype=torch.int32),
                                 counts=torch.empty(M, T, device=DEV, dtype=torch.int32),
                                 flag=torch.zeros(M, device=DEV, dtype=torch.int32),
                                 lcol=torch.empty(M, T * S, device=DEV, dtype=torch.int32),
                                 lh=torch.empty(M, T * S, device=DEV, dtype=torch.float32),
                                 lnnz=torch.empty(M, device=DEV, dtype=torch.int32),
                                 y=torch.empty(M, K, device=DEV, dtype=BF)))
            a, b = bufs
            ws = torch.zeros(ext.d2t_up_ws(M), device=DEV, dtype=torch.int32)

            def today(cluster: int = 1):
                a["flag"].zero_()
                ext.d2t_gemm(x, wg, a["packed"], a["counts"], a["flag"], False, 0, cluster)
                ext.up_list(x, wu, a["packed"], a["counts"], a["flag"], a["lcol"], a["lh"], a["lnnz"], N)
                ext.down_slices(wdt, a["lcol"], a["lnnz"], a["flag"], a["lh"], a["y"], 1)

            def fused(gather: int = 4, down: bool = True, cluster: int = 1, hints: int = 0):
                b["flag"].zero_()
                ws.zero_()
                ext.d2t_up(x, wg, wu, b["packed"], b["counts"], b["flag"], b["lcol"], b["lh"], b["lnnz"], ws,
                           gather, 0, cluster, hints)
                ext.up_list(x, wu, b["packed"], b["counts"], b["flag"], b["lcol"], b["lh"], b["lnnz"], N,
                            rest=ws[m_tiles:])
                if down:
                    ext.down_slices(wdt, b["lcol"], b["lnnz"], b["flag"], b["lh"], b["y"], 1)

            def fused_gemm_only(gather: int, cluster: int = 1, hints: int = 0):
                b["flag"].zero_()
                ws.zero_()
                ext.d2t_up(x, wg, wu, b["packed"], b["counts"], b["flag"], b["lcol"], b["lh"], b["lnnz"], ws,
                           gather, 0, cluster, hints)

            checks = {}
            for name, run_b in (("up", lambda: fused()), ("pair", lambda: today(2)), ("pair_up", lambda: fused(4, True, 2)),
                                ("pair_up_hints", lambda: fused(4, True, 2, 1)), ("lsu", lambda: fused(4, True, 1, 2))):
                today()
                if name == "pair":   # the CTA-pair d2t into b's buffers: d2t + up_list + slices as today
                    b["flag"].zero_()
                    ext.d2t_gemm(x, wg, b["packed"], b["counts"], b["flag"], False, 0, 2)
                    ext.up_list(x, wu, b["packed"], b["counts"], b["flag"], b["lcol"], b["lh"], b["lnnz"], N)
                    ext.down_slices(wdt, b["lcol"], b["lnnz"], b["flag"], b["lh"], b["y"], 1)
                else:
                    run_b()
                torch.cuda.synchronize()
                ok = ~a["flag"].bool()
                checks[name] = (torch.equal(a["counts"], b["counts"]) and torch.equal(a["flag"], b["flag"])
                                and same_lists(a["lnnz"], a["lcol"], a["lh"], b["lnnz"], b["lcol"], b["lh"], ok)
                                and torch.equal(a["y"][ok], b["y"][ok]))
            fused()
            torch.cuda.synchronize()
            listed_in_kernel = in_kernel(ws, m_tiles, M)
            fns = {"today": today, "today_pair": lambda: today(2), "fused_up": fused,
                   "fused_up_pair": lambda: fused(4, True, 2), "fused_up_gather_off": lambda: fused(0),
                   "fused_up_hints": lambda: fused(4, True, 1, 1), "fused_up_pair_hints": lambda: fused(4, True, 2, 1),
                   "fused_up_lsu": lambda: fused(4, True, 1, 2), "fused_up_lsu_hints": lambda: fused(4, True, 1, 3),
                   "d2t_up_kernel_lsu": lambda: fused_gemm_only(4, 1, 2),
                   "d2t_up_kernel_hints": lambda: fused_gemm_only(4, 1, 1),
                   "d2t_up_kernel_gather_off_hints": lambda: fused_gemm_only(0, 1, 1),
                   "d2t": lambda: ext.d2t_gemm(x, wg, a["packed"], a["counts"], a["flag"], False, 0),
                   "d2t_pair": lambda: ext.d2t_gemm(x, wg, a["packed"], a["counts"], a["flag"], False, 0, 2),
                   "d2t_up_kernel_pair": lambda: fused_gemm_only(4, 2),
                   "d2t_up_kernel": lambda: fused_gemm_only(4),
                   "d2t_up_kernel_2_in_flight": lambda: fused_gemm_only(2),
                   "d2t_up_kernel_1_in_flight": lambda: fused_gemm_only(1),
                   "d2t_up_kernel_gather_off": lambda: fused_gemm_only(0),
                   "up_list": lambda: ext.up_list(x, wu, a["packed"], a["counts"], a["flag"], a["lcol"], a["lh"],
                                                  a["lnnz"], N),
                   "down_slices": lambda: ext.down_slices(wdt, a["lcol"], a["lnnz"], a["flag"], a["lh"], a["y"], 1),
                   "dense": lambda: dense_gated(x, wg, wu, wd)}
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            listed_timed = {}
            for g in (1, 2, 4):   # the share of rows listed in the kernel at each depth (the last call's)
                fused(g)
                torch.cuda.synchronize()
                listed_timed[g] = in_kernel(ws, m_tiles, M)
            for key, cl, hi in (("pair", 2, 0), ("hints", 1, 1), ("pair_hints", 2, 1), ("lsu", 1, 2)):
                fused(4, True, cl, hi)
                torch.cuda.synchronize()
                listed_timed[key] = in_kernel(ws, m_tiles, M)
            nnz = a["counts"].clamp(max=S).sum(1).float()
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "nnz_mean": nnz[ok].mean().item(), "flagged_rows": int((~ok).sum()), "ms": ms, "checks": checks,
                   "rows_listed_in_kernel": listed_in_kernel, "rows_listed_in_kernel_timed": listed_timed}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} heavy={heavy} nnz={row['nnz_mean']:.1f} in-kernel={listed_timed} "
                  + " ".join(f"{k}={v:.3f}" for k, v in ms.items()) + f" checks={checks}", flush=True)
            del x, wg, bufs, a, b, ws
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
