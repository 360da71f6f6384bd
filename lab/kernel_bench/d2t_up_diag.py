"""Diagnostic of d2t_up (branch lab/d2t-up-diag): why the GEMM slows while its gather warps work. The kernel alone at
M 65536, 0.5% (uniform and paper-like), in rotation with the L2 flushed: gather warps off, on, on with their W_u reads
confined to 64 rows that stay in the L2 (hints bit 2: the lists' h are then wrong), and on without any W_u copy
(hints bit 3: the dots run on stale shared memory), each with the share of rows listed in the kernel. Branch
lab/d2t-up-poll adds hints bit 4: the claim loop polls its band with relaxed loads (no L1 invalidation per poll).
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S, M = 2048, 5632, 32, 65536
    T, m_tiles = N // 256, (M + 127) // 128
    wg32, wu32, _ = make_weights(K, N)
    wu = wu32.to(BF)
    prov = collect({"what": "d2t_up diagnostic"})
    with open(args.out, "w") as f:
        for i, (pattern, p, heavy) in enumerate((("uniform", 0.005, 0.0), ("paper", 0.005, 0.001))):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=100 + i)
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            lcol = torch.empty(M, T * S, device=DEV, dtype=torch.int32)
            lh = torch.empty(M, T * S, device=DEV, dtype=torch.float32)
            lnnz = torch.empty(M, device=DEV, dtype=torch.int32)
            ws = torch.zeros(ext.d2t_up_ws(M), device=DEV, dtype=torch.int32)

            def run(gather: int, hints: int) -> None:
                flag.zero_()
                ws.zero_()
                ext.d2t_up(x, wg, wu, packed, counts, flag, lcol, lh, lnnz, ws, gather, 0, 1, hints)

            variants = {"off": (0, 0), "on": (4, 0), "on_relaxed_polls": (4, 16), "on_no_wu_loads": (4, 8),
                        "on_no_wu_loads_relaxed_polls": (4, 24)}
            fns = {k: (lambda g=g, h=h: run(g, h)) for k, (g, h) in variants.items()}
            fns["d2t"] = lambda: ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, 9)
            listed = {}
            for k, (g, h) in variants.items():
                run(g, h)
                torch.cuda.synchronize()
                units = (M + 7) // 8
                listed[k] = (min(int(ws[m_tiles]), units) - int(ws[m_tiles + 1])) * 8 / M
            row = {**prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p, "heavy_frac": heavy, "ms": ms,
                   "rows_listed_in_kernel": listed}
            f.write(json.dumps(row) + "\n")
            print(pattern, {k: round(v, 3) for k, v in ms.items()}, {k: round(v, 3) for k, v in listed.items()},
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
