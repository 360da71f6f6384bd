"""The light-row kernels as the ops run them, on inputs built without cuBLAS, so that compute-sanitizer's racecheck
sees only our kernels:
- the training forward: fwd_block's coefficients (an empty y), then dx_slices' non-gated form over W_dT;
- the training backward: bwd_block's coefficients (an empty dx), then dx_slices;
- the inference op's large-M step: up_list, then down_slices (common/slices.cu).
Gated and non-gated, K 576 / 2048, a light row longer than one window (1024 entries for the training kernels, several
TwELL windows for up_list at S = 256), flagged rows, an empty row. Each result is checked bit for bit against the
one-kernel form (fwd_rows, bwd_rows, up_down) on the light rows.

    compute-sanitizer --tool racecheck python lab/kernel_bench/sanitize_split_kernels.py
(was sanitize_fwd_split.py, the forward alone, until f636cc6)
"""
from __future__ import annotations

import torch

DEV, BF = "cuda", torch.bfloat16


def training(gen: torch.Generator) -> bool:
    from sfl.kernels.train import ops

    ext = ops.load_ext()
    ok_all = True
    for K, N, W, gated in ((2048, 2048, 1280, True), (576, 1024, 64, False), (576, 1536, 1280, True)):
        M = 40
        g = (torch.randn(M, N, device=DEV, generator=gen) - 2.3).to(BF)   # ~1% active
        g[3, :1100] = 1.0              # a light row longer than one window (W = 1280) or a flagged one
        g[5] = -1.0                    # an empty row
        g[7, 9] = float("nan")         # flagged: non-finite
        ell_col = torch.empty(M, W, device=DEV, dtype=torch.int32)
        ell_a = torch.empty(M, W, device=DEV, dtype=BF)
        nnz = torch.empty(M, device=DEV, dtype=torch.int32)
        flag = torch.empty(M, device=DEV, dtype=torch.int32)
        ext.compact(g, N, ell_col, ell_a, nnz, flag, None, 0)
        x, dy = (torch.randn(M, K, device=DEV, generator=gen).to(BF) for _ in range(2))
        wg, wu = ((torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(BF) for _ in range(2))
        wdt = (torch.randn(N, K, device=DEV, generator=gen) / N ** 0.5).to(BF)
        nan = lambda *shape, dtype=torch.float32: torch.full(shape, float("nan"), device=DEV, dtype=dtype)  # noqa: E731
        ys, yr = nan(M, K, dtype=BF), nan(M, K, dtype=BF)
        us, ur, h = nan(M, W), nan(M, W), nan(M, W)
        rs, rr = torch.empty(M, device=DEV), torch.empty(M, device=DEV)
        ext.fwd_block(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, us, ys[:0], rs, h)
        for rows in (4, 2, 1):   # every block shape of slices (the op runs 1 since the neuron-major backward); the last one is checked
            ext.dx_slices(False, wdt, wdt, ell_col, nnz, flag, h, h, ys, rows)
        ext.fwd_rows(gated, x, wu, wdt, ell_col, ell_a, nnz, flag, ur, yr, rr)
        l1c = torch.full((1,), 0.01, device=DEV)
        dxs, dxr = nan(M, K, dtype=BF), nan(M, K, dtype=BF)
        cgs, cus, cgr, cur = nan(M, W), nan(M, W), nan(M, W), nan(M, W)
        ext.bwd_block(gated, dy, wg, wu, wdt, ell_col, ell_a, ur, nnz, flag, l1c, cgs, cus, dxs[:0])
        for rows in (4, 2, 1):
            ext.dx_slices(gated, wg, wu, ell_col, nnz, flag, cgs, cus, dxs, rows)
        ext.bwd_rows(gated, dy, wg, wu, wdt, ell_col, ell_a, ur, nnz, flag, l1c, cgr, cur, dxr)
        torch.cuda.synchronize()
        light = ~flag.bool()
        fwd_ok = torch.equal(ys[light], yr[light]) and torch.equal(rs, rr)
        bwd_ok = torch.equal(dxs[light], dxr[light])
        print(f"training K {K} N {N} W {W} gated {gated}: light rows {int(light.sum())}, widest "
              f"{int(nnz[light].max())}, forward equals fwd_rows: {fwd_ok}, backward equals bwd_rows: {bwd_ok}")
        ok_all &= fwd_ok and bwd_ok
    return ok_all


def inference(gen: torch.Generator) -> bool:
    from sfl.kernels.loader import load_twell

    ext = load_twell()
    ok_all = True
    for K, N, S, gated in ((2048, 2048, 32, True), (2048, 2560, 256, False), (576, 2560, 256, True)):
        M, T = 40, N // 256
        g = (torch.randn(M, N, device=DEV, generator=gen) - 2.3).to(BF)
        g[3, :1100] = 1.0              # every tile full: flagged at S = 32, several windows at S = 256
        g[5] = -1.0
        g[7, 9] = float("nan")
        packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
        counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
        flag = torch.zeros(M, device=DEV, dtype=torch.int32)
        ext.compact(g, N, packed, counts, flag)
        x = torch.randn(M, K, device=DEV, generator=gen).to(BF)
        wu = (torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(BF)
        wdt = (torch.randn(N, K, device=DEV, generator=gen) / N ** 0.5).to(BF)
        none = torch.empty(0, device=DEV, dtype=BF)
        xg, wug = (x, wu) if gated else (none, none)
        y1 = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
        ext.up_down(xg, wug, wdt, packed, counts, flag, y1, 0)
        light = ~flag.bool()
        lcol = torch.full((M, T * S), -1, device=DEV, dtype=torch.int32)
        lh = torch.full((M, T * S), float("nan"), device=DEV)
        lnnz = torch.zeros(M, device=DEV, dtype=torch.int32)
        ext.up_list(xg, wug, packed, counts, flag, lcol, lh, lnnz, N)
        for rows in (4, 2, 1):   # slices' rows per block
            y2 = torch.full((M, K), float("nan"), device=DEV, dtype=BF)
            ext.down_slices(wdt, lcol, lnnz, flag, lh, y2, rows)
            torch.cuda.synchronize()
            ok = K < 2048 or torch.equal(y1[light], y2[light])   # the same sums where up_down runs one share
            ok &= bool(torch.isfinite(y2[light]).all())
            print(f"inference K {K} N {N} S {S} gated {gated} slices {rows} rows per block: light rows "
                  f"{int(light.sum())}, widest {int(lnnz[light].max())}, up_list + down_slices equal up_down: {ok}")
            ok_all &= ok
    return ok_all


def main() -> int:
    gen = torch.Generator(device=DEV).manual_seed(3)
    return 0 if training(gen) & inference(gen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
