"""Trial (lab): host (enqueue) time per FFN call by M, HF's LlamaMLP against our op per mode, the GPU kept busy by a
long kernel so that only host work is measured. GPU only; prints a table."""
from __future__ import annotations

import time

import torch

from sfl.experiments.kernel_bench.ffn_call import sides
from sfl.kernels.config import KernelConfig
from sfl.kernels.twell import ops


def host_us(fn, reps: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return dt


@torch.no_grad()
def main() -> None:
    K, N = 2048, 5632
    m = sides(K, N, 0.005)
    hf = m["hf LlamaMLP"]
    wg, wu, wd = hf.gate_proj.weight, hf.up_proj.weight, hf.down_proj.weight
    stats = torch.zeros(3, device="cuda", dtype=torch.int64)
    print("M     hf   dense  dense+stats  auto+stats  sparse+stats  model-MLP   (us per call, host)")
    for M in (1, 8, 16, 32, 64, 128):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        x[:, 0] = 1
        row = [host_us(lambda: hf(x))]
        for mode, st in (("dense", None), ("dense", stats), ("auto", stats), ("sparse", stats)):
            plan = ops.Plan(KernelConfig(mode=mode))
            row.append(host_us(lambda: ops.ffn(x, wg, wu, wd, plan, st)))
        row.append(host_us(lambda: m["SparseLlamaMLP cuda"](x)))
        print(f"{M:<4d}" + "".join(f"{v:9.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
