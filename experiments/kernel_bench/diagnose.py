"""GPU diagnostics behind two open questions (not a benchmark of record; logs go to results/kernel_bench/diag/).

    python -m sfl.experiments.kernel_bench.diagnose compact --out DIR    # compaction vs reference.d2t, many seeds
    python -m sfl.experiments.kernel_bench.diagnose gap --out DIR        # where a dense-dispatched call loses time
    python -m sfl.experiments.kernel_bench.diagnose sparse --out DIR     # the sparse op vs its bare kernel sequence

compact: the intermittent compaction mismatch once seen in the GPU tests. Runs the test's inputs over many seeds
(and each seed several times) through the compaction kernel (the one variant left: v1 is gone from the runtime) and
logs every mismatching slot with the gate value behind it.
gap: times HF's dense block against our dense path and auto dispatch at several M, (a) one call between CUDA
events after an L2 flush (what the benchmarks report) and (b) 8 calls back to back (host latency hidden), plus
the host time per call while the GPU is busy, and a profiler table of GPU kernel times for one call of each.
sparse: the forced-sparse op at M = 65536 against the bare sequence of its kernels (fused d2t, gated_up, down; no
measurement, no host wait), timed alike, with profiler tables of both (bench_inference --overlap-probe found the
bare sequence 0.3-0.4 ms faster at 0.5-1% activity and equal at 0.25%).

Settings: KernelConfig.from_env() (SFL_KERNEL_* read once at start), logged in every row's provenance; each timed
function runs the op with its own ops.Plan.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sfl.kernels import reference
from sfl.kernels.config import KernelConfig
from sfl.kernels.loader import load_twell
from sfl.kernels.timing import PairTimer
from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train
from sfl.kernels.twell import ops

from ..trainer.provenance import collect
from .bench_inference import dense_gated, dense_nongated, ffn_call, make_case, make_weights
from .bench_training import dense_block
from .bench_training import make_case as make_train_case

DEV, BF = "cuda", torch.bfloat16


def _write(out_dir: str, name: str, rows: list[dict], cfg=None) -> None:
    prov = collect({"kernel_config": cfg.to_dict()} if cfg is not None else {})
    with open(os.path.join(out_dir, name), "a") as f:
        for r in rows:
            f.write(json.dumps({"provenance": prov, **r}) + "\n")


def compact(out_dir: str, seeds: int, max_rows: int) -> None:
    ext = load_twell()
    rows_out = []
    t0 = time.time()
    for seed in range(seeds):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        for rows, N in ((7, 1536), (3001, 5632), (65536, 5632)):
            if rows > max_rows:
                continue
            g = torch.randn(rows, N + 64, device=DEV, generator=gen).mul(2).sub(2.5).to(BF)
            g[0, :N // 2] = 1.0
            if rows > 5:
                g[2, 5] = float("nan")
                g[3, 9] = float("inf")
                g[4] = -0.0
            view = g[:, :N]
            ref = reference.d2t(torch.where((view > 0) | torch.isnan(view), view, torch.zeros_like(view)), 256, 32)
            valid = ref.valid_mask()
            for rep in range(4):
                packed = torch.full((rows, N // 256, 32), -7, device=DEV, dtype=torch.int32)
                counts = torch.full((rows, N // 256), -7, device=DEV, dtype=torch.int32)
                flag = torch.zeros(rows, device=DEV, dtype=torch.int32)
                ext.compact(view, N, packed, counts, flag)
                bad = (packed != ref.packed) & valid
                nb = int(bad.sum())
                rec = {"kind": "compact_stress", "seed": seed, "rows": rows, "N": N, "rep": rep, "bad_slots": nb,
                       "counts_equal": bool(torch.equal(counts, ref.counts))}
                if nb:
                    idx = bad.nonzero()[:16]
                    r_, t_, s_ = idx.unbind(1)
                    ours, want = packed[r_, t_, s_], ref.packed[r_, t_, s_]
                    col = (want & 0xFFFF) + t_ * 256
                    rec["first"] = [{"row": int(a), "tile": int(b), "slot": int(c), "ours": hex(int(o) & 0xFFFFFFFF),
                                     "ref": hex(int(w) & 0xFFFFFFFF), "g": float(view[a, cc].float())}
                                    for a, b, c, o, w, cc in zip(r_, t_, s_, ours, want, col)]
                    print(json.dumps(rec), flush=True)
                rows_out.append(rec)
        if seed % 10 == 0:
            print(f"[compact] seed {seed}: {sum(r['bad_slots'] > 0 for r in rows_out)} failing of {len(rows_out)} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    fails = [r for r in rows_out if r["bad_slots"] or not r["counts_equal"]]
    print(f"[compact] {len(fails)} failing runs of {len(rows_out)}", flush=True)
    _write(out_dir, "compact_stress.jsonl", rows_out)   # no KernelConfig involved: the kernel alone


def host_us(fn, n: int = 20) -> float:
    """Host time per call while the GPU is busy (so nothing waits on the GPU)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def kernel_table(fn) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out.append({"name": ev.key[:90], "count": ev.count, "device_us": round(t, 1)})
    return sorted(out, key=lambda r: -r["device_us"])


