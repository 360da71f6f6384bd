"""Timing kernels on the GPU as the dispatch calibration does: CUDA events around each call after an L2 flush,
a warm-up, medians of two callables timed in alternation (a clock or thermal drift hits both alike), and CUDA-graph
capture for the decode sizes, which models replay from graphs; and a model's FFN layers timed one by one on their
own inputs (the paper's per-layer speed contribution)."""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from .config import KernelConfig
from .device import dense_ffn
from .ffn import plan_for, sparse_gated_ffn, sparse_nongated_ffn

FLUSH_BYTES = 256 << 20  # larger than any GPU's L2: writing it evicts the previous call's data


def l2_flush_buffer(device: str = "cuda") -> torch.Tensor:
    """A buffer whose .zero_() before a timed call leaves no operand of the previous call in L2."""
    return torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn() captured into a CUDA graph, and the output of the captured call (the graph's memory, rewritten by each
    replay). Two warm-up calls run first on a side stream, as capture requires (lazy set-up, cuBLAS workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class PairTimer:
    """Medians of CUDA-event times between one reused pair of events, each repetition after an L2 flush, after a
    warm-up: one callable (time) or two timed in alternation (time_pair: a clock or thermal drift hits both alike;
    timing all of A, then all of B, biased B by up to several % at large M)."""

    def __init__(self) -> None:
        self.flush = l2_flush_buffer()
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def _once(self, fn: Callable[[], Any], calls: int) -> float:
        """ms per call of `calls` back-to-back calls after an L2 flush."""
        start, end = self.events
        self.flush.zero_()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    def time(self, fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
        """Median ms of fn over `reps` repetitions."""
        for _ in range(warmup):
            fn()
        return statistics.median(self._once(fn, 1) for _ in range(reps))

    def time_pair(self, fa: Callable[[], Any], fb: Callable[[], Any], reps: int, warmup: int = 2,
                  calls: int = 1) -> tuple[float, float]:
        """(median ms of fa, median ms of fb) over `reps` repetitions. calls > 1: that many back-to-back calls per
        repetition (per-call time): the steady state of a model, where the host runs ahead of the GPU; calls = 1
        also counts the host latency before the first kernel (the GPU is idle after the flush)."""
        for _ in range(warmup):
            fa()
            fb()
        ta: list[float] = []
        tb: list[float] = []
        for _ in range(reps):
            ta.append(self._once(fa, calls))
            tb.append(self._once(fb, calls))
        return statistics.median(ta), statistics.median(tb)


@torch.no_grad()  # the inference kernels refuse grad-requiring weights (they have no backward)
def time_layers(mlps: list[torch.nn.Module], xs: list[torch.Tensor], reps: int = 20, warmup: int = 5
                ) -> list[dict[str, Any]]:
    """Per FFN layer (a model's sparse_mlps()) on its own bf16 input: median ms of the dense FFN (three cuBLAS
    GEMMs), of kernels.ffn with auto dispatch (the path it took, its flagged-row share) and forced sparse."""
    out = []
    for mlp, x in zip(mlps, xs):
        wg = mlp.gate_proj.weight.to(torch.bfloat16).contiguous() if mlp.gated else None
        wu = mlp.up_proj.weight.to(torch.bfloat16).contiguous()
        wd = mlp.down_proj.weight.to(torch.bfloat16).contiguous()
        dense = lambda: dense_ffn(x, wg, wu, wd)  # noqa: E731
        if wg is not None:
            sparse = lambda mode="auto": sparse_gated_ffn(x, wg, wu, wd, mode=mode)  # noqa: E731
        else:
            sparse = lambda mode="auto": sparse_nongated_ffn(x, wu, wd, mode=mode)  # noqa: E731

        for _ in range(3):   # auto dispatch measures the layer on its first calls
            sparse()
        torch.cuda.synchronize()
        err = (sparse().float() - dense().float()).abs().max().item()
        # sparse_ms: what a model gets (auto dispatch, path recorded); sparse_forced_ms: the TwELL kernels alone
        info = plan_for(wg if wg is not None else wu, KernelConfig(), wg is not None).info()  # sparse()'s plan
        row = {"max_abs_diff_vs_dense": err, "path": info.get("path"), "flagged_rows_frac": info.get("f")}
        forced = lambda: sparse("sparse")  # noqa: E731
        for name, fn in (("dense_ms", dense), ("sparse_ms", sparse), ("sparse_forced_ms", forced)):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            row[name] = sorted(times)[len(times) // 2]
        out.append(row)
    return out
