"""A/B of the training backward's light rows: bwd_block alone (dots, coefficients and dx in one block per row, whole
rows of W_dT, W_g and W_u: 69 MB, 37% L2 hit rate) against bwd_block for the dots and coefficients only followed by
dx_slices (dx slice-major: the resident blocks gather one 11.5 MB K slice of W_g and W_u). Rotation with the L2
flushed (bench_inference's Timer), medians; dx checked bit for bit against bwd_rows.

    PYTHONPATH=. python lab/kernel_bench/dx_slices_ab.py --out dx_slices_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.bench_training import BF, DEV, light_rows_case
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect


def main() -> int:
    from sfl.kernels.train import ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    timer = Timer()
    prov = collect({"what": "bwd_block vs bwd_block coefficients + dx_slices"})
    K, N = 2048, 5632
    ext = ops.load_ext()
    with open(args.out, "w") as f:
        for M, p in ((8192, 0.005), (16384, 0.005), (16384, 0.01), (65536, 0.005)):
            x, (wg, wu, wd), gy, out = light_rows_case(M, K, N, p)
            ell_col, ell_a, ell_u, nnz, flag = out[2:7]
            W = ell_col.shape[1]
            wdt = wd.t().contiguous()
            l1c = torch.ones(1, device=DEV)
            cg, cu = torch.empty(M, W, device=DEV), torch.empty(M, W, device=DEV)
            dxs = {k: torch.empty(M, K, device=DEV, dtype=BF) for k in ("rows", "block", "slices")}
            none = dxs["slices"].new_empty(0, K)

            def split():
                ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, none)
                ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, dxs["slices"])

            fns = {"bwd_block": lambda: ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c,
                                                      cg, cu, dxs["block"]),
                   "coefficients_only": lambda: ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz,
                                                              flag, l1c, cg, cu, none),
                   "dx_slices": lambda: ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, dxs["slices"]),
                   "split": split}
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            ext.bwd_rows(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, dxs["rows"])
            ok = ~flag.bool()
            same = torch.equal(dxs["slices"][ok], dxs["rows"][ok])
            row = {**prov, "M": M, "K": K, "N": N, "activity": p, "pairs": int(nnz[ok].sum()), "ell_width": W,
                   "ms": ms, "dx_slices_equal_bwd_rows": same}
            f.write(json.dumps(row) + "\n")
            print(M, p, {k: round(v, 3) for k, v in ms.items()}, same, flush=True)
            del x, wg, wu, wd, gy, out, cg, cu, dxs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
