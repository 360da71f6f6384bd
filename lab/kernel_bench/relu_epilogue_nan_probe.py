"""Probe: does the cuBLASLt ReLU epilogue (torch._addmm_activation, zero bias) keep HF's non-finite pattern? A NaN
row, an Inf row and a row of 3e38 (overflowing to Inf in the products), at four shapes: which rows hold NaN on each
side, whether the isfinite patterns are equal, whether the finite rows are bit-equal, and the NaN counts. GPU only.

    PYTHONPATH=. python lab/kernel_bench/relu_epilogue_nan_probe.py
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
for M, K, N in ((16384, 2048, 8192), (3000, 2048, 8192), (64, 2048, 5632), (1, 2048, 8192)):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 45
    x[0, 5] = float("nan")
    if M > 2:
        x[1, 7] = float("inf")
        x[2, :] = 3e38
    zero = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    hf, ep = F.relu(F.linear(x, w)), torch._addmm_activation(zero, x, w.t())
    first = 3 if M > 3 else 1   # the finite rows
    print(M, "nan rows hf/ep", torch.isnan(hf).any(1)[:3].tolist(), torch.isnan(ep).any(1)[:3].tolist(),
          "isfinite equal", torch.equal(torch.isfinite(hf), torch.isfinite(ep)),
          "finite-row bits equal", torch.equal(hf[first:], ep[first:]),
          "nan count", torch.isnan(hf).sum().item(), torch.isnan(ep).sum().item())
