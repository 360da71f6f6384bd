"""Trial (lab): wall time of the training op's fwd+bwd (0.5%, K 2048, N 5632) with each glue change switched back
to the torch code it replaced, in one process; a chrome trace of one call per variant. GPU only.

    PYTHONPATH=. python lab/speed/train_op_variants.py OUTDIR

Stale since the op's glue moved into one C++ call per half (kernels/train/binding.cpp, ffn_fwd / ffn_bwd): the
Python functions it swaps out are gone; run it at a commit before that change (its logs: lab/speed/logs/).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.experiments.kernel_bench.bench_training import make_case
from sfl.kernels import reference as ref
from sfl.kernels.train import ops
from sfl.kernels.train_ffn import sparse_gated_ffn_train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_paths import ev_ms  # noqa: E402  (the same CUDA-event timer)


class TorchTranspose:
    """The extension with its transpose swapped for torch's copy."""
    def __init__(self, ext):
        self.ext = ext

    def __getattr__(self, k):
        return getattr(self.ext, k)

    def transpose(self, t):
        return t.t().contiguous()


def main() -> None:
    out = sys.argv[1]
    ext = ops.load_ext()
    real_load, real_csr = ops.load_ext, ops.csr_by_neuron_cuda
    variants = {
        "new": (real_load, real_csr),
        "torch transpose": (lambda verbose=False: TorchTranspose(ext), real_csr),
        "torch sort": (real_load, lambda hy, flag, e: ref.csr_by_neuron(hy)),
        "both torch": (lambda verbose=False: TorchTranspose(ext), lambda hy, flag, e: ref.csr_by_neuron(hy)),
    }
    rows = []
    for M in (16384, 8192):
        x, (wg, wu, wd), gy = make_case(M, 2048, 5632, 0.005, 0.0, seed=M)
        params = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        gl1 = torch.tensor(1000.0, device="cuda")

        def step():
            for t in params:
                t.grad = None
            y, l, _ = sparse_gated_ffn_train(*params, mode="sparse")
            torch.autograd.backward([y, l], [gy, gl1])

        def fwd():
            y, l, _ = sparse_gated_ffn_train(*params, mode="sparse")
            return y

        res = {"M": M}
        for rep in range(2):
            for name, (ld, csr) in variants.items():
                ops.load_ext, ops.csr_by_neuron_cuda = ld, csr
                for _ in range(3):
                    step()
                res.setdefault(name, []).append(ev_ms(step, n=9))
                res.setdefault(name + " fwd", []).append(ev_ms(fwd, n=9))
        ops.load_ext, ops.csr_by_neuron_cuda = real_load, real_csr
        print(json.dumps(res), flush=True)
        rows.append(res)
        for name, (ld, csr) in variants.items():
            if name not in ("new", "both torch"):
                continue
            ops.load_ext, ops.csr_by_neuron_cuda = ld, csr
            step(); step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(f"{out}/trace_{M}_{name.replace(' ', '_')}.json")
        ops.load_ext, ops.csr_by_neuron_cuda = real_load, real_csr


if __name__ == "__main__":
    main()
