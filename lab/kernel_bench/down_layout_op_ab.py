"""Trial (lab): the training op's fwd+bwd with W_d stored row-major (nn.Linear's) against neuron-major
(kernels/layout.py, the model's layout), in one rotation: bench_training's cases and method (CUDA events, L2 flushed,
medians, the two sides alternating), single calls and 4 back-to-back calls per repetition; mode auto (after its
history has warmed up) and forced dense (the fused dense path), per M and activity. One JSONL row per case.

    PYTHONPATH=. python lab/kernel_bench/down_layout_op_ab.py --out /tmp/down_layout_op_ab.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.bench_training import make_case
from sfl.experiments.trainer.provenance import collect


def main() -> int:
    from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--neuron-major-first", action="store_true", help="time the neuron-major side first in each pair")
    ap.add_argument("--cases", default="4096:0.005:auto,4096:0.01:dense,16384:0.005:auto,16384:0.01:auto,"
                                       "16384:0.05:dense,65536:0.005:auto", help="M:p:mode,...")
    args = ap.parse_args()
    K, N = 2048, 5632
    timer = Timer()
    prov = collect({"what": "training op, W_d row-major vs neuron-major"})
    gl1 = torch.tensor(1000.0, device="cuda")
    with open(args.out, "w") as f:
        for case in args.cases.split(","):
            M, p, mode = int(case.split(":")[0]), float(case.split(":")[1]), case.split(":")[2]
            x, (wg, wu, wd), gy = make_case(M, K, N, p, 0.0, seed=int(p * 1e5) + M)
            sides = {}
            for layout, w in (("row_major", wd), ("neuron_major", wd.t().contiguous().t())):
                ps = [t.clone().requires_grad_(True) for t in (x, wg, wu)] + [w.clone().requires_grad_(True)]
                st = DispatchState()

                def step(ps=ps, st=st):
                    for t in ps:
                        t.grad = None
                    y, l1, _ = sparse_gated_ffn_train(*ps, mode=mode, state=st if mode == "auto" else None)
                    torch.autograd.backward([y, l1], [gy, gl1])

                for _ in range(4):  # the auto history
                    step()
                torch.cuda.synchronize()
                sides[layout] = (step, st)
            (row, st_r), (nm, st_n) = sides["row_major"], sides["neuron_major"]
            if args.neuron_major_first:
                t1, t4 = (timer.time_pair(nm, row, args.reps, warmup=2)[::-1],
                          timer.time_pair(nm, row, args.reps, warmup=1, calls=4)[::-1])
            else:
                t1 = timer.time_pair(row, nm, args.reps, warmup=2)
                t4 = timer.time_pair(row, nm, args.reps, warmup=1, calls=4)
            r = {"M": M, "K": K, "N": N, "p": p, "mode": mode, "neuron_major_first": args.neuron_major_first, "path": [st_r.last_path, st_n.last_path],
                 "single_ms": {"row_major": t1[0], "neuron_major": t1[1]},
                 "steady_4calls_ms": {"row_major": t4[0], "neuron_major": t4[1]}, "provenance": prov}
            f.write(json.dumps(r) + "\n")
            print(f"M {M:6d} p {p:.3f} {mode:5s} paths {r['path']}: single {t1[0]:.3f} -> {t1[1]:.3f} ms, "
                  f"steady {t4[0]:.3f} -> {t4[1]:.3f} ms (row-major -> neuron-major)", flush=True)
            del sides, row, nm
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
