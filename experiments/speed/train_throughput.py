"""Training tokens/s and peak memory as the paper measures them: the paper's shapes, through
experiments/trainer/train.py's own optimizer step, each side at an equal micro-batch and at its own largest one.

    python -m sfl.experiments.speed.train_throughput --layers 8 28 --out results/speed/train_throughput_h100.jsonl
    python -m sfl.experiments.speed.train_throughput --layers 28 --nnz-sweep 10 20 29 60 120   # Fig. 5 counterpart

The model: bench.py's paper shape (random weights, gates calibrated to the paper's activity profile on the timed
tokens), fp32 master weights, bf16 autocast, AdamW, gradient clipping: `train.optimizer_step`, unchanged.
Sides (one model, one optimizer: the parameters and the AdamW state are the same objects on every side):
  dense L1=0   the paper's dense baseline: mlp_impl "dense", no L1 term, no sparsity statistics
  dense L1     our dense MLP as it trains sparse models: the L1 term, per-token counts, dead-neuron tracker
  sparse       mlp_impl "cuda" with the L1 term (the model's KernelConfig; the path each layer took is logged)
Per activation-checkpointing setting (off, on): the sides at --micro-batch, timed in interleaved blocks
(A B C C B A ...; medians), then each side's largest micro-batch (doubling until out of memory, then bisection;
with checkpointing on CUDA, extrapolated from the peaks of two sizes instead: see largest_by_peak; --no-search skips it), timed the same way at each side's own micro-batch. Peak memory: the allocator's maximum over
a side's blocks. Rows carry the measured activity, the KernelConfig and provenance. The optimizer runs at --lr 0
(its whole update, same cost; the weights stay as calibrated, so the activity holds: see Trainer).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from sfl.kernels.config import KernelConfig

from ..trainer import train as train_mod
from ..trainer.provenance import collect
from .bench import PAPER_NNZ, PAPER_SCALES, build_paper_model, calibrate_paper_model, paper_profile

SIDES = ("dense L1=0", "dense L1", "sparse")
EXTRA_SIDES = ("sparse forced",)  # every layer through the sparse op (what auto's thresholds are judged against)
L1_COEFF = 2e-5  # the paper's recommended L1 (the sparse recipe of its speed tables)


@contextlib.contextmanager
def as_side(model, side: str, l1_coeff: float = L1_COEFF) -> Iterator[float]:
    """The model set up as `side` trains (SIDES, or "sparse forced": every layer through the sparse op, whatever
    its activity and size); yields the side's L1 coefficient."""
    impl, stats, coeff = {"dense L1=0": ("dense", False, 0.0), "dense L1": ("dense", True, l1_coeff),
                          "sparse": ("cuda", True, l1_coeff), "sparse forced": ("cuda", True, l1_coeff)}[side]
    base = model.config.get_kernel_config()
    if side == "sparse forced":
        model.set_kernel_config(KernelConfig.from_dict({**base.to_dict(), "train_mode": "sparse",
                                                        "train_sparse_min_m": 1}))
    model.set_mlp_impl(impl)
    model.config.track_sparsity_stats = stats
    try:
        yield coeff
    finally:
        model.set_mlp_impl("dense")
        model.config.track_sparsity_stats = True
        if side == "sparse forced":
            model.set_kernel_config(base)


def ffn_paths(model) -> list[str]:
    """The FFN path ("sparse" or "dense") of every layer's last training forward."""
    return [getattr(getattr(m, "_train_state", None), "last_forward_path", None) or "dense"
            for m in model.sparse_mlps()]


def ffn_dispatch(model) -> list[dict[str, Any]]:
    """Per layer: the path of its last training forward and what the dispatch decided it from (the measured
    activity of light rows, the fraction of rows above the ELL width), and the sparse path's saved bytes."""
    out = []
    for m in model.sparse_mlps():
        st = getattr(m, "_train_state", None)
        out.append({"path": (st and st.last_forward_path) or "dense",
                    "activity": st and st.activity, "backup_frac": st and st.backup_frac,
                    "kept_bytes": st and st.last_kept_bytes,
                    "backup_rows": None if st is None or st.last_backup_rows is None else int(st.last_backup_rows)})
    return out


