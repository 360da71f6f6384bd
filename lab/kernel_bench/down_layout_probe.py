"""Trial (lab): does storing W_d neuron-major (kernels/layout.py) change the speed of the dense GEMMs that read it?

The model keeps down_proj.weight neuron-major for mlp_impl="cuda", so its dense-dispatched calls and the training
op's dense path run cuBLAS on the other layout than HF's row-major nn.Linear. Per M, in one rotation (ABAB, CUDA
events, L2 flushed, medians), the GEMMs that read W_d with each layout (K = 2048, N = 5632):
- y = F.linear(h, W_d) (inference and training forward, dense path);
- dh = gy @ W_d (training backward, dense path);
- dW_d = gy^T h into row-major, against (h^T gy)^T into neuron-major (what _FusedDenseFFN returns for each).
One JSONL row per (GEMM, M) with provenance.

    PYTHONPATH=. python lab/kernel_bench/down_layout_probe.py --out /tmp/down_layout.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sfl.experiments.kernel_bench.bench_inference import BF, DEV
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.trainer.provenance import collect


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    K, N = 2048, 5632
    g = torch.Generator(device=DEV).manual_seed(5)
    wd = (torch.randn(K, N, device=DEV, generator=g) / N ** 0.5).to(BF)
    wd_nm = wd.t().contiguous().t()
    timer = Timer()
    prov = collect({"what": "dense GEMMs on W_d by its layout"})
    rows = []
    for M in (1, 8, 64, 512, 4096, 16384, 65536):
        h = torch.relu(torch.randn(M, N, device=DEV, generator=g)).to(BF)
        gy = torch.randn(M, K, device=DEV, generator=g).to(BF)
        cases = {"y = F.linear(h, W_d)": (lambda: F.linear(h, wd), lambda: F.linear(h, wd_nm)),
                 "dh = gy @ W_d": (lambda: gy @ wd, lambda: gy @ wd_nm)}
        if M >= 512:
            cases["dW_d"] = (lambda: gy.t() @ h, lambda: (h.t() @ gy).t())
        for name, (row, nm) in cases.items():
            a, b = row(), nm()
            assert (a.float() - b.float()).abs().max().item() <= 0.02 * a.float().abs().max().item() + 1e-3, name
            t_row, t_nm = timer.time_pair(row, nm, args.reps, warmup=3)
            r = {"gemm": name, "M": M, "K": K, "N": N, "row_major_ms": t_row, "neuron_major_ms": t_nm,
                 "neuron_major_over_row_major": t_nm / t_row, "provenance": prov}
            rows.append(r)
            print(f"{name:22s} M {M:6d}  row-major {t_row:8.4f} ms  neuron-major {t_nm:8.4f} ms  "
                  f"ratio {t_nm / t_row:.3f}", flush=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
