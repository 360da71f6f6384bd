"""Benchmark: dense gated MLP (three F.linear, as HF) vs the TwELL kernels, in the same run.

CUDA events, warm-up, medians, an L2 flush (write of a 256 MB buffer) before every timed repetition; outputs
checked against dense in the same run. Decode sizes (M <= 64) are timed as CUDA-graph replays for both.
One JSONL row per configuration (with provenance) goes to --out; a table is printed at the end.

    python -m experiments.kernel_bench.bench_inference --out results/kernel_bench/bench.jsonl [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEV = "cuda"
BF = torch.bfloat16


def shift_for(p: torch.Tensor) -> torch.Tensor:
    """Gate shift so that a N(0,1) pre-activation is positive with probability p."""
    return torch.distributions.Normal(0.0, 1.0).icdf(1.0 - p.clamp(1e-6, 0.5))


def make_weights(K: int, N: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    wg = torch.randn(N, K, device=DEV, generator=g, dtype=torch.float32) / K ** 0.5
    wu = torch.randn(N, K, device=DEV, generator=g, dtype=torch.float32) / K ** 0.5
    wd = torch.randn(K, N, device=DEV, generator=g, dtype=torch.float32) / N ** 0.5
    return wg, wu, wd


def make_case(wg32, M: int, K: int, N: int, pattern: str, p: float, heavy: float, seed: int):
    """x (feature 0 = constant 1 carrying the per-neuron shift) and the gate weight with that shift."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g, dtype=torch.float32)
    x[:, 0] = 1.0
    w = wg32.clone()
    if pattern == "uniform":
        pj = torch.full((N,), p, device=DEV)
    else:  # "paper": per-neuron lognormal rates (hot and rare neurons), per-token lognormal scale
        z = torch.randn(N, device=DEV, generator=g)
        pj = (p * torch.exp(1.2 * z - 0.72)).clamp(max=0.5)
        pj = pj * (p / pj.mean())
        x[:, 1:] *= torch.exp(0.2 * torch.randn(M, 1, device=DEV, generator=g))
    w[:, 0] = -shift_for(pj)
    if heavy > 0:
        n_heavy = max(1, int(round(heavy * M)))
        rows = torch.randperm(M, device=DEV, generator=g)[:n_heavy]
        x[rows, 1:] *= 4.0
    return x.to(BF), w.to(BF).contiguous()


