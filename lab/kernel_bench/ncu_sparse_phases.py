"""Driver for Nsight Compute: one warm-up and one profiled call of each sparse phase at the target operating
point (inference M 65536 and training M 16384, 0.5% uniform, K 2048, N 5632), so that `ncu --kernel-name` can read
the hardware counters of d2t, up_down and the training op's pair-proportional kernels. With the argument `split`:
the inference op's large-M steps instead (up_list + down_slices) at 0.5% and 1%, nothing else.

    ncu --clock-control none --kernel-name regex:'up_down|d2t|fwd_block|bwd_block|dw_' --launch-skip 0 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python lab/kernel_bench/ncu_sparse_phases.py
"""
from __future__ import annotations

import torch

from sfl.experiments.kernel_bench import bench_training as bt
from sfl.experiments.kernel_bench.bench_inference import BF, DEV, make_case, make_weights, twell_buffers
from sfl.kernels.loader import load_twell


def inference(M: int = 65536, p: float = 0.005) -> None:
    ext = load_twell()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
    x, wg = make_case(wg32, M, K, N, "uniform", p, 0.0, seed=101)
    packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
    counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
    flag = torch.zeros(M, device=DEV, dtype=torch.int32)
    y = torch.empty(M, K, device=DEV, dtype=BF)
    for _ in range(2):
        ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
        ext.up_down(x, wu, wdt, packed, counts, flag, y, 0)
    torch.cuda.synchronize()


def inference_split(M: int = 65536) -> None:
    """up_list + down_slices (the op's steps from up_list_min_m rows) at 0.5% and 1%, one warm-up call each."""
    ext = load_twell()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
    for p in (0.005, 0.01):
        x, wg = make_case(wg32, M, K, N, "uniform", p, 0.0, seed=101)
        packed, counts, flag, lcol, lh, lnnz = twell_buffers(M, T, S)
        y = torch.empty(M, K, device=DEV, dtype=BF)
        ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
        for _ in range(2):
            ext.up_list(x, wu, packed, counts, flag, lcol, lh, lnnz, N)
            ext.down_slices(wdt, lcol, lnnz, flag, lh, y, 1)
        torch.cuda.synchronize()
        del x, wg, packed, counts, flag, lcol, lh, lnnz, y


def training(M: int = 16384, p: float = 0.005) -> None:
    from sfl.kernels.train_ffn import sparse_gated_ffn_train

    x, ws, gy = bt.make_case(M, 2048, 5632, p, 0.0, seed=7)
    params = [t.clone().requires_grad_(True) for t in (x, *ws)]
    for _ in range(2):
        y, l, _ = sparse_gated_ffn_train(*params, mode="sparse")
        torch.autograd.backward([y, l], [gy, torch.tensor(1000.0, device=DEV)])
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["split"]:
        inference_split()
    else:
        inference()
        training()
