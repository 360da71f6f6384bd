"""Where the FFN's time goes inside the model at the paper's activity profile: every layer of the calibrated paper
shape (bench.py's construction, default 1.5B at 16 x 2048 tokens), on its own input from the model's forward,
timed dense (three cuBLAS GEMMs) and through the sparse op (auto dispatch, as the model calls it), with the op's
device time split by kernel into phases and its host time measured apart. GPU only.

    python -m sfl.experiments.speed.ffn_profile --out runs/speed/ffn_profile.jsonl

One row per layer: the layer's activity (mean, 99th percentile and max non-zeros per token; the share of rows with
a tile over the ELL width, which take the exact dense backup), the path and d2t variant the plan chose, median ms
dense and sparse, the op's device ms per phase (PHASES: the kernels named in kernels/twell/*.cu; cuBLAS GEMMs,
which are the gate GEMM when d2t is "cublas", the backup rows' GEMMs on the sparse path and all three GEMMs on the
dense path, stand apart), the host ms to issue one call, and gap_ms: one timed call's event time minus the profiled
device time of a warm call (launch lead, idle time between kernels and the L2 flush's cold start). A last row sums
the layers.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from sfl.kernels.config import KernelConfig
from sfl.kernels.device import dense_ffn
from sfl.kernels.ffn import plan_for, sparse_gated_ffn
from sfl.kernels.timing import PairTimer

from ..trainer.provenance import collect
from .bench import PAPER_NNZ, build_paper_model, calibrate_paper_model, mlp_inputs, paper_profile, require_cuda

# kernel-name fragment -> phase; the first match wins (kernels/twell/*.cu, kernels/common/*.cu)
PHASES = (("d2t_gemm", "d2t: gate GEMM + TwELL epilogue"), ("compact", "d2t: compaction"),
          ("decode_", "decode kernels"), ("gated_up", "up + down gathers"), ("up_down", "up + down gathers"),
          ("down_kernel", "up + down gathers"), ("slices", "up + down gathers"), ("finalize", "up + down gathers"),
          ("gather_rows", "backup rows: gather/scatter"), ("scatter_rows", "backup rows: gather/scatter"),
          ("dense_rows", "backup rows: CUDA-core rows"), ("relu_mul", "dense path: ReLU x up + counts"),
          ("stats", "statistics"),
          ("gemm", "cuBLAS GEMM"), ("nvjet", "cuBLAS GEMM"), ("xmma", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"))


def phase_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((phase for frag, phase in PHASES if frag in name), "other (memset, copies, elementwise)")


def layer_activity(x: torch.Tensor, w_gate: torch.Tensor, tile_n: int, slots: int) -> dict[str, float]:
    """Non-zeros per token of relu(x W_g^T) and the share of rows with a tile of tile_n neurons over `slots`."""
    counts, over = [], []
    for i in range(0, x.shape[0], 8192):
        active = F.linear(x[i:i + 8192], w_gate) > 0
        counts.append(active.sum(dim=1).float())
        over.append((active.view(active.shape[0], -1, tile_n).sum(dim=2) > slots).any(dim=1))
    c = torch.cat(counts)
    return {"nnz_mean": float(c.mean()), "nnz_p99": float(c.quantile(0.99)), "nnz_max": float(c.max()),
            "rows_over_ell_width_frac": float(torch.cat(over).float().mean())}


def device_ms_by_phase(fn, calls: int) -> dict[str, Any]:
    """Device time per call by phase and by kernel, over `calls` profiled calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_phase: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us > 0:
            by_phase[phase_of(ev.key)] += us / 1e3 / calls
            by_kernel[ev.key[:80]] += us / 1e3 / calls
    return {"phase_ms": dict(by_phase), "kernel_ms": dict(by_kernel), "device_ms": sum(by_phase.values())}


