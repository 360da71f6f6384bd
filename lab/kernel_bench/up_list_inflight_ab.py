"""Trial (lab): `up_list` with more W_u bytes in flight per warp (G 16-byte chunks per lane loaded before their
products) against fewer blocks per SM, the same sums in the same order (the lists must be bit-identical). Variants:
0 = today's (G 2, 6 blocks per SM), 1 = G 4 / 5 blocks, 2 = G 4 / 4, 3 = G 8 / 3, 4 = G 2 / 8, 5 = G 1 / 8 (set
through the extension's lab_set_variant). Rotation with the L2 flushed, medians; JSONL with provenance.

    PYTHONPATH=. python lab/kernel_bench/up_list_inflight_ab.py --out inflight.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.bench_inference import BF, DEV, Timer, make_case, make_weights
from sfl.experiments.kernel_bench.decode_paths import rotate
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell

CASES = [(65536, "uniform", 0.0025, 0.0), (65536, "uniform", 0.005, 0.0), (65536, "uniform", 0.01, 0.0),
         (65536, "uniform", 0.005, 0.01), (65536, "paper", 0.005, 0.001), (16384, "uniform", 0.005, 0.0),
         (16384, "paper", 0.005, 0.001)]
VARIANTS = range(6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    ext, timer = load_twell(), Timer()
    K, N, S = 2048, 5632, 32
    T = N // 256
    wg32, wu32, _ = make_weights(K, N)
    wu = wu32.to(BF)
    prov = collect({"what": "up_list: W_u bytes in flight per warp against blocks per SM"})
    with open(args.out, "w") as f:
        for i, (M, pattern, p, heavy) in enumerate(CASES):
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=500 + i)
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            lists = [(torch.empty(M, T * S, device=DEV, dtype=torch.int32),
                      torch.empty(M, T * S, device=DEV, dtype=torch.float32),
                      torch.empty(M, device=DEV, dtype=torch.int32)) for _ in VARIANTS]

            def up(v: int) -> None:
                ext.lab_set_variant(v)
                ext.up_list(x, wu, packed, counts, flag, *lists[v], N)

            fns = {f"v{v}": (lambda v=v: up(v)) for v in VARIANTS}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            ok = ~flag.bool()
            c0, h0, n0 = lists[0]
            listed = (torch.arange(T * S, device=DEV)[None, :] < n0.clamp(min=0)[:, None]) & ok[:, None]
            same = {f"v{v}": bool(torch.equal(lists[v][2][ok], n0[ok]) and torch.equal(lists[v][0][listed], c0[listed])
                                  and torch.equal(lists[v][1][listed], h0[listed])) for v in VARIANTS}
            ms = rotate(timer, fns, args.reps)
            ext.lab_set_variant(0)
            row = {**prov, "M": M, "K": K, "N": N, "S": S, "pattern": pattern, "activity": p, "heavy_frac": heavy,
                   "pairs": int(n0[ok].sum()), "ms": ms, "same_bits": same}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"M={M} {pattern} p={p} heavy={heavy} " + " ".join(f"{k}={v:.3f}" for k, v in ms.items()) +
                  f" same={all(same.values())}", flush=True)
            del x, wg, packed, counts, flag, lists
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
