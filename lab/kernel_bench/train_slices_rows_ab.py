"""A/B of the rows per block of `slices` (common/slices.cu) for the training op's two slice-major sums: the forward's
y over W_dT (one coefficient per entry) and the backward's dx over W_g and W_u (two). The inference op moved to one
row per block earlier (2-6% faster there); the training op runs 4. Same inputs as the op's (bench_training's
light_rows_case: the ELL lists and bwd_block's coefficients), rotation with the L2 flushed, medians; the outputs
checked bit for bit across the block shapes.

    PYTHONPATH=. python lab/kernel_bench/train_slices_rows_ab.py --out train_slices_rows_ab.jsonl
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
    prov = collect({"what": "training slices rows per block A/B"})
    K, N = 2048, 5632
    ext = ops.load_ext()
    with open(args.out, "w") as f:
        for M, p in ((16384, 0.005), (65536, 0.005), (16384, 0.01), (8192, 0.005)):
            x, (wg, wu, wd), gy, out = light_rows_case(M, K, N, p)
            ell_col, ell_a, ell_u, nnz, flag = out[2:7]
            W = ell_col.shape[1]
            wdt = wd.t().contiguous()
            l1c = torch.ones(1, device=DEV)
            cg, cu = torch.empty(M, W, device=DEV), torch.empty(M, W, device=DEV)
            none = torch.empty(0, K, device=DEV, dtype=BF)
            ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, none)
            outs = {(k, r): torch.empty(M, K, device=DEV, dtype=BF) for k in ("y", "dx") for r in (1, 2, 4)}
            fns = {}
            for r in (1, 2, 4):
                fns[f"y_rows{r}"] = (lambda r=r: ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, cg, cg,
                                                                outs[("y", r)], r))
                fns[f"dx_rows{r}"] = (lambda r=r: ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu,
                                                                 outs[("dx", r)], r))
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            ok = ~flag.bool()
            same = all(torch.equal(outs[(k, r)][ok], outs[(k, 4)][ok]) for k in ("y", "dx") for r in (1, 2))
            row = {**prov, "M": M, "K": K, "N": N, "activity": p, "pairs": int(nnz[ok].sum()), "ell_width": W,
                   "ms": ms, "same_bits": same}
            f.write(json.dumps(row) + "\n")
            print(M, p, {k: round(v, 4) for k, v in ms.items()}, same, flush=True)
            del x, wg, wu, wd, gy, out, cg, cu, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