def dispatch_note(row: dict[str, Any]) -> str:
    """', sparse layers s/L, rows above the ELL width <= x%' for a sparse row (the console's view of ffn_dispatch)."""
    d = row.get("ffn_dispatch")
    if not d:
        return ""
    frac = [x["backup_frac"] for x in d if x["backup_frac"] is not None]
    return (f", sparse layers {row['sparse_layers']}/{len(d)}"
            + (f", rows above the ELL width <= {100 * max(frac):.1f}%" if frac else ""))


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest n in [1, limit] with fits(n) (monotone: all smaller n fit too), 0 if none: doubling from start,
    then bisection between the last size that fit and the first that did not."""
    lo, hi = 0, limit + 1  # invariant: lo fits (0 trivially), hi does not (past the limit)
    n = min(max(1, start), limit)
    while n < hi and fits(n):
        lo, n = n, min(2 * n, hi)
    hi = min(hi, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_by_peak(peak: Callable[[int], int | None], start: int, limit: int, capacity: int,
                    margin: float = 0.9) -> int:
    """The largest n in [start, limit] whose peak memory stays under margin * capacity, extrapolated linearly from
    the peaks measured at the last two of start, 2 start, 4 start, ... For activation checkpointing, where a step
    that runs out of memory inside the sparse op's backward leaves memory behind (see Trainer.release), so the search
    must not rely on failing. peak(n) runs micro-batch n and returns its peak bytes, None when out of memory.
    At small micro-batches the optimizer step's transient, not the activations, sets the peak, so two small sizes
    understate the growth per sample. Every prediction (the next doubling, then the answer) therefore grows the last
    measured peak by the larger of the last growth per sample and peak / n, which bounds the true growth from above
    wherever the peak is linear with a non-negative intercept: safe, at the cost of a few samples."""
    budget = margin * capacity
    n, p = start, peak(start)
    if p is None:
        return max(0, start - 1)
    slope = None
    while (n2 := min(2 * n, limit)) > n and p + max(slope or 0, p / n) * (n2 - n) <= budget:
        p2 = peak(n2)
        if p2 is None:
            return n
        slope, n, p = max(0.0, (p2 - p) / (n2 - n)), n2, p2
    if slope is None:  # no second size measured: nothing to extrapolate
        return n
    return max(n, min(limit, n + int((budget - p) / max(slope, p / n))))


class Trainer:
    """train.optimizer_step on one model and optimizer, for any side and micro-batch."""

    def __init__(self, model, ids: torch.Tensor, device: torch.device, lr: float = 0.0) -> None:
        self.model, self.ids, self.device = model, ids, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        # lr 0 by default: AdamW runs every kernel of its update (the cost is the same) but the weights stay as
        # calibrated, so every timed step sees the paper's activity profile. With lr > 0 the optimizer also
        # writes into the calibration's bias channel, and the activity drifts over the steps of a long run.
        self.opt = torch.optim.AdamW(train_mod.param_groups(model, 0.1), lr=lr)

    def step(self, side: str, micro_batch: int) -> None:
        cfg = {"micro_batch_size": micro_batch, "grad_accum": 1,
               "precision": "bf16" if self.device.type == "cuda" else "fp32"}
        batch = self.ids[torch.arange(micro_batch) % self.ids.shape[0]]
        with as_side(self.model, side) as coeff:
            train_mod.optimizer_step(self.model, batch, cfg, coeff, self.device, self.params, 1.0, self.opt, None)

    def fits(self, side: str, micro_batch: int) -> bool:
        ok = self._two_steps(side, micro_batch)
        self.release()  # outside the except block, once the exception and its frames are gone
        return ok

    def _two_steps(self, side: str, micro_batch: int) -> bool:
        try:
            for _ in range(2):  # the second step runs with the optimizer state and the dispatch settled
                self.step(side, micro_batch)
            return True
        except torch.OutOfMemoryError:
            return False

    def peak(self, side: str, micro_batch: int) -> int | None:
        """Peak allocated bytes over two steps at micro_batch (CUDA), None when out of memory."""
        torch.cuda.reset_peak_memory_stats()
        ok = self._two_steps(side, micro_batch)
        peak = torch.cuda.max_memory_allocated()
        self.release()
        return peak if ok else None

    def release(self) -> None:
        """Free what a failed step left that Python can reach: gradients, garbage cycles, the allocator's cache.
        Not freed (held from C++): the checkpointed layer inputs of a step that ran out of memory inside the sparse
        op's backward under activation checkpointing (lab/speed/ckpt_oom_leak_repro.py), which is why the largest
        micro-batch with checkpointing is not measured."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class SideOutOfMemory(RuntimeError):
    """A side ran out of memory while the sides were timed together."""

    def __init__(self, side: str) -> None:
        super().__init__(f"side {side!r} ran out of memory")
        self.side = side


