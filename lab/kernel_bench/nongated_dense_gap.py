"""Why the non-gated block's dense-dispatched rows at M 16384 (bench_inference, auto) run 0.93-1.00x of HF's
linear-relu-linear: HF against our op in mode "dense" and in auto (a fresh layer that has learnt the activity), single
calls and 8 back to back, and the profiler's kernel table of each side. GPU only; prints one JSON row per case.

    PYTHONPATH=. python lab/kernel_bench/nongated_dense_gap.py
"""
from __future__ import annotations

import json

import torch

from sfl.experiments.kernel_bench.bench_inference import (BF, DEV, base_config, dense_nongated, ffn_call,
                                                          make_case, make_weights)
from sfl.experiments.kernel_bench.diagnose import kernel_table
from sfl.kernels.timing import PairTimer as Timer


def main() -> int:
    cfg = base_config()
    timer = Timer()
    K, N = 2048, 8192
    w32 = make_weights(K, N, seed=1)
    wd = w32[2].to(BF)
    for M, p in ((16384, 0.01), (16384, 0.02), (65536, 0.02)):
        x, wu = make_case(w32[0], M, K, N, "uniform", p, 0.0, seed=9)
        hf = lambda: dense_nongated(x, wu, wd)  # noqa: E731
        dense, _ = ffn_call(x, None, wu, wd, cfg.replace(mode="dense"))
        auto, plan = ffn_call(x, None, wu, wd, cfg)
        for _ in range(3):
            auto()
        torch.cuda.synchronize()
        row = {"M": M, "N": N, "activity": p, "auto_path": plan.info().get("path")}
        for name, fn in (("dense", dense), ("auto", auto), ("hf_again", hf)):
            for calls in (1, 8):
                a, b = timer.time_pair(hf, fn, 20, calls=calls)
                row[f"{name}_x{calls}"] = round(a / b, 4)
        row["auto_path_after"] = plan.info().get("path")
        print(json.dumps(row), flush=True)
        for name, fn in (("hf", hf), ("auto", auto)):
            print(name, json.dumps(kernel_table(fn)[:6]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
