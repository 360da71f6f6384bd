"""Benchmark: one training step of the ReLU FFN block with L1 (forward, L1 term, backward), eager against the same
step captured in a CUDA graph and replayed, at micro-batches small enough for the host's time per call to show.

Per (M, path) at the paper's 1.5B shape and activity: HF-style dense autograd (three F.linear, the baseline a user
has) and our op forced to its sparse and its dense path. Each step is timed with CUDA events after an L2 flush, one
step per repetition (the host's latency to the first kernel included), eager and replay interleaved, medians. The
replay's outputs and gradients are checked against the eager step's bits first. One JSONL row per (M, path).

    python -m sfl.experiments.kernel_bench.bench_captured_step --out results/kernel_bench/captured_step_h200.jsonl
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from sfl.kernels.config import KernelConfig
from sfl.kernels.timing import PairTimer, capture_graph
from sfl.kernels.train_ffn import DispatchState, sparse_gated_ffn_train

from ..trainer.provenance import collect
from .bench_training import dense_block, make_case

K, N = 2048, 5632


def make_step(leaves: list[torch.Tensor], gy: torch.Tensor, path: str, st: DispatchState, cfg: KernelConfig,
              seen: dict) -> Callable[[], torch.Tensor]:
    """One training step on `leaves` (x and the weights, grads set afresh): the loss sum(y * gy) + l1; our op's
    stats go to seen["stats"]."""
    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        if path == "hf_dense":
            y, l1 = dense_block(*leaves, l1=True)
        else:
            y, l1, seen["stats"] = sparse_gated_ffn_train(*leaves, mode=path, state=st, config=cfg)
        ((y.float() * gy).sum() + l1).backward()
        return y
    return step


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)) for x, y in zip(a, b))


def run(M: int, p: float, path: str, reps: int, timer: PairTimer, cfg: KernelConfig) -> dict:
    x, (wg, wu, wd), gy = make_case(M, K, N, p, 0.0, seed=M)
    down = wd if path == "hf_dense" else wd.t().contiguous().t()   # our op takes W_d neuron-major, as models keep it
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, down)]
    st, seen = DispatchState(), {}
    step = make_step(leaves, gy, path, st, cfg, seen)
    for _ in range(3):   # the dispatch history settles (the ELL width and backup block the capture keeps)
        step()
    graph, y_graph = capture_graph(step)
    grads_graph = [t.grad for t in leaves]
    graph.replay()
    torch.cuda.synchronize()
    replay = [y_graph.clone()] + [g.clone() for g in grads_graph]
    eager = [step().detach()] + [t.grad.clone() for t in leaves]
    exact = bits_equal(replay, eager)
    eager_ms, replay_ms = timer.time_pair(step, graph.replay, reps)
    return {"kind": "captured_step", "M": M, "K": K, "N": N, "p": p, "path": path, "eager_ms": eager_ms,
            "replay_ms": replay_ms, "replay_speedup": eager_ms / replay_ms, "replay_equals_eager": exact,
            "sparse_width": seen["stats"]["width"] if path == "sparse" else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1024,2048,4096,8192")
    ap.add_argument("--p", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    cfg = KernelConfig()
    prov = collect({"kernel_config": cfg.to_dict()})
    timer = PairTimer()
    with open(args.out, "a") as f:
        for M in (int(m) for m in args.ms.split(",")):
            for path in ("hf_dense", "dense", "sparse"):
                r = run(M, args.p, path, args.reps, timer, cfg)
                f.write(json.dumps({**r, "provenance": prov}) + "\n")
                print(f"M={M} {path:8s}: eager {r['eager_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms "
                      f"(x{r['replay_speedup']:.2f}), replay == eager: {r['replay_equals_eager']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
