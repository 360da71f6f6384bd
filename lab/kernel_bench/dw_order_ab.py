"""A/B of the training op's weight-gradient kernel (dw) by work order: neuron-major (order 0: a neuron's K slices
and both parts on adjacent warps, every resident warp reading whole rows of x and dy, 128 MB at M 16384) against
slice-major (order 1: part, then K slice, then neuron, so that the warps resident at once read one K slice of one
of x / dy, 16 MB at nb 2). Nsight Compute at 296005 read a 23% L2 hit rate and 83% DRAM throughput for dw.
Times every nb x order in rotation with the L2 flushed (bench_inference's Timer), checks identical bits.

    PYTHONPATH=. python lab/kernel_bench/dw_order_ab.py --out dw_order_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.bench_training import BF, DEV, light_rows_case
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect


def case(M, p, K=2048, N=5632):
    from sfl.kernels import reference as ref
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    x, (wg, wu, wd), gy, out = light_rows_case(M, K, N, p)
    y, l1, ell_col, ell_a, ell_u, nnz, flag, brow, backup = out[:9]
    W = ell_col.shape[1]
    wdt = wd.t().contiguous()
    cg = torch.empty(M, W, device=DEV)
    cu = torch.empty(M, W, device=DEV)
    dx = torch.empty(M, K, device=DEV, dtype=BF)
    ext.bwd_block(True, gy, wg, wu, wdt, ell_col, ell_a, ell_u, nnz, flag, torch.ones(1, device=DEV), cg, cu, dx)
    perm, colptr = ref.csr_by_neuron(ops.saved_hybrid(ell_col, ell_a, nnz, brow, backup, N))
    return ext, x, gy, perm, colptr, ell_a, ell_u, cg, cu, int(nnz.sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    timer = Timer()
    prov = collect({"what": "dw work-order A/B"})
    K, N = 2048, 5632
    with open(args.out, "w") as f:
        for M, p in ((16384, 0.005), (16384, 0.01), (65536, 0.005)):
            ext, x, gy, perm, colptr, ell_a, ell_u, cg, cu, pairs = case(M, p)
            outs, fns = {}, {}
            for nb in (1, 2, 4, 8):
                for order in (0, 1):
                    o = [torch.empty(N, K, device=DEV, dtype=BF) for _ in range(3)]
                    outs[(nb, order)] = o
                    fns[f"nb{nb}_o{order}"] = (lambda nb=nb, order=order, o=o: ext.dw(
                        True, nb + 16 * order, x, gy, perm, colptr, ell_a, ell_u, cg, cu, None, None, None, *o))
            for fn in fns.values():
                fn()
            ms = rotate(timer, fns, args.reps)
            ref_o = outs[(4, 0)]
            for (nb, order), o in outs.items():
                same = all(torch.equal(a, b) for a, b in zip(o, ref_o))
                row = {**prov, "M": M, "K": K, "N": N, "activity": p, "pairs": pairs, "nb": nb, "order": order,
                       "ms": ms[f"nb{nb}_o{order}"], "GB_per_s": pairs * 2 * K * 2 / 1e9 / (ms[f"nb{nb}_o{order}"] / 1e3),
                       "same_bits_as_nb4_o0": same}
                f.write(json.dumps(row) + "\n")
                print(M, p, nb, order, f"{row['ms']:.3f} ms", f"{row['GB_per_s']:.0f} GB/s", same, flush=True)
            del ext, x, gy, perm, colptr, ell_a, ell_u, cg, cu, outs, fns
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
