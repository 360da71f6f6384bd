"""The decode buckets (M <= 64) of the gated crossover table, from two calibration runs that extend the activity grid.

    python -m sfl.experiments.kernel_bench.decode_crossover NEW_A.jsonl NEW_B.jsonl [--base-a A.jsonl --base-b B.jsonl]
    python -m sfl.experiments.kernel_bench.decode_crossover NEW_A.jsonl NEW_B.jsonl --kind nongated

The default calibration grid (bench_inference --calib) ends at 2% activity, where the fused decode kernel still wins
at M = 1..8: its table entries were the grid's end, not a measured crossing. The extension runs
(`bench_inference --calib --calib-ms 1 2 4 8 16 32 64 --calib-acts 0.001 ... 0.25`) are merged with the base runs'
rows (run a with a, b with b; where both measured a size and activity, the extension's row replaces the base's),
each pair gives crossover_spec's per-M crossing, and the table takes their minimum. A bucket between two measured
sizes takes the larger size's value (the sparse path's cost grows with M), so
M = 2..4 use M = 4's crossing, 5..8 use M = 8's, and so on; buckets above 64 come from the base runs alone, as
calibrate.sh makes them. Prints the whole table (KernelConfig.crossover's format; tests/test_kernels_cpu.py checks
that it is DEFAULT_CROSSOVER). `--kind nongated`: the same for KernelConfig.crossover_nongated, from r22's two
non-gated runs (M >= 256, after its dense call took the ReLU into the GEMM's epilogue) and r17's decode runs.
"""
from __future__ import annotations

import argparse
import json

from sfl.experiments.kernel_bench.bench_inference import crossover_spec
from sfl.kernels.config import KernelConfig

BASE = "results/kernel_bench/calibration/calib_h100_r18{}.jsonl"
BASE_NONGATED = "results/kernel_bench/calibration/calib_nongated_h100_r22{}.jsonl"


def rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def decode_table(new: list[str], base: list[str], max_m: int = 64, kind: str = "gated") -> str:
    per_run = []
    for n, b in zip(new, base):
        fresh = [r for r in rows(n) if r["M"] <= max_m]
        measured = {(r["M"], r["activity"]) for r in fresh}  # these replace the base run's rows at the same point
        merged = [r for r in rows(b) if (r["M"], r["activity"]) not in measured] + fresh
        per_run.append({int(m): float(p) for m, p in (kv.split(":") for kv in crossover_spec(merged).split(","))})
    ms = sorted(per_run[0])
    cross = {m: min(run[m] for run in per_run) for m in ms}
    decode = [m for m in ms if m <= max_m]
    out = {1: cross[decode[0]]}
    for prev, m in zip(decode, decode[1:]):
        out[prev + 1] = cross[m]
    out.update({m: cross[m] for m in ms if m > max_m})
    table = ",".join(f"{m}:{p:g}" for m, p in sorted(out.items()))
    KernelConfig(**{"crossover" if kind == "gated" else "crossover_nongated": table})  # refuses an unusable table
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new", nargs=2, help="the two extension runs (a, b)")
    ap.add_argument("--kind", choices=("gated", "nongated"), default="gated")
    ap.add_argument("--base-a")
    ap.add_argument("--base-b")
    a = ap.parse_args(argv)
    base = [(BASE if a.kind == "gated" else BASE_NONGATED).format(r) for r in "ab"]
    base = [a.base_a or base[0], a.base_b or base[1]]
    print(decode_table(a.new, base, kind=a.kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