def report(rec: dict, tables: tuple[str, ...], top: int) -> None:
    """A gap row on stdout: its numbers, then the first `top` kernels of each profiler table."""
    print(json.dumps({k: v for k, v in rec.items() if not k.startswith("kernels")}), flush=True)
    for k in tables:
        print(k, json.dumps(rec[k][:top]), flush=True)


def inference_gap(timer: PairTimer, cfg, K: int, N: int, wg32, wu, wd) -> list[dict]:
    """Gated, 2% activity: HF's dense block against our dense path, auto dispatch and itself, per M."""
    rows = []
    with torch.no_grad():
        for M, reps in ((4096, 40), (16384, 30), (65536, 12)):
            x, wg = make_case(wg32, M, K, N, "uniform", 0.02, 0.0, seed=5)
            hf = lambda: dense_gated(x, wg, wu, wd)  # noqa: E731
            ours_dense, _ = ffn_call(x, wg, wu, wd, cfg.replace(mode="dense"))
            ours_auto, _ = ffn_call(x, wg, wu, wd, cfg)   # a fresh layer: auto learns this activity below
            for _ in range(3):
                ours_auto()
            torch.cuda.synchronize()
            assert torch.equal(ours_dense(), hf()), "dense path differs from HF dense"
            rec = {"kind": "inference_gap", "M": M, "K": K, "N": N, "activity": 0.02}
            for name, fn in (("ours_dense", ours_dense), ("ours_auto", ours_auto), ("hf_again", hf)):
                for calls in (1, 8):
                    a, b = timer.time_pair(hf, fn, reps, calls=calls)
                    rec[f"{name}_x{calls}"] = {"hf_ms": a, "ours_ms": b, "ratio": a / b}
                rec[f"{name}_host_us"] = host_us(fn)
            rec["hf_host_us"] = host_us(hf)
            rec["kernels_hf"] = kernel_table(hf)
            rec["kernels_ours_auto"] = kernel_table(ours_auto)
            report(rec, ("kernels_hf", "kernels_ours_auto"), 8)
            rows.append(rec)
    return rows


def nongated_gap(timer: PairTimer, cfg, K: int) -> list[dict]:
    """Non-gated (N = 8192), 1% activity: HF's linear-relu-linear against our dense path, kernel by kernel."""
    rows = []
    with torch.no_grad():
        wn32 = make_weights(K, 8192, seed=1)
        wdn = wn32[2].to(BF)
        for M, reps in ((16384, 30), (65536, 10)):
            x, wun = make_case(wn32[0], M, K, 8192, "uniform", 0.01, 0.0, seed=9)
            hf = lambda: dense_nongated(x, wun, wdn)  # noqa: E731
            ours_dense, _ = ffn_call(x, None, wun, wdn, cfg.replace(mode="dense"))
            g = torch.mm(x, wun.t())
            relu_torch = lambda: torch.relu(g)  # noqa: E731
            ext = load_twell()
            e_i, e_l = torch.empty(0, device=DEV, dtype=torch.int32), torch.empty(0, device=DEV)
            st2 = torch.zeros(2, device=DEV, dtype=torch.int64)
            out = torch.empty_like(g)
            relu_ours = lambda: ext.relu_mul_stats(g, torch.empty(0, device=DEV, dtype=BF), out, 8192, 32, 8192, e_i, st2, e_l)  # noqa: E731
            rec = {"kind": "nongated_gap", "M": M, "K": K, "N": 8192, "activity": 0.01}
            for name, (fa, fb) in (("block", (hf, ours_dense)), ("relu", (relu_torch, relu_ours))):
                for calls in (1, 8):
                    a, b = timer.time_pair(fa, fb, reps, calls=calls)
                    rec[f"{name}_x{calls}"] = {"hf_ms": a, "ours_ms": b, "ratio": a / b}
            rec["kernels_hf"] = kernel_table(hf)
            rec["kernels_ours"] = kernel_table(ours_dense)
            report(rec, ("kernels_hf", "kernels_ours"), 6)
            rows.append(rec)
            del x, g, out
    return rows


