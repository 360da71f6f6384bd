"""The fused d2t alone on the tests' adversarial problems (heavy, whole-tile, all-active, zero and NaN/+-Inf rows,
odd M, both epilogues, S 32 and 256), for compute-sanitizer (no cuBLAS in the kernel under test):

    compute-sanitizer --tool memcheck python lab/kernel_bench/sanitize_d2t.py
"""
from __future__ import annotations

import sys

import torch


def main() -> int:
    sys.path.insert(0, "tests")
    from test_twell_cuda import make_problem

    from sfl.kernels.loader import load_twell

    ext = load_twell()
    for M, K, N in ((1000, 2048, 5632), (129, 576, 1536), (7, 2048, 5632), (300, 4096, 11008)):
        for S in (32, 256):
            for overlap in (False, True):
                x, wg, _, _ = make_problem(M, K, N, 0.01, seed=M + K + S)
                T = N // 256
                packed = torch.full((M, T, S), -7, device="cuda", dtype=torch.int32)
                counts = torch.full((M, T), -7, device="cuda", dtype=torch.int32)
                flag = torch.zeros(M, device="cuda", dtype=torch.int32)
                ext.d2t_gemm(x, wg, packed, counts, flag, overlap, 0)
                torch.cuda.synchronize()
                print(f"M {M} K {K} N {N} S {S} overlap {overlap}: counts written {bool((counts >= 0).all())}, "
                      f"flagged rows {int(flag.sum())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
