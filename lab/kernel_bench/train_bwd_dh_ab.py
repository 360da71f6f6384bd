"""A/B of the training op's light-entry backward, GPU time only (R = 0, no backup rows):
- "coef_rows": bwd_block's coefficients (a whole 4 KB W_dT row per entry, token-major), dx_slices, the CSR by
  neuron, dw with both parts (the op until the neuron-major backward);
- "dh_in_dw": the CSR by neuron, dwd_dh (dW_dT and the dh dot products over dy slices, neuron-major), dh_coef,
  dx_slices, dw's part 0 (the op since the neuron-major backward).
Rotation with the L2 flushed (bench_inference's Timer), medians; dx and the weight gradients compared (dW_dT bit for
bit, the rest within fp32 reordering of dh).

    PYTHONPATH=. python lab/kernel_bench/train_bwd_dh_ab.py --out train_bwd_dh_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.bench_training import BF, DEV, light_rows_case
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect


def variants(M, p, K=2048, N=5632):
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    x, (wg, wu, wd), gy, out = light_rows_case(M, K, N, p)
    ell_col, ell_a, ell_u, nnz, flag = out[2:7]
    W = ell_col.shape[1]
    nb = ops.dw_chunks(M)
    l1c = torch.full((1,), 0.01, device=DEV)
    wdt = wd.t().contiguous()
    res = {k: [torch.empty(M, K, device=DEV, dtype=BF)] + [torch.empty(N, K, device=DEV, dtype=BF) for _ in range(3)]
           for k in ("coef_rows", "dh_in_dw")}
    cg, cu = torch.empty(M, W, device=DEV), torch.empty(M, W, device=DEV)

    def coef_rows():
        dx, dwg, dwu, dwdt = res["coef_rows"]
        ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, l1c, cg, cu, dx[:0])
        ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, dx, 1)
        perm, colptr = ext.csr_by_neuron(ell_col, nnz, flag, N)
        ext.dw(True, nb, x, gy, perm, colptr, ell_a, ell_u, cg, cu, None, None, None, dwg, dwu, dwdt)

    def dh_in_dw():
        dx, dwg, dwu, dwdt = res["dh_in_dw"]
        perm, colptr = ext.csr_by_neuron(ell_col, nnz, flag, N)
        part = torch.empty((K // 8 + 31) // 32, M * W, device=DEV)
        ext.dwd_dh(nb, gy, wdt, perm, colptr, ell_a, ell_u, None, dwdt, part)
        ext.dh_coef(True, part, K, perm, colptr, ell_a, ell_u, l1c, cg, cu)
        ext.dx_slices(True, wg, wu, ell_col, nnz, flag, cg, cu, dx, 1)
        ext.dw(True, nb, x, gy, perm, colptr, ell_a, ell_u, cg, cu, None, None, None, dwg, dwu, dwdt, 0, 1)

    return {"coef_rows": coef_rows, "dh_in_dw": dh_in_dw}, res, int(nnz.sum()), nb


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    timer = Timer()
    prov = collect({"what": "training backward: bwd_block coefficients vs dh inside dW_dT's pass"})
    with open(args.out, "w") as f:
        for M, p in ((16384, 0.005), (16384, 0.01), (65536, 0.005), (65536, 0.01), (4096, 0.01)):
            fns, res, pairs, nb = variants(M, p)
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            a, b = res["coef_rows"], res["dh_in_dw"]
            check = {"dx_rel": rel(b[0], a[0]), "dwg_rel": rel(b[1], a[1]), "dwu_rel": rel(b[2], a[2]),
                     "dwdt_same_bits": torch.equal(b[3].view(torch.int16), a[3].view(torch.int16))}
            ms = rotate(timer, fns, args.reps)
            row = {**prov, "M": M, "K": 2048, "N": 5632, "activity": p, "pairs": pairs, "nb": nb, "ms": ms, **check}
            f.write(json.dumps(row) + "\n")
            print(M, p, {k: round(v, 3) for k, v in ms.items()}, check, flush=True)
            del fns, res
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
