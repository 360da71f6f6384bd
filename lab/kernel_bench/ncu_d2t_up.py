"""Driver for Nsight Compute on the fused d2t with the up step inside (d2t_up) at M 65536, 0.5% uniform, K 2048,
N 5632: two warm-up calls, then one call of each variant (--variant), so that `ncu --launch-skip 2 --launch-count 1`
profiles it. Variants: up (gather warps on), off (gather warps off: the 3-stage GEMM), base (d2t_gemm).

    ncu --clock-control none --kernel-name regex:d2t_gemm_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats \
        python lab/kernel_bench/ncu_d2t_up.py --variant up

Runs against the sources of commit 063b7da (d2t_up left the production path: kernels/README.md, round 13).
"""
from __future__ import annotations

import argparse

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, make_case, make_weights
from sfl.kernels.loader import load_twell


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=("up", "off", "base"), default="up")
    args = ap.parse_args()
    ext = load_twell()
    K, N, S, M = 2048, 5632, 32, 65536
    T = N // 256
    wg32, wu32, _ = make_weights(K, N)
    wu = wu32.to(torch.bfloat16)
    x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=101)
    packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
    counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
    flag = torch.zeros(M, device=DEV, dtype=torch.int32)
    lcol = torch.empty(M, T * S, device=DEV, dtype=torch.int32)
    lh = torch.empty(M, T * S, device=DEV, dtype=torch.float32)
    lnnz = torch.empty(M, device=DEV, dtype=torch.int32)
    ws = torch.zeros(ext.d2t_up_ws(M), device=DEV, dtype=torch.int32)
    for _ in range(3):
        ws.zero_()
        if args.variant == "base":
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
        else:
            ext.d2t_up(x, wg, wu, packed, counts, flag, lcol, lh, lnnz, ws, 4 if args.variant == "up" else 0, 0)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
