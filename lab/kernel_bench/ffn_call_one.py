"""One shape of experiments/kernel_bench/ffn_call.py, repeated: HF's LlamaMLP against SparseLlamaMLP(cuda) on the
same weights, `rounds` times in one process (each round: both sides' single-call, steady and host times, as
ffn_call measures them). For an A/B across commits, run it from each tree in turn. JSONL with provenance.

    PYTHONPATH=. python lab/kernel_bench/ffn_call_one.py --K 576 --N 1536 --p 0.01 --M 8192 --out one.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from sfl.experiments.kernel_bench.ffn_call import sides, time_side
from sfl.experiments.trainer.provenance import collect


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    for name, kind, default in (("--K", int, 576), ("--N", int, 1536), ("--M", int, 8192), ("--p", float, 0.01),
                                ("--rounds", int, 5), ("--reps", int, 100)):
        ap.add_argument(name, type=kind, default=default)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ms = sides(a.K, a.N, a.p)
    ms.pop("TwELLGatedMLP")
    x = torch.randn(a.M, a.K, device="cuda").to(torch.bfloat16)
    x[:, 0] = 1
    prov = collect({"what": "ffn_call, one shape repeated"})
    with open(a.out, "a") as f:
        for r in range(a.rounds):
            row = {"K": a.K, "N": a.N, "M": a.M, "activity_target": a.p, "round": r}
            for name, m in ms.items():
                row[name] = time_side(m, x, a.reps)
            hf, ours = row["hf LlamaMLP"], row["SparseLlamaMLP cuda"]
            row["single_speedup"] = hf["single_ms"] / ours["single_ms"]
            row["steady_speedup"] = hf["steady_ms"] / ours["steady_ms"]
            row["path"] = ms["SparseLlamaMLP cuda"].plan.info().get("path")
            f.write(json.dumps({**row, **prov}) + "\n")
            print(f"round {r}: single {row['single_speedup']:.2f}x ({hf['single_ms'] * 1e3:.0f} / "
                  f"{ours['single_ms'] * 1e3:.0f} us) steady {row['steady_speedup']:.2f}x host "
                  f"{ours['host_ms'] * 1e3:.0f} vs {hf['host_ms'] * 1e3:.0f} us; {row['path']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
