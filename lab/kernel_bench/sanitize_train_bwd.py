"""The training backward's neuron-major kernels as the op runs them, on inputs built without cuBLAS, so
that compute-sanitizer sees only our kernels: the CSR by neuron, dwd_dh (dW_dT and the dh partial sums through
each warp's shared-memory tile), dh_coef, dw's part 0. Gated and non-gated; K 200 / 576 / 2048 (partial 256-column
slices); slice widths 1 and 2; neurons with more than 32 entries (several chunks); flagged and empty rows.
dW_dT is checked bit for bit against dw's part 1 and cg against bwd_block's within fp32 reordering.

    compute-sanitizer --tool racecheck python lab/kernel_bench/sanitize_train_bwd.py
"""
from __future__ import annotations

import torch

DEV, BF = "cuda", torch.bfloat16


def main() -> int:
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    gen = torch.Generator(device=DEV).manual_seed(3)
    ok_all = True
    for K, N, W, gated in ((2048, 1024, 64, True), (576, 512, 64, False), (200, 256, 32, True)):
        M = 96
        g = (torch.randn(M, N, device=DEV, generator=gen) - 2.0).to(BF)   # ~2% active
        g[:, 5] = 1.0                  # neuron 5 in every row: three chunks of 32 entries
        g[3] = 1.0                     # flagged: nnz > W
        g[6] = -1.0                    # an empty row
        g[7, 9] = float("nan")         # flagged: non-finite
        ell_col = torch.empty(M, W, device=DEV, dtype=torch.int32)
        ell_a = torch.empty(M, W, device=DEV, dtype=BF)
        nnz = torch.empty(M, device=DEV, dtype=torch.int32)
        flag = torch.empty(M, device=DEV, dtype=torch.int32)
        ext.compact(g, N, ell_col, ell_a, nnz, flag, None, 0)
        x, dy = (torch.randn(M, K, device=DEV, generator=gen).to(BF) for _ in range(2))
        wg, wu = ((torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(BF) for _ in range(2))
        wdt = (torch.randn(N, K, device=DEV, generator=gen) / N ** 0.5).to(BF)
        ell_u = torch.randn(M, W, device=DEV, generator=gen) if gated else torch.empty(0, 0, device=DEV)
        l1c = torch.full((1,), 0.01, device=DEV)
        nan = lambda *shape, dtype=torch.float32: torch.full(shape, float("nan"), device=DEV, dtype=dtype)  # noqa: E731
        perm, colptr = ext.csr_by_neuron(ell_col, nnz, flag, N)
        nsub = (K // 8 + 31) // 32
        dwdt_ref = nan(N, K, dtype=BF)
        none = torch.empty(0, 0, device=DEV)
        ext.dw(gated, 1, x, dy, perm, colptr, ell_a, ell_u, none, none, None, None, None, dwdt_ref, dwdt_ref,
               dwdt_ref, 1, 1)
        bg, bu = nan(M, W), nan(M, W)
        ext.bwd_block(gated, dy, wg, wu, wdt, ell_col, ell_a, ell_u if gated else bu, nnz, flag, l1c, bg, bu,
                      dy.new_empty(0, K))
        light = (torch.arange(W, device=DEV)[None, :] < nnz[:, None]) & ~flag.bool()[:, None]
        for nb in (1, 2):
            part, dwdt = nan(nsub, M * W), nan(N, K, dtype=BF)
            ext.dwd_dh(nb, dy, wdt, perm, colptr, ell_a, ell_u, None, dwdt, part)
            cg = nan(M, W)
            cu = nan(M, W) if gated else torch.empty(0, 0, device=DEV)
            ext.dh_coef(gated, part, K, perm, colptr, ell_a, ell_u, l1c, cg, cu)
            dwg, dwu = nan(N, K, dtype=BF), nan(N, K, dtype=BF)
            ext.dw(gated, nb, x, dy, perm, colptr, ell_a, ell_u, cg, cu, None, None, None, dwg if gated else dwu,
                   dwu, dwdt, 0, 1)
            torch.cuda.synchronize()
            same_dwdt = torch.equal(dwdt.view(torch.int16), dwdt_ref.view(torch.int16))
            close = bool(((cg[light] - bg[light]).abs() <= 1e-4 * bg[light].abs().max()).all())
            ok = same_dwdt and close and bool(torch.isfinite(dwu).all()) and int(colptr[6] - colptr[5]) > 64
            ok_all &= ok
            print(f"K {K} N {N} W {W} gated {gated} nb {nb}: dW_dT same bits {same_dwdt}, cg close {close}: "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    print("all ok" if ok_all else "FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