def dense_gated(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def dense_nongated(x, wu, wd):
    return F.linear(F.relu(F.linear(x, wu)), wd)


class Timer:
    def __init__(self):
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    def time(self, fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.flush_buf.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)


def graphed(fn):
    """Capture fn() into a CUDA graph (warm-up on a side stream first); return replay callable and output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b).all(1)
    a, b = a[fin].float(), b[fin].float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/kernel_bench/bench.jsonl")
    ap.add_argument("--quick", action="store_true", help="fewer configurations (smoke run)")
    args = ap.parse_args()
    from experiments.provenance import collect
    from kernels.ffn import sparse_gated_ffn, sparse_nongated_ffn, transposed_down
    from kernels.twell import ops as twops

    prov = collect({"knobs": twops.knobs()})
    timer = Timer()
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    wdt = transposed_down(wd)
    acts = [0.0025, 0.005, 0.01, 0.02, 0.05, 0.10]
    large = [(65536, 10), (16384, 20), (4096, 30)]
    decode = [1, 16, 64]
    if args.quick:
        acts, large, decode = [0.005, 0.02, 0.10], [(65536, 5)], [1, 64]
    cases = []
    for M, reps in large:
        for p in acts:
            cases.append(("gated", M, reps, "uniform", p, 0.0))
        cases.append(("gated", M, reps, "uniform", 0.005, 0.01))
        cases.append(("gated", M, reps, "uniform", 0.01, 0.01))
        cases.append(("gated", M, reps, "paper", 0.005, 0.001))
    for M in decode:
        for p in ([0.005, 0.02, 0.10] if not args.quick else [0.005, 0.10]):
            cases.append(("gated", M, 50, "uniform", p, 0.0))
        cases.append(("gated", M, 50, "paper", 0.005, 0.0))
    for M in ([65536, 16384] if not args.quick else [65536]):
        for p in [0.005, 0.01, 0.02]:
            cases.append(("nongated", M, 10, "uniform", p, 0.0))

    wu_ng32 = make_weights(K, 8192, seed=1)
    rows_out = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    f = open(args.out, "a")
    t_start = time.time()
    for i, (kind, M, reps, pattern, p, heavy) in enumerate(cases):
        torch.manual_seed(i)
        if kind == "gated":
            x, wg = make_case(wg32, M, K, N, pattern, p, heavy, seed=1000 + i)
            dense_fn = lambda: dense_gated(x, wg, wu, wd)  # noqa: E731
            ours_fn = lambda mode="auto": sparse_gated_ffn(x, wg, wu, wd, w_down_t=wdt, mode=mode)  # noqa: E731
            ours_stats = lambda: sparse_gated_ffn(x, wg, wu, wd, w_down_t=wdt, return_stats=True)  # noqa: E731
            NN = N
        else:
            x, wun = make_case(wu_ng32[0], M, K, 8192, pattern, p, heavy, seed=2000 + i)
            wdn = wu_ng32[2].to(BF)
            wdtn = transposed_down(wdn)
            dense_fn = lambda: dense_nongated(x, wun, wdn)  # noqa: E731
            ours_fn = lambda mode="auto": sparse_nongated_ffn(x, wun, wdn, w_down_t=wdtn, mode=mode)  # noqa: E731
            ours_stats = lambda: sparse_nongated_ffn(x, wun, wdn, w_down_t=wdtn, return_stats=True)  # noqa: E731
            NN = 8192
        y_ref = dense_fn()
        y_ours, st = ours_stats()
        path = twops.LAST_PATH["path"]
        flagged = twops.LAST_PATH["flagged_rows"]
        nnz = st["nnz_per_token"].float()
        err = rel_err(y_ours, y_ref)
        # bf16-vs-fp32 error of dense on a row sample, for scale
        sample = slice(0, min(M, 256))
        if kind == "gated":
            ref32 = dense_gated(x[sample].float(), wg.float(), wu.float(), wd.float())
        else:
            ref32 = dense_nongated(x[sample].float(), wun.float(), wdn.float())
        err_ours32, err_dense32 = rel_err(y_ours[sample], ref32), rel_err(y_ref[sample], ref32)
        row = {"provenance": prov, "kind": kind, "M": M, "K": K, "N": NN, "pattern": pattern, "activity": p,
               "heavy_frac": heavy, "nnz_mean": nnz.mean().item(), "nnz_max": nnz.max().item(),
               "overflow_rows": flagged, "path": path, "rel_err_vs_dense_bf16": err,
               "rel_err_vs_fp32_sample": err_ours32, "dense_bf16_err_vs_fp32_sample": err_dense32}
        if M <= 64:
            rep_d, _ = graphed(dense_fn)
            rep_o, y_g = graphed(ours_fn)
            rep_o()
            torch.cuda.synchronize()
            row["graph_rel_err"] = rel_err(y_g, y_ref)
            row["dense_ms"] = timer.time(rep_d, reps)
            row["ours_ms"] = timer.time(rep_o, reps)
            row["timing"] = "cuda_graph_replay"
        else:
            row["dense_ms"] = timer.time(dense_fn, reps)
            row["ours_ms"] = timer.time(ours_fn, reps)
            if M == 65536 and kind == "gated":
                row["ours_sparse_forced_ms"] = timer.time(lambda: ours_fn("sparse"), reps)
                # breakdown: cuBLAS gate GEMM alone, and gate GEMM + compaction to TwELL (d2t)
                from kernels.ffn import twell_d2t

                row["gate_gemm_ms"] = timer.time(lambda: torch.mm(x, wg.t()), reps)
                row["d2t_ms"] = timer.time(lambda: twell_d2t(x, wg, 32), reps)
            row["timing"] = "eager"
        row["speedup"] = row["dense_ms"] / row["ours_ms"]
        rows_out.append(row)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(f"[{i + 1}/{len(cases)} {time.time() - t_start:.0f}s] {kind} M={M} {pattern} p={p} heavy={heavy} "
              f"nnz={row['nnz_mean']:.1f}/{row['nnz_max']:.0f} path={path} ovf={flagged} dense={row['dense_ms']:.3f} "
              f"ours={row['ours_ms']:.3f} x{row['speedup']:.2f} err={err:.2e}"
              + (f" sparse_forced={row['ours_sparse_forced_ms']:.3f} gate={row['gate_gemm_ms']:.3f}"
                 f" d2t={row['d2t_ms']:.3f}" if "ours_sparse_forced_ms" in row else ""),
              flush=True)
        del x, y_ref, y_ours
        torch.cuda.empty_cache()
    f.close()
    print("\n| kind | M | pattern | p | heavy | nnz mean/max | path | dense ms | ours ms | speedup | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['kind']} | {r['M']} | {r['pattern']} | {r['activity'] * 100:g}% | {r['heavy_frac'] * 100:g}% | "
              f"{r['nnz_mean']:.1f} / {r['nnz_max']:.0f} | {r['path']} | {r['dense_ms']:.3f} | {r['ours_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['rel_err_vs_dense_bf16']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
