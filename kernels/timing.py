"""Timing kernels on the GPU as the dispatch calibration does: CUDA events around each call after an L2 flush,
a warm-up, medians of two callables timed in alternation (a clock or thermal drift hits both alike), and CUDA-graph
capture for the decode sizes, which models replay from graphs."""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

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
    """Medians of two callables timed in alternation, one call per repetition between one reused pair of CUDA
    events, each repetition after an L2 flush, after a warm-up of both."""

    def __init__(self) -> None:
        self.flush = l2_flush_buffer()
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def time_pair(self, fa: Callable[[], Any], fb: Callable[[], Any], reps: int,
                  warmup: int = 2) -> tuple[float, float]:
        """(median ms of fa, median ms of fb) over `reps` repetitions."""
        for _ in range(warmup):
            fa()
            fb()
        ta: list[float] = []
        tb: list[float] = []
        start, end = self.events
        for _ in range(reps):
            for fn, out in ((fa, ta), (fb, tb)):
                self.flush.zero_()
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
        return statistics.median(ta), statistics.median(tb)