def training_gap(timer: PairTimer, cfg, K: int, N: int) -> list[dict]:
    """Gated fwd+bwd, 1% activity: dense autograd against the training op forced dense, auto and itself, per M."""
    rows = []
    for M, reps in ((4096, 30), (16384, 20)):
        x, (wg, wu_, wd_), gy = make_train_case(M, K, N, 0.01, 0.0, seed=7)
        params = [t.clone().requires_grad_(True) for t in (x, wg, wu_, wd_)]
        gl1 = torch.tensor(1000.0, device=DEV)
        st = DispatchState()

        def dense_step():
            for t in params:
                t.grad = None
            y, l = dense_block(*params)
            torch.autograd.backward([y, l], [gy, gl1])

        def ours(mode):
            def step():
                for t in params:
                    t.grad = None
                y, l, _ = sparse_gated_ffn_train(*params, mode=mode, state=st if mode == "auto" else None,
                                                 config=cfg)
                torch.autograd.backward([y, l], [gy, gl1])
            return step

        for _ in range(3):
            ours("auto")()
        rec = {"kind": "training_gap", "M": M, "K": K, "N": N, "activity": 0.01, "auto_path": st.last_path}
        for name, fn in (("ours_dense", ours("dense")), ("ours_auto", ours("auto")), ("dense_again", dense_step)):
            for calls in (1, 4):
                a, b = timer.time_pair(dense_step, fn, reps, calls=calls)
                rec[f"{name}_x{calls}"] = {"dense_ms": a, "ours_ms": b, "ratio": a / b}
            rec[f"{name}_host_us"] = host_us(fn)
        rec["dense_host_us"] = host_us(dense_step)
        rec["kernels_dense"] = kernel_table(dense_step)
        rec["kernels_ours_auto"] = kernel_table(ours("auto"))
        report(rec, ("kernels_dense", "kernels_ours_auto"), 10)
        rows.append(rec)
    return rows


def gap(out_dir: str, cfg) -> None:
    """Where a dense-dispatched call loses time: inference (gated, then non-gated), then training; one log."""
    timer = PairTimer()
    K, N = 2048, 5632
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    rows = inference_gap(timer, cfg, K, N, wg32, wu, wd)
    rows += nongated_gap(timer, cfg, K)
    rows += training_gap(timer, cfg, K, N)
    _write(out_dir, "dense_gap.jsonl", rows, cfg)


def sparse(out_dir: str, cfg) -> None:
    ext = ops.load()
    timer = PairTimer()
    K, N, M, S = 2048, 5632, 65536, 32
    T = N // 256
    wg32, wu32, wd32 = make_weights(K, N)
    wu, wd = wu32.to(BF), wd32.to(BF)
    wdt = wd.t().contiguous()   # neuron-major W_d [N, K] for the bare up_down kernel (the op caches its own)
    # the op as the bare sequence runs it: forced sparse, 32 slots, the non-overlapped fused epilogue
    op_cfg = cfg.replace(mode="sparse", slots=S, d2t="fused", d2t_overlap_min_k=max(K + 1, 4096))
    rows = []
    for p in (0.0025, 0.005, 0.01):
        x, wg = make_case(wg32, M, K, N, "uniform", p, 0.0, seed=7)

        def bare():
            packed = torch.empty(M, T, S, device=DEV, dtype=torch.int32)
            counts = torch.empty(M, T, device=DEV, dtype=torch.int32)
            flag = torch.zeros(M, device=DEV, dtype=torch.int32)
            y = torch.empty(M, K, device=DEV, dtype=BF)
            ext.d2t_gemm(x, wg, packed, counts, flag, False, 0)
            ext.up_down(x, wu, wdt, packed, counts, flag, y, 0)
            return y

        op, _ = ffn_call(x, wg, wu, wd, op_cfg)
        same = bool(torch.equal(bare(), op()))
        t_op, t_bare = timer.time_pair(op, bare, 10)
        rows.append({"kind": "sparse_gap", "M": M, "K": K, "N": N, "activity": p, "same_output": same,
                     "op_ms": t_op, "bare_ms": t_bare, "op_host_us": host_us(op), "bare_host_us": host_us(bare),
                     "kernels_op": kernel_table(op), "kernels_bare": kernel_table(bare)})
        print(f"[sparse] p={p} op={t_op:.3f} bare={t_bare:.3f} same={same}", flush=True)
        for k in ("kernels_op", "kernels_bare"):
            print("  ", k, [(r["name"][:40], r["count"], r["device_us"]) for r in rows[-1][k][:8]], flush=True)
        del x, wg
        torch.cuda.empty_cache()
    _write(out_dir, "sparse_gap_h100.jsonl", rows, cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["compact", "gap", "sparse"])
    ap.add_argument("--out", default="results/kernel_bench/diag")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--max-rows", type=int, default=65536)
    a = ap.parse_args(argv)

    cfg = KernelConfig.from_env()   # SFL_KERNEL_* overrides, read once
    os.makedirs(a.out, exist_ok=True)
    if a.what == "compact":
        compact(a.out, a.seeds, a.max_rows)
    elif a.what == "sparse":
        sparse(a.out, cfg)
    else:
        gap(a.out, cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
