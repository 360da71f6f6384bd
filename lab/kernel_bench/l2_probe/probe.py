"""L2 residency probe for the sparse up/down step. Times, in rotation with the L2 flushed before each
call (bench_inference's Timer), at M 65536, K 2048:
  - the production up_down at N 5632 / 2816 / 1536 with the same ~28 pairs per token (weights 46 / 23 / 12.6 MB):
    does the time per pair fall once the weights fit in L2?
  - ud_variants.cu at N 5632: cache-policy hints on/off x 1-4 passes over neuron slices (fp32 partial y between
    passes), checked bit-for-bit against the production kernel.
Writes JSONL rows with provenance.   PYTHONPATH=. python lab/kernel_bench/l2_probe/probe.py --out probe.jsonl
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.cpp_extension import load

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, make_case, make_weights
from sfl.kernels.timing import PairTimer as Timer
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.trainer.provenance import collect
from sfl.kernels.loader import load_twell

HERE = os.path.dirname(os.path.abspath(__file__))


def twell_of(ext, x, wg, S=32):
    M, N = x.shape[0], wg.shape[0]
    T = N // 256
    packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
    counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
    flag = torch.zeros(M, device=DEV, dtype=torch.int32)
    ext.compact(torch.nn.functional.linear(x, wg), N, packed, counts, flag)  # (d2t_gemm segfaulted beside udv)
    return packed, counts, flag


def splits(T, P):
    return [round(i * T / P) for i in range(P + 1)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--M", type=int, default=65536)
    args = ap.parse_args()
    ext = load_twell()
    udv = load("udv_probe", [os.path.join(HERE, "ud_variants.cu")],
               extra_cuda_cflags=["-O3", "-gencode", "arch=compute_90a,code=sm_90a"], verbose=False)
    timer = Timer()
    K, M = 2048, args.M
    prov = collect({"what": "L2 residency probe of up_down"})
    f = open(args.out, "w")

    def emit(row):
        f.write(json.dumps({**prov, **row}) + "\n")
        f.flush()
        print({k: v for k, v in row.items()}, flush=True)

    # 1. the production kernel with smaller weights, same pairs per token
    fns, meta = {}, {}
    for N, p in ((5632, 0.005), (2816, 0.01), (1536, 0.005 * 5632 / 1536)):
        wg32, wu32, wd32 = make_weights(K, N)
        wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
        x, wg = make_case(wg32, M, K, N, "uniform", p, 0.0, seed=5)
        packed, counts, flag = twell_of(ext, x, wg)
        y = torch.empty(M, K, device=DEV, dtype=BF)
        fns[f"N{N}"] = (lambda x=x, wu=wu, wdt=wdt, pk=packed, c=counts, fl=flag, y=y:
                        ext.up_down(x, wu, wdt, pk, c, fl, y, 0))
        meta[f"N{N}"] = {"N": N, "activity": p, "pairs": int(counts.clamp(max=32).sum()),
                         "weight_MB": 2 * N * K * 2 / 1e6}
    for fn in fns.values():
        fn()
    ms = rotate(timer, fns, args.reps)
    for k, v in ms.items():
        emit({"probe": "n_scan", "M": M, "K": K, **meta[k], "ms": v, "ns_per_pair": v * 1e6 / meta[k]["pairs"]})
    del fns
    torch.cuda.empty_cache()

    # 2. variants at N 5632
    N = 5632
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wdt = wu32.to(BF), wd32.to(BF).t().contiguous()
    for pattern, p in (("uniform", 0.005), ("uniform", 0.01), ("paper", 0.005)):
        x, wg = make_case(wg32, M, K, N, pattern, p, 0.001 if pattern == "paper" else 0.0, seed=11)
        packed, counts, flag = twell_of(ext, x, wg)
        yacc = torch.empty(M, K, device=DEV, dtype=torch.float32)
        ref = torch.empty(M, K, device=DEV, dtype=BF)
        fns = {"prod": lambda: ext.up_down(x, wu, wdt, packed, counts, flag, ref, 0)}
        ys = {}
        for hint in (False, True):
            for P in (1, 2, 3, 4):
                name = f"{'hint' if hint else 'plain'}_P{P}"
                ys[name] = torch.empty(M, K, device=DEV, dtype=BF)
                fns[name] = (lambda y=ys[name], b=splits(T, P), h=hint:
                             udv.ud(x, wu, wdt, packed, counts, flag, yacc, y, b, h))
        for fn in fns.values():
            fn()
        ms = rotate(timer, fns, args.reps)
        ok = ~flag.bool()
        pairs = int(counts.clamp(max=32)[ok].sum())
        for k, v in ms.items():
            same = True if k == "prod" else bool(torch.equal(ys[k][ok], ref[ok]))
            emit({"probe": "variants", "M": M, "K": K, "N": N, "pattern": pattern, "activity": p, "variant": k,
                  "pairs": pairs, "flagged_rows": int((~ok).sum()), "ms": v, "same_bits": same})
        del x, wg, packed, counts, flag, yacc, ref, ys, fns
        torch.cuda.empty_cache()
    f.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
