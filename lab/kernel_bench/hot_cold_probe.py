"""Does a hot/cold split pay ? Neurons sorted by their measured firing rate; the first
N_H ("hot") are computed as dense sub-GEMMs, the rest through the sparse op on the remaining rows of the weights:

    y = op(x, W_g[H:], W_u[H:], W_d[:, H:]) ; y += (relu(x W_g[:H]^T) * x W_u[:H]^T) W_d[:, :H]^T  (addmm, beta 1)

A permutation of the neurons leaves the FFN's function unchanged, so a model can be reordered once by measured
rates. Timed in rotation with the L2 flushed before each call (bench_inference's Timer, decode_paths' rotation),
medians, against HF-style dense (three F.linear) and the op on all neurons. Writes JSONL rows with provenance.

    PYTHONPATH=. python lab/kernel_bench/hot_cold_probe.py --out hot_cold.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, dense_gated, make_case, make_weights, rel_err
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.config import KernelConfig
from sfl.kernels.ffn import sparse_gated_ffn
from sfl.kernels.twell import ops

CASES = [(65536, "paper", 0.005), (65536, "paper", 0.01), (65536, "uniform", 0.005), (16384, "paper", 0.005),
         (16384, "paper", 0.01)]
HOT = (256, 512, 768, 1024, 1536)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    timer = Timer()
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    prov = collect({"what": "hot/cold split probe"})
    cfg = KernelConfig(mode="sparse")
    with open(args.out, "w") as f:
        for i, (M, pattern, p) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, 0.0, seed=300 + i)
            rate = torch.zeros(N, device=DEV)
            for r0 in range(0, M, 8192):
                rate += (F.linear(x[r0:r0 + 8192], wg) > 0).float().sum(0)
            order = torch.argsort(rate, descending=True)
            wg_p = wg[order].contiguous()
            wu_p = wu32.to(BF)[order].contiguous()
            wd_p = wd32.to(BF)[:, order].contiguous()
            y_ref = dense_gated(x, wg_p, wu_p, wd_p)
            full_plan = ops.Plan(cfg)
            fns = {"dense": lambda: dense_gated(x, wg_p, wu_p, wd_p),
                   "sparse_all": lambda: sparse_gated_ffn(x, wg_p, wu_p, wd_p, plan=full_plan)}
            for h in HOT:
                # cold W_d neuron-major (kernels/layout.py): the op reads it without a copy
                cold = (wg_p[h:].contiguous(), wu_p[h:].contiguous(), wd_p[:, h:].t().contiguous().t(), ops.Plan(cfg))
                hot = (wg_p[:h].contiguous(), wu_p[:h].contiguous(), wd_p[:, :h].t().contiguous())
                stacked = torch.cat([hot[0], hot[1]]).contiguous()   # [W_g hot; W_u hot]: one GEMM for both

                def split(cold=cold, hot=hot):
                    y = sparse_gated_ffn(x, cold[0], cold[1], cold[2], plan=cold[3])
                    hh = F.relu(F.linear(x, hot[0])) * F.linear(x, hot[1])
                    return torch.addmm(y, hh, hot[2])

                def split_stacked(cold=cold, hot=hot, stacked=stacked, h=h):
                    y = sparse_gated_ffn(x, cold[0], cold[1], cold[2], plan=cold[3])
                    gu = torch.mm(x, stacked.t())
                    hh = torch.relu_(gu[:, :h]).mul_(gu[:, h:])
                    return y.addmm_(hh, hot[2])

                fns[f"hot{h}"] = split
                fns[f"hot{h}_stacked"] = split_stacked
            outs = {k: fn() for k, fn in fns.items()}   # warm-up (plans measure) and the outputs checked
            torch.cuda.synchronize()
            ms = rotate(timer, fns, args.reps)
            errs = {k: rel_err(v, y_ref) for k, v in outs.items()}
            share = {h: float(rate[order[:h]].sum() / rate.sum()) for h in HOT}
            # the hot part alone (stacked GEMM, relu*mul, addmm into an existing y), for the cost per neuron
            y0 = torch.empty_like(y_ref)
            hot_only = {}
            for h in HOT:
                st = torch.cat([wg_p[:h], wu_p[:h]]).contiguous()
                wdh = wd_p[:, :h].t().contiguous()

                def part(st=st, wdh=wdh, h=h):
                    gu = torch.mm(x, st.t())
                    return y0.addmm_(torch.relu_(gu[:, :h]).mul_(gu[:, h:]), wdh)

                hot_only[f"hot{h}_part"] = part
            ms.update(rotate(timer, hot_only, args.reps))
            row = {**prov, "M": M, "K": K, "N": N, "pattern": pattern, "activity": p,
                   "measured_activity": float(rate.sum() / (M * N)), "hot_pair_share": share, "ms": ms,
                   "speedup_vs_dense": {k: ms["dense"] / v for k, v in ms.items()}, "rel_err_vs_dense": errs}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p}: " + " ".join(f"{k}={v:.3f}" for k, v in ms.items())
                  + " | share " + " ".join(f"{h}:{s:.2f}" for h, s in share.items())
                  + f" | err max {max(errs.values()):.2e}", flush=True)
            del x, wg, outs, fns
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
