"""The training forward's light-row kernels as the op runs them (fwd_block's coefficient mode, then dx_slices'
non-gated form over W_dT), on inputs built without cuBLAS, so compute-sanitizer's racecheck sees only our kernels:
gated and non-gated, K 576 / 2048, a light row longer than one window of 1024 entries, flagged rows, an empty row.
Checks y against fwd_rows bit for bit on the light rows.

    compute-sanitizer --tool racecheck python lab/kernel_bench/sanitize_fwd_split.py
"""
from __future__ import annotations

import torch


def main() -> int:
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    dev, bf = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(3)
    for K, N, W, gated in ((2048, 2048, 1280, True), (576, 1024, 64, False), (576, 1536, 1280, True)):
        M = 40
        g = (torch.randn(M, N, device=dev, generator=gen) - 2.3).to(bf)   # ~1% active
        g[3, :1100] = 1.0              # a light row longer than one window (W = 1280) or a flagged one
        g[5] = -1.0                    # an empty row
        g[7, 9] = float("nan")         # flagged: non-finite
        ell_col = torch.empty(M, W, device=dev, dtype=torch.int32)
        ell_a = torch.empty(M, W, device=dev, dtype=bf)
        nnz = torch.empty(M, device=dev, dtype=torch.int32)
        flag = torch.empty(M, device=dev, dtype=torch.int32)
        ext.compact(g, N, ell_col, ell_a, nnz, flag, None, 0)
        x = torch.randn(M, K, device=dev, generator=gen).to(bf)
        wu = (torch.randn(N, K, device=dev, generator=gen) / K ** 0.5).to(bf)
        wdt = (torch.randn(N, K, device=dev, generator=gen) / N ** 0.5).to(bf)
        ys, yr = (torch.full((M, K), float("nan"), device=dev, dtype=bf) for _ in range(2))
        us, ur = (torch.full((M, W), float("nan"), device=dev) for _ in range(2))
        h = torch.full((M, W), float("nan"), device=dev)
        rs, rr = torch.empty(M, device=dev), torch.empty(M, device=dev)
        ext.fwd_block(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, us, ys[:0], rs, h)
        ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, h, h, ys)
        ext.fwd_rows(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, ur, yr, rr)
        torch.cuda.synchronize()
        light = ~flag.bool()
        ok = torch.equal(ys[light], yr[light]) and torch.equal(rs, rr)
        print(f"K {K} N {N} W {W} gated {gated}: light rows {int(light.sum())}, widest {int(nnz[light].max())}, "
              f"y and L1 sums equal fwd_rows: {ok}")
        if not ok:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
