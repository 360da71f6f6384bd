"""Trial (lab): a crossover table whose decode buckets (M <= 64) come from the r9 calibration rows plus an extended
activity grid (argv: the two new calibration files), the minimum over two runs; buckets above 64 keep the default."""
import json, sys
from sfl.experiments.kernel_bench.bench_inference import crossover_spec
from sfl.kernels.config import DEFAULT_CROSSOVER
old = ["results/kernel_bench/calibration/calib_h100_r9a.jsonl", "results/kernel_bench/calibration/calib_h100_r9b.jsonl"]
new = sys.argv[1:3]
rows = lambda p: [json.loads(l) for l in open(p)]
specs = []
for o, n in zip(old, new):
    rs = [r for r in rows(o) if r["M"] <= 64] + rows(n)
    specs.append(dict(kv.split(":") for kv in crossover_spec(rs).split(",")))
dec = {m: min(float(specs[0][m]), float(specs[1][m])) for m in specs[0]}
base = dict(kv.split(":") for kv in DEFAULT_CROSSOVER.split(","))
base.update({m: f"{v:g}" for m, v in dec.items()})
print(",".join(f"{m}:{base[m]}" for m in sorted(base, key=int)))
