"""Decode-size FFN calls (M <= 64) as CUDA-graph replays, every sync-free path side by side: our dense path, the
fused decode kernel (M <= 8), the row decode (cuBLAS gate GEMM, then decode_rows) and the TwELL sync-free path
(d2t -> gated_up -> down -> finalize), plus the cuBLAS gate GEMM alone. L2 flushed before each replay (a model's
layers do not fit in L2), paths timed in rotation, medians of 30. It sets kernels/config.py's FUSED_DECODE_MAX_M.

    python -m sfl.experiments.kernel_bench.decode_paths results/kernel_bench/decode_paths_<gpu>.jsonl
    python -m sfl.experiments.kernel_bench.decode_paths OUT.jsonl --slices-sweep   # decode_rows_slices 0/1/2/3/4/6/8
"""
import json
import sys
import time

import torch

from sfl.experiments.kernel_bench.bench_inference import graphed, make_case, make_weights, rel_err
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.config import KernelConfig
from sfl.kernels.ffn import sparse_gated_ffn
from sfl.kernels.timing import PairTimer
from sfl.kernels.twell import ops
from sfl.models.hot_cold import rotate_ms

BF = torch.bfloat16


def rotate(timer: PairTimer, fns: dict, reps: int) -> dict:
    """Medians of fns timed in rotation, the L2 flushed before each call (no warm-up: the callers' own)."""
    return rotate_ms(fns, reps, before=timer.flush.zero_, warmup=False)


def main(out: str, slices_sweep: bool = False) -> int:
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    base = KernelConfig(mode="sparse")
    if slices_sweep:  # the row decode at every decode_rows_slices (0 = the automatic choice)
        cfgs = {"dense": base.replace(mode="dense")}
        cfgs.update({f"rows_s{n}": base.replace(fused_decode_max_m=0, decode_rows_slices=n)
                     for n in (0, 1, 2, 3, 4, 6, 8)})
    else:
        cfgs = {"dense": base.replace(mode="dense"),
                "fused": base.replace(fused_decode_max_m=8),
                "rows": base.replace(fused_decode_max_m=0),
                "twell": base.replace(fused_decode_max_m=0, rows_decode_max_m=0)}
    plans = {k: ops.Plan(c) for k, c in cfgs.items()}
    prov = collect({"kernel_config": base.to_dict(), "benchmark": "decode_paths"})
    timer = PairTimer()
    f = open(out, "w")
    t0 = time.time()
    for M in (1, 2, 4, 8, 16, 32, 64):
        for pattern in ("uniform", "paper"):
            for p in (0.005, 0.01, 0.02, 0.05, 0.1):
                x, wg = make_case(wg32, M, K, N, pattern, p, 0.0, seed=int(p * 1e5) + M)
                fns, outs = {}, {}
                for k, plan in plans.items():
                    if k == "fused" and M > 8:
                        continue
                    fns[k], outs[k] = graphed(lambda plan=plan: sparse_gated_ffn(x, wg, wu, wd, plan=plan))
                fns["gate_gemm"], _ = graphed(lambda: x @ wg.t())
                t = rotate(timer, fns, 30)
                ref = outs["dense"].float()
                h = torch.relu(x @ wg.t())
                row = {"provenance": prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p,
                       "p_measured": (h != 0).float().mean().item(),
                       "ms": t, "speedup_vs_dense": {k: t["dense"] / v for k, v in t.items() if k != "dense"},
                       "rel_err_vs_dense": {k: rel_err(o, ref) for k, o in outs.items() if k != "dense"},
                       "timing": "cuda_graph_replay, L2 flushed, rotation, median of 30"}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"[{time.time() - t0:.0f}s] M={M} {pattern} p={p} meas={row['p_measured']:.4f} "
                      + " ".join(f"{k}={v * 1000:.1f}us" for k, v in t.items()), flush=True)
                del fns, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--slices-sweep" in sys.argv[2:]))