def time_blocks(tr: Trainer, mbs: dict[str, int], blocks: int, steps: int) -> dict[str, dict[str, Any]]:
    """Seconds per step of each side in interleaved blocks (order reversed every other round), peak memory.
    Raises SideOutOfMemory naming the side that did not fit."""
    cuda = tr.device.type == "cuda"
    out: dict[str, dict[str, Any]] = {s: {"block_s": [], "peak_bytes": 0} for s in mbs}

    def step(s: str) -> None:
        try:
            tr.step(s, mbs[s])
        except torch.OutOfMemoryError as e:
            raise SideOutOfMemory(s) from e

    for s in mbs:  # warm-up: the dispatch history, the allocator, cuBLAS heuristics
        for _ in range(2):
            step(s)
    order = list(mbs)
    for b in range(blocks):
        for s in (order if b % 2 == 0 else order[::-1]):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(s)
            if cuda:
                torch.cuda.synchronize()
                out[s]["peak_bytes"] = max(out[s]["peak_bytes"], torch.cuda.max_memory_allocated())
            out[s]["block_s"].append((time.perf_counter() - t0) / steps)
    return out


def time_largest(tr: Trainer, largest: dict[str, int], blocks: int, steps: int,
                 tries: int = 4) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """time_blocks at each side's largest micro-batch. The search ran each side alone; timed beside the others a side
    can run out of memory (fragmentation, or what a failed step left: see Trainer.release): it then steps down by an
    eighth and the group is timed again."""
    for _ in range(tries):
        try:
            return largest, time_blocks(tr, largest, blocks, steps)
        except SideOutOfMemory as e:
            side = e.side
        tr.release()
        largest = {**largest, side: max(1, largest[side] * 7 // 8)}
        if tr.device.type == "cuda":
            print(f"[train_throughput] {side} ran out of memory beside the others; now {largest} "
                  f"(allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB after release)", flush=True)
    raise RuntimeError(f"sides still out of memory after {tries} step-downs: {largest}")


def side_rows(tr: Trainer, mbs: dict[str, int], res: dict[str, dict[str, Any]], seq: int,
              base: dict[str, Any]) -> list[dict[str, Any]]:
    ref = statistics.median(res["dense L1=0"]["block_s"]) / mbs["dense L1=0"] if "dense L1=0" in res else None
    rows = []
    for s, r in res.items():
        med = statistics.median(r["block_s"])
        row = {**base, "side": s, "micro_batch": mbs[s], "tokens_per_step": mbs[s] * seq,
               "tokens_per_s": mbs[s] * seq / med, "s_per_step": med, "block_s": r["block_s"],
               "peak_mem_gb": r["peak_bytes"] / 1e9 if r["peak_bytes"] else None}
        if ref is not None:  # tokens/s over the paper's dense baseline's
            row["speedup_vs_dense_l1_0"] = ref / (med / mbs[s])
        if s.startswith("sparse"):
            tr.step(s, mbs[s])
            paths = ffn_paths(tr.model)
            row["ffn_paths"], row["sparse_layers"] = paths, paths.count("sparse")
            row["ffn_dispatch"] = ffn_dispatch(tr.model)
        rows.append(row)
    return rows


def run_shape(model, ids: torch.Tensor, device: torch.device, a: argparse.Namespace,
              base: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """The rows of one shape, a group at a time (written as they come: a run cut short keeps what finished)."""
    model.float().train()
    tr = Trainer(model, ids[:, : a.seq_len + 1], device, lr=a.lr)
    for ckpt in a.activation_checkpointing:
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        b = {**base, "activation_checkpointing": ckpt}
        equal = {s: a.micro_batch for s in a.sides}
        yield side_rows(tr, equal, time_blocks(tr, equal, a.blocks, a.steps), a.seq_len,
                        {**b, "micro_batch_policy": "equal"})
        if not a.no_search:
            if ckpt and device.type == "cuda":  # never search by failing here (see largest_by_peak)
                cap = torch.cuda.get_device_properties(device).total_memory
                searched = {s: largest_by_peak(lambda n, s=s: tr.peak(s, n), a.micro_batch, a.max_micro_batch, cap,
                                               margin=a.ckpt_margin) for s in a.sides}
            else:
                searched = {s: largest_fitting(lambda n, s=s: tr.fits(s, n), a.micro_batch, a.max_micro_batch)
                            for s in a.sides}
            largest, res = time_largest(tr, searched, a.blocks, a.steps)
            how = (f"peak extrapolated to {100 * a.ckpt_margin:.0f}% of memory" if ckpt and device.type == "cuda"
                   else "searched")
            yield side_rows(tr, largest, res, a.seq_len,
                            {**b, "micro_batch_policy": f"largest that fits ({how}, up to {a.max_micro_batch})",
                             "micro_batch_searched": searched})
    model.gradient_checkpointing_disable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 18, 28, 38])
    ap.add_argument("--nnz-sweep", type=float, nargs="*", default=None, help="mean non-zeros per token to sweep")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES + EXTRA_SIDES)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-micro-batch", type=int, default=64)
    ap.add_argument("--no-search", action="store_true", help="equal micro-batch only")
    ap.add_argument("--ckpt-margin", type=float, default=0.9,
                    help="with checkpointing, the share of GPU memory the extrapolated peak may reach (a step that "
                         "runs out of memory there leaves memory behind, so the search must not fail)")
    ap.add_argument("--activation-checkpointing", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0, help="AdamW learning rate of the timed steps (see Trainer)")
    ap.add_argument("--out", type=Path, default=Path("results/speed/train_throughput.jsonl"))
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for n_layers in a.layers:
        for nnz in a.nnz_sweep or [PAPER_NNZ.get(n_layers, 30.0)]:
            model = build_paper_model(n_layers, dev, torch.bfloat16, seed=a.seed)
            g = torch.Generator().manual_seed(a.seed)
            vocab = model.config.vocab_size
            heavy = torch.randperm(vocab, generator=g)[: max(1, vocab // 100)]
            ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), generator=g).to(dev)
            achieved = calibrate_paper_model(model, paper_profile(n_layers, nnz), ids[:, :-1], heavy_ids=heavy)
            model.config.l1_reduction = "sum"
            base = {"model": f"paper-shape {PAPER_SCALES.get(n_layers, f'{n_layers} layers')}",
                    "num_hidden_layers": n_layers, "target_nnz_mean": nnz,
                    "calibration_nnz_mean": sum(achieved) / len(achieved), "seq_len": a.seq_len,
                    "l1_coeff_sparse": L1_COEFF, "nnz_sweep": bool(a.nnz_sweep), "lr": a.lr, "seed": a.seed,
                    "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    "kernel_config": model.config.get_kernel_config().to_dict(),
                    "timed": "train.optimizer_step: forward (+L1) and backward under bf16 autocast, clip, AdamW",
                    **collect()}
            for rows in run_shape(model, ids, dev, a, base):
                with a.out.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
                for r in rows:
                    print(f"{r['model']} nnz {nnz:g} ckpt {r['activation_checkpointing']} {r['micro_batch_policy'][:7]} "
                          f"{r['side']:10s} mb {r['micro_batch']:3d}: {r['tokens_per_s']:.0f} tok/s, "
                          f"peak {r['peak_mem_gb'] or float('nan'):.1f} GB{dispatch_note(r)}", flush=True)
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
