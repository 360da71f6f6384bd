"""Probe: the non-gated block's dense call with the ReLU in the first GEMM's epilogue (cuBLASLt RELU_BIAS through
torch._addmm_activation, zero bias) against HF's linear-relu-linear, which runs the ReLU as its own pass over
[M, N] (175 us of 1.49 ms at M 16384, N 8192: lab/results/kernel_bench.tar.xz: nongated_dense_gap_h100_d7b4945.txt).
Per M: time ratio HF / epilogue (single calls and 8 back to back), whether h is bit-equal to HF's, y's error
against fp32, and the kernels each side runs. GPU only; one JSON row per case.

    PYTHONPATH=. python lab/kernel_bench/relu_epilogue_probe.py
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from sfl.experiments.kernel_bench.bench_inference import BF, make_case, make_weights, rel_err
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.diagnose import kernel_table


def main() -> int:
    timer = Timer()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for K, N in ((2048, 8192), (2048, 5632)):
        w32 = make_weights(K, N, seed=1)
        wd = w32[2].to(BF)
        zero = torch.zeros(N, device="cuda", dtype=BF)
        for M in (64, 1024, 4096, 16384, 65536):
            x, wu = make_case(w32[0], M, K, N, "uniform", 0.02, 0.0, seed=9)
            hf = lambda: F.linear(F.relu(F.linear(x, wu)), wd)  # noqa: E731
            epi = lambda: torch.mm(torch._addmm_activation(zero, x, wu.t()), wd.t())  # noqa: E731
            h_hf, h_epi = F.relu(F.linear(x, wu)), torch._addmm_activation(zero, x, wu.t())
            ref = F.linear(F.relu(F.linear(x.float(), wu.float())), wd.float())
            row = {"K": K, "N": N, "M": M, "h_bits_equal": bool(torch.equal(h_hf, h_epi)),
                   "h_max_abs_diff": (h_hf.float() - h_epi.float()).abs().max().item(),
                   "y_err_hf": rel_err(hf(), ref), "y_err_epi": rel_err(epi(), ref)}
            for calls in (1, 8):
                a, b = timer.time_pair(hf, epi, 20, calls=calls)
                row[f"hf_ms_x{calls}"], row[f"epi_ms_x{calls}"], row[f"ratio_x{calls}"] = a, b, round(a / b, 4)
            if M in (16384, 65536):
                row["kernels_hf"] = kernel_table(hf)[:4]
                row["kernels_epi"] = kernel_table(epi)[:4]
            print(json.dumps(row), flush=True)
            del x, wu, h_hf, h_epi, ref
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
