"""Does the L2 flush's kind change decode-size timings? decode_paths flushes with the timer's flush.zero_() (256 MB of
writes: L2 left full of dirty lines, whose write-back every following read pays) -- a model's layer finds L2 full
of mostly clean lines (weights, KV cache). Times the gate GEMMs and the decode paths after a write flush and after
a read flush (the buffer's amax(): 256 MB read, L2 left clean), rotation, medians of 30, CUDA-graph replays.

    python lab/kernel_bench/flush_modes.py OUT.jsonl
"""
import json
import statistics
import sys

import torch

from sfl.experiments.kernel_bench.bench_inference import graphed, make_case, make_weights
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.config import KernelConfig
from sfl.kernels.ffn import sparse_gated_ffn
from sfl.kernels.loader import load_twell
from sfl.kernels.twell import ops

BF = torch.bfloat16


def main(out: str) -> int:
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    base = KernelConfig(mode="sparse")
    cfgs = {"dense": base.replace(mode="dense"), "rows": base.replace(fused_decode_max_m=0),
            "rows_cublas": base.replace(fused_decode_max_m=0, d2t="cublas")}  # = rows after the skinny GEMM left
    plans = {k: ops.Plan(c) for k, c in cfgs.items()}
    ext = load_twell()
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flushes = {"write": lambda: buf.zero_(), "read": lambda: buf.view(torch.int32).amax()}
    prov = collect({"lab": "flush_modes"})
    with open(out, "w") as f:
        for M in (1, 8, 32, 64):
            x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=M)
            fns = {k: graphed(lambda plan=plan: sparse_gated_ffn(x, wg, wu, wd, plan=plan))[0]
                   for k, plan in plans.items()}
            fns["three_linear"] = graphed(lambda: torch.nn.functional.linear(
                torch.relu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu), wd))[0]
            fns["gate_gemm"] = graphed(lambda: x @ wg.t())[0]
            if hasattr(ext, "skinny_gemm"):  # the skinny gate GEMM existed at a50da04..f2047f5 only (kernels/lab)
                gbuf = torch.empty(M, N, device="cuda", dtype=BF)
                fns["gate_skinny"] = graphed(lambda: ext.skinny_gemm(x, wg, gbuf))[0]
            for fl_name, fl in flushes.items():
                times = {k: [] for k in fns}
                for _ in range(30):
                    for k, fn in fns.items():
                        fl()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        fn()
                        e.record()
                        e.synchronize()
                        times[k].append(s.elapsed_time(e) * 1000)
                med = {k: statistics.median(v) for k, v in times.items()}
                f.write(json.dumps({"provenance": prov, "M": M, "flush": fl_name, "us": med}) + "\n")
                print(f"M={M} flush={fl_name} " + " ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
