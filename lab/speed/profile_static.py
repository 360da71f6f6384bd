"""Trial (lab): generate() with the static cache (transformers compiles it with CUDA graphs) against HF's Llama.
Per batch and per crossover table: wall time of generate() at 64 and 16 new tokens (the difference over 48 steps is
the decode step as a user gets it), the GPU time of one 64-token generate from the profiler (kernels, graph replays
included), and each layer's decode path and measured activity. GPU only.

    python lab/speed/profile_static.py --out $OUT/profile_static.jsonl [--crossover SPEC] [--batches 1 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from sfl.experiments.trainer.provenance import collect
from sfl.experiments.speed import real_path
from sfl.kernels.config import KernelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_generate import calibrated_pair  # noqa: E402  (the same calibrated model pair)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--crossover", default="", help="a second crossover table to compare with the default")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="*", default=[], help="extra KernelConfig modes to compare (dense, sparse)")
    ap.add_argument("--old-table", action="store_true", help="also the r9 crossover table (before r15's decode rows)")
    ap.add_argument("--top", type=int, default=0, help="print this many kernels by device time per side")
    a = ap.parse_args()
    dev = torch.device("cuda")
    ours, hf, g, vocab = calibrated_pair(28, dev)
    configs = {"default": KernelConfig()}
    if a.crossover:
        configs["extended"] = KernelConfig(crossover=a.crossover)
    if a.old_table:
        configs["r9 table"] = KernelConfig(crossover="1:0.0152,4:0.0193,8:0.0202,16:0.0019,32:0.002,64:0.0019,256:0,"
                                           "1024:0,4096:0.0025,8192:0.0025,16384:0.0045,32768:0.0055,65536:0.0069")
    for m in a.modes:
        configs[m] = KernelConfig(mode=m)
    prov = collect()
    f = open(a.out, "a")
    for b in a.batches:
        ids = torch.randint(1, vocab, (b, 128), generator=g).to(dev)
        mask = torch.ones_like(ids)

        def gen(m, new):
            return lambda: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, pad_token_id=0, cache_implementation="static")

        with torch.inference_mode():
            for name, cfg in configs.items():
                ours.set_kernel_config(cfg)
                sides = {"hf": hf, "ours": ours}
                compile_stats = {}
                for s, m in sides.items():  # compile + graph capture for both lengths
                    counters.clear()
                    for new in (64, 16, 64):
                        gen(m, new)()
                    compile_stats[s] = {"graph_breaks": dict(counters["graph_break"]),
                                        "unique_graphs": counters["stats"]["unique_graphs"],
                                        "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
                    print(f"   {s} compile: {compile_stats[s]}", flush=True)
                t = {(s, new): [] for s in sides for new in (64, 16)}
                for r in range(a.reps):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for s in order:
                        for new in (64, 16):
                            t[(s, new)].append(real_path._timed(gen(sides[s], new)))
                med = {k: statistics.median(v) for k, v in t.items()}
                gpu = {s: real_path.gpu_seconds(gen(m, 64), a.top, f"b{b} {name} {s}") for s, m in sides.items()}
                infos = [mlp.plan.info() for mlp in ours.sparse_mlps()]
                row = {"batch": b, "table": name, "crossover": cfg.crossover,
                       "step_ms": {s: (med[(s, 64)] - med[(s, 16)]) / 48 * 1e3 for s in sides},
                       "generate64_s": {s: med[(s, 64)] for s in sides},
                       "speedup64": med[("hf", 64)] / med[("ours", 64)],
                       "gpu_ms_per_token64": {s: gpu[s] / 64 * 1e3 for s in sides},
                       "all_s": {f"{s}_{n}": v for (s, n), v in t.items()},
                       "compile_stats": compile_stats, "layer_p": [i.get("p") for i in infos], "layer_path": [i.get("path") for i in infos],
                       "provenance": prov}
                step = row["step_ms"]
                print(f"b{b} {name}: generate64 x{row['speedup64']:.3f}; step hf {step['hf']:.2f} ours "
                      f"{step['ours']:.2f} ms; GPU/token hf {row['gpu_ms_per_token64']['hf']:.2f} ours "
                      f"{row['gpu_ms_per_token64']['ours']:.2f} ms", flush=True)
                print("   paths:", [(round(p or 0, 4), (pa or "")[:6]) for p, pa in zip(row["layer_p"], row["layer_path"])],
                      flush=True)
                f.write(json.dumps(row) + "\n")
                f.flush()


if __name__ == "__main__":
    main()
