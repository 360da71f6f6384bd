#!/usr/bin/env bash
# Recalibrate the dispatch crossover tables on this GPU (kernels/README.md, Dispatch): two runs of each block (each
# table is their elementwise minimum, so one noisy point cannot raise it). Usage:
#   bash experiments/kernel_bench/calibrate.sh OUT_DIR [TAG]
# Writes OUT_DIR/calib_<TAG>{a,b}.jsonl, OUT_DIR/calib_nongated_<TAG>{a,b}.jsonl and OUT_DIR/crossover_<TAG>.env, a file
# to `set -a; source` before a run (SFL_KERNEL_CROSSOVER=..., SFL_KERNEL_CROSSOVER_NONGATED=...: scripts apply them
# through KernelConfig.from_env(), read once) or to copy into kernels/config.py's DEFAULT_CROSSOVER(_NONGATED).
# The calibration runs themselves use KernelConfig.from_env() too (forced modes: the tables do not matter there).
# The default grid ends at 2% activity; the decode buckets need a wider one (experiments/kernel_bench/decode_crossover.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: calibrate.sh OUT_DIR [TAG]}"; tag="${2:-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for run in a b; do
  for kind in gated nongated; do
    name="calib_$([ $kind = gated ] || echo nongated_)${tag}${run}"
    python3 -m sfl.experiments.kernel_bench.bench_inference --calib --kind $kind --out "$out/$name.jsonl" > "$out/$name.txt" 2>&1
  done
done
python3 - "$out" "$tag" <<'PY'
import json, sys
from sfl.experiments.kernel_bench.bench_inference import crossover_spec
out, tag = sys.argv[1], sys.argv[2]
rows = lambda p: [json.loads(l) for l in open(p)]
def table(prefix):   # the elementwise minimum of runs a and b
    specs = [dict(kv.split(":") for kv in crossover_spec(rows(f"{out}/{prefix}{tag}{r}.jsonl")).split(",")) for r in "ab"]
    return ",".join(f"{m}:{min(float(specs[0][m]), float(specs[1][m])):g}" for m in specs[0])
gated, nongated = table("calib_"), table("calib_nongated_")
from sfl.kernels.config import KernelConfig
KernelConfig(crossover=gated, crossover_nongated=nongated)  # refuses a table the kernels cannot use, naming it
with open(f"{out}/crossover_{tag}.env", "w") as f:
    f.write(f"SFL_KERNEL_CROSSOVER={gated}\nSFL_KERNEL_CROSSOVER_NONGATED={nongated}\n")
print(f"SFL_KERNEL_CROSSOVER={gated}\nSFL_KERNEL_CROSSOVER_NONGATED={nongated}")
PY
