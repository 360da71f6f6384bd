"""Trial (lab): the large-M sparse call's gathers (up_list + down_slices) of one row chunk on a second stream while
the fused d2t of the next chunk runs, the d2t's persistent grid capped at `ctas` SMs so the gathers get the rest.
Against today's order (d2t of all rows, then the gathers). The same kernels on the same rows: y and the TwELL must
be bit-identical. Rotation with the L2 flushed, medians; JSONL with provenance.

    PYTHONPATH=. python lab/kernel_bench/stream_overlap_ab.py --out overlap.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, make_case, make_weights, twell_buffers
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.005, 0.0), (65536, "uniform", 0.01, 0.0), (65536, "paper", 0.005, 0.001),
         (65536, "uniform", 0.0025, 0.0), (16384, "uniform", 0.005, 0.0)]
VARIANTS = [(1, 0), (4, 0), (4, 120), (4, 100), (8, 120), (8, 100), (8, 80), (16, 100)]  # (chunks, d2t CTA cap)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
    side = torch.cuda.Stream()
    prov = collect({"what": "d2t of chunk i+1 beside the gathers of chunk i"})
    with open(args.out, "w") as f:
        for ci, (M, pattern, p, heavy) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=400 + ci)
            packed, counts, flag, lcol, lh, lnnz = twell_buffers(M, T, S)
            y = torch.empty(M, K, device=DEV, dtype=BF)

            def run(chunks: int, ctas: int) -> None:
                main_s = torch.cuda.current_stream()
                flag.zero_()
                side.wait_stream(main_s)
                rows = -(-M // chunks)
                for c in range(chunks):
                    r = slice(c * rows, min(M, (c + 1) * rows))
                    ext.d2t_gemm(x[r], wg, packed[r], counts[r], flag[r], False, ctas)
                    ev = torch.cuda.Event()
                    ev.record(main_s)
                    with torch.cuda.stream(side):
                        side.wait_event(ev)
                        ext.up_list(x[r], wu, packed[r], counts[r], flag[r], lcol[r], lh[r], lnnz[r], N)
                        ext.down_slices(wdt, lcol[r], lnnz[r], flag[r], lh[r], y[r], 1)
                main_s.wait_stream(side)

            fns = {f"c{c}_cap{k}": (lambda c=c, k=k: run(c, k)) for c, k in VARIANTS}
            run(1, 0)
            torch.cuda.synchronize()
            ref = (y.clone(), packed.clone(), counts.clone())
            same = {}
            for name, fn in fns.items():
                y.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                ok = ~flag.bool()
                same[name] = bool(torch.equal(y[ok], ref[0][ok]) and torch.equal(counts, ref[2]))
            ms = rotate(timer, fns, args.reps)
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "ms": ms, "same": same}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} " + " ".join(f"{k}={v:.3f}" for k, v in ms.items()) +
                  f" same={all(same.values())}", flush=True)
            del x, wg, packed, counts, flag, lcol, lh, lnnz, y, ref
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