def host_ms(fn, calls: int = 20) -> float:
    """Host time to issue one call (the GPU queue does not fill in `calls` calls)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return 1e3 * t


@torch.inference_mode()
def profile_layer(mlp, x: torch.Tensor, cfg: KernelConfig, timer: PairTimer, reps: int) -> dict[str, Any]:
    wg, wu, wd = (m.weight.to(torch.bfloat16).contiguous() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    dense = lambda: dense_ffn(x, wg, wu, wd)  # noqa: E731
    sparse = lambda: sparse_gated_ffn(x, wg, wu, wd, config=cfg)  # noqa: E731
    for _ in range(3):  # auto dispatch measures the layer on its first calls
        sparse()
    dense_ms, sparse_ms = timer.time_pair(dense, sparse, reps)
    info = plan_for(wg, cfg, True).info()
    prof = device_ms_by_phase(sparse, calls=10)
    return {**layer_activity(x, wg, cfg.tile_n, cfg.slots), "tokens": int(x.shape[0]), "dense_ms": dense_ms,
            "sparse_ms": sparse_ms, "speedup": dense_ms / sparse_ms, "path": info.get("path"), "d2t": info.get("d2t"),
            "plan_flagged_rows_frac": info.get("f"), "backup_cap": info.get("backup_cap"), **prof,
            "host_ms": host_ms(sparse), "gap_ms": sparse_ms - prof["device_ms"]}


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    phase: dict[str, float] = defaultdict(float)
    for r in rows:
        for k, v in r["phase_ms"].items():
            phase[k] += v
    dense, sparse = sum(r["dense_ms"] for r in rows), sum(r["sparse_ms"] for r in rows)
    return {"layer": "all", "dense_ms": dense, "sparse_ms": sparse, "speedup": dense / sparse,
            "phase_ms": dict(phase), "device_ms": sum(phase.values()),
            "host_ms": sum(r["host_ms"] for r in rows), "gap_ms": sum(r["gap_ms"] for r in rows),
            "paths": {p: sum(r["path"] == p for r in rows) for p in {r["path"] for r in rows}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heavy-frac", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/speed/ffn_profile.jsonl"))
    a = ap.parse_args(argv)
    dev = require_cuda()
    model = build_paper_model(a.layers, dev, torch.bfloat16, seed=a.seed)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    vocab = model.config.vocab_size
    heavy = torch.randperm(vocab, generator=g)[: max(1, int(a.heavy_frac * vocab))]
    ids = torch.randint(0, vocab, (a.batch, a.seq_len), generator=g).to(dev)
    targets = paper_profile(a.layers, PAPER_NNZ.get(a.layers, 30.0))
    achieved = calibrate_paper_model(model, targets, ids, heavy_ids=heavy, seed=a.seed)
    xs = mlp_inputs(model, ids)
    cfg = model.config.get_kernel_config()
    timer = PairTimer()
    rows = [{"layer": i, "target_nnz": t, **profile_layer(m, x, cfg, timer, a.reps)}
            for i, (m, x, t) in enumerate(tqdm(list(zip(model.sparse_mlps(), xs, targets)), desc="layers"))]
    rows.append(totals(rows))
    common = {"model": f"paper-shape {a.layers} layers", "batch": a.batch, "seq_len": a.seq_len,
              "heavy_frac": a.heavy_frac, "calibration_nnz_mean": sum(achieved) / len(achieved),
              "timed": "each layer's FFN on its own input, dense vs sparse op auto in alternation after an L2 flush "
                       f"(median of {a.reps}); phases from torch.profiler over 10 calls", **collect()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        f.writelines(json.dumps({**common, **r}) + "\n" for r in rows)
    t = rows[-1]
    print(f"{a.layers} layers: dense {t['dense_ms']:.2f} ms, sparse {t['sparse_ms']:.2f} ms ({t['speedup']:.2f}x); "
          f"paths {t['paths']}; host {t['host_ms']:.2f} ms, gap {t['gap_ms']:.2f} ms", flush=True)
    for k, v in sorted(t["phase_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v:8.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
