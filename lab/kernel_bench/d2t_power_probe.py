"""Clock and power of the fused d2t's epilogue variants in a steady loop: each variant runs back to back for about
a second while nvidia-smi samples the SM clock and the board power every 50 ms; prints the per-call time (CUDA
events over the loop) beside the median clock and power of that window. Asks whether a variant is slower because
it draws more power (and the clock drops), not because it waits on something.

    python lab/kernel_bench/d2t_power_probe.py --out probe.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from sfl.experiments.kernel_bench.bench_inference import DEV, make_case, make_weights
from sfl.experiments.provenance import collect
from sfl.kernels.loader import load_twell


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    ext = load_twell()
    prov = collect({"what": "d2t power probe"})
    K, N, S = 2048, 5632, 32
    wg32 = make_weights(K, N)[0]
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    windows = []
    for M in (65536, 16384):
        x, wg = make_case(wg32, M, K, N, "uniform", 0.005, 0.0, seed=5)
        T = N // 256
        o = (torch.empty((M, T, S), device=DEV, dtype=torch.int32), torch.empty((M, T), device=DEV, dtype=torch.int32),
             torch.zeros(M, device=DEV, dtype=torch.int32))
        fns = {"coop": lambda: ext.d2t_gemm(x, wg, *o, 0, 0), "pingpong": lambda: ext.d2t_gemm(x, wg, *o, 2, 0),
               "pingpong_regs": lambda: ext.d2t_gemm(x, wg, *o, 3, 0), "cublas": lambda: torch.mm(x, wg.t())}
        for rnd in range(2):
            for name, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                time.sleep(0.3)  # let the clock recover between variants
                n = max(10, int(args.seconds / (2.3e-3 * M / 65536)))
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.time()
                s.record()
                for _ in range(n):
                    fn()
                e.record()
                e.synchronize()
                windows.append({"M": M, "variant": name, "round": rnd, "t0": t0, "t1": time.time(),
                                "ms_per_call": s.elapsed_time(e) / n, "calls": n})
    time.sleep(0.2)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
            samples.append((ts, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    offset = time.timezone if time.daylight == 0 else time.altzone  # nvidia-smi prints local time
    with open(args.out, "w") as f:
        for w in windows:
            inside = [(c, p) for ts, c, p in samples if w["t0"] + 0.1 <= ts <= w["t1"]]
            row = {**prov, **w, "sm_clock_mhz": statistics.median([c for c, _ in inside]) if inside else None,
                   "power_w": statistics.median([p for _, p in inside]) if inside else None, "samples": len(inside),
                   "tz_offset_s": offset}
            f.write(json.dumps(row) + "\n")
            print(w["M"], w["variant"], w["round"], round(w["ms_per_call"], 3), row["sm_clock_mhz"], row["power_w"],
                  len(inside), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
