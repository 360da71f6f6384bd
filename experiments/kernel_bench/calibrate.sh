#!/usr/bin/env bash
# Recalibrate the dispatch crossover tables on this GPU (kernels/README.md, Dispatch): two gated runs (the table is
# their elementwise minimum, so one noisy point cannot raise it) and one non-gated run. Usage:
#   bash experiments/kernel_bench/calibrate.sh OUT_DIR [TAG]
# Writes OUT_DIR/calib_<TAG>{a,b}.jsonl, OUT_DIR/calib_nongated_<TAG>.jsonl and OUT_DIR/crossover_<TAG>.env, a file
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
  python3 -m sfl.experiments.kernel_bench.bench_inference --calib --out "$out/calib_${tag}${run}.jsonl" > "$out/calib_${tag}${run}.txt" 2>&1
done
python3 -m sfl.experiments.kernel_bench.bench_inference --calib --kind nongated --out "$out/calib_nongated_${tag}.jsonl" \
  > "$out/calib_nongated_${tag}.txt" 2>&1
python3 - "$out" "$tag" <<'PY'
import json, sys
from sfl.experiments.kernel_bench.bench_inference import crossover_spec
out, tag = sys.argv[1], sys.argv[2]
rows = lambda p: [json.loads(l) for l in open(p)]
specs = [dict(kv.split(":") for kv in crossover_spec(rows(f"{out}/calib_{tag}{r}.jsonl")).split(",")) for r in "ab"]
gated = ",".join(f"{m}:{min(float(specs[0][m]), float(specs[1][m])):g}" for m in specs[0])
nongated = crossover_spec(rows(f"{out}/calib_nongated_{tag}.jsonl"))
from sfl.kernels.config import KernelConfig
KernelConfig(crossover=gated, crossover_nongated=nongated)  # refuses a table the kernels cannot use, naming it
with open(f"{out}/crossover_{tag}.env", "w") as f:
    f.write(f"SFL_KERNEL_CROSSOVER={gated}\nSFL_KERNEL_CROSSOVER_NONGATED={nongated}\n")
print(f"SFL_KERNEL_CROSSOVER={gated}\nSFL_KERNEL_CROSSOVER_NONGATED={nongated}")
PY
