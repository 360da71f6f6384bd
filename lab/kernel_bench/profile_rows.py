"""One row-decode FFN call per M, for Nsight Compute: where decode_rows' time goes at M = 16 / 32 / 64 (the row
decode grows by ~9 us from M = 16 to 32 and by ~3 us from 32 to 64 in decode_paths_h100_r18).

    ncu --kernel-name regex:decode_rows --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python lab/kernel_bench/profile_rows.py
"""
import torch

from sfl.experiments.kernel_bench.bench_inference import make_case, make_weights
from sfl.kernels.config import KernelConfig
from sfl.kernels.ffn import sparse_gated_ffn
from sfl.kernels.twell import ops

K, N = 2048, 5632
wg32, wu32, wd32 = make_weights(K, N)
wu, wd = wu32.to(torch.bfloat16), wd32.to(torch.bfloat16)
plan = ops.Plan(KernelConfig(mode="sparse", fused_decode_max_m=0))
for M in (16, 32, 64):
    x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=M)
    for _ in range(2):
        sparse_gated_ffn(x, wg, wu, wd, plan=plan)
    torch.cuda.synchronize()
    print("M", M, plan.info()["d2t"], flush=True)
