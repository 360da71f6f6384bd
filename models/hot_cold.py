"""Hot/cold layers: a layer's most frequently firing neurons computed as dense GEMMs, the rest through TwELL.

Neuron firing rates are skewed in trained sparse models (results/activation_analysis: a few percent of a layer's
neurons fire on several percent of tokens, most on far fewer). A gathered neuron costs a W_u and a W_d row per token
it fires on; a dense one costs 4K multiply-adds per token whether it fires or not, so above a rate of about 1% a
neuron is cheaper dense. Whether a layer gains as a whole is measured, not predicted:

    rates = neuron_rates(model, batches)          # per layer, per neuron, on calibration text (any device)
    hot = choose_hot_neurons(model, rates, batch) # per layer, timed on the GPU (orders the model's neurons first)
    model.order_hot_neurons_(rates, hot)          # the same function; saved with the model (config.hot_neurons)

`calibrate_hot_neurons_` runs the three steps.
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from sfl.kernels.sparse_llama_mlp import inference_weights
from sfl.kernels.twell import ops

HOT_CANDIDATES = (0, 256, 512, 768, 1024, 1536)


@torch.no_grad()
def neuron_rates(model, batches: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the fraction of tokens on which each neuron's gate (the up projection when non-gated) is
    positive: float32 [intermediate_size] on the CPU. batches: input_ids tensors, run through model(...)."""
    mlps = model.sparse_mlps()
    counts = [torch.zeros(m.intermediate_size, dtype=torch.float64) for m in mlps]
    tokens = [0]

    def hook(i):
        def fn(mod, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            w = (mod.gate_proj if mod.gated else mod.up_proj).weight
            counts[i] += (F.linear(x.to(w.dtype), w) > 0).sum(0).double().cpu()
            if i == 0:
                tokens[0] += x.shape[0]
        return fn

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(mlps)]
    try:
        for ids in batches:
            model(input_ids=ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    if tokens[0] == 0:
        raise ValueError("neuron_rates: no tokens (batches was empty)")
    return [(c / tokens[0]).float() for c in counts]


def rotate_ms(fns: dict, reps: int, before: Callable[[], object] | None = None, warmup: bool = True) -> dict:
    """Median milliseconds of each fn, timed in rotation (drift hits all alike) with CUDA events; `before` runs
    ahead of every timed call, outside the timing (a benchmark's L2 flush); warmup: one untimed call each first."""
    if warmup:
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if before is not None:
                before()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times[k].append(s.elapsed_time(e))
    return {k: statistics.median(v) for k, v in times.items()}


def fastest_count(ms: dict, margin: float = 0.03) -> int:
    """The hot count with the lowest time in ms (count -> milliseconds, 0 among them), kept only if it beats 0 (all
    through TwELL) by more than `margin`; else 0."""
    best = min(ms, key=ms.get)
    return best if ms[best] < (1.0 - margin) * ms[0] else 0


@torch.no_grad()
def choose_hot_neurons(model, rates: Sequence[torch.Tensor], input_ids: torch.Tensor,
                       candidates: Sequence[int] = HOT_CANDIDATES, reps: int = 7, margin: float = 0.03) -> list[int]:
    """Per layer, the hot-neuron count whose sparse call ran fastest on this layer's input for input_ids (one
    forward; the candidates in forced sparse mode timed in rotation, CUDA events, medians of reps), 0 unless another
    beat it by more than `margin`. Orders the model's neurons by `rates` first (order_hot_neurons_ with no hot
    neurons). CUDA model (mlp_impl="cuda") only; the batch should have as many tokens as the calls to be sped up."""
    if model.config.mlp_impl != "cuda" or not torch.cuda.is_available():
        raise ValueError("choose_hot_neurons times the CUDA kernels: use a model with mlp_impl='cuda' on a GPU")
    candidates = sorted(set(candidates) | {0})   # 0 (all through TwELL) is the baseline every other is timed against
    mlps = model.sparse_mlps()
    model.order_hot_neurons_(rates, [0] * len(mlps))
    chosen = [0] * len(mlps)

    def hook(i):
        def fn(mod, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            wg, wu, wd = inference_weights(mod)
            x = x.to(wu.dtype)
            base = mod.plan.config.replace(mode="sparse")
            plans = {h: ops.Plan(base.replace(hot_neurons=h)) for h in candidates if h < mod.intermediate_size}
            ms = rotate_ms({h: (lambda p=p: ops.ffn(x, wg, wu, wd, p)) for h, p in plans.items()}, reps)
            chosen[i] = fastest_count(ms, margin)
        return fn

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(mlps)]
    try:
        model(input_ids=input_ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    return chosen


def calibrate_hot_neurons_(model, batches: Sequence[torch.Tensor], timing_ids: torch.Tensor, **kw) -> list[int]:
    """neuron_rates on batches, choose_hot_neurons on timing_ids, then order_hot_neurons_: returns the counts."""
    rates = neuron_rates(model, batches)
    hot = choose_hot_neurons(model, rates, timing_ids, **kw)
    ordered = [torch.sort(r, descending=True, stable=True).values for r in rates]   # the model is ordered already
    model.order_hot_neurons_(ordered, hot)
    return hot


__all__ = ["neuron_rates", "choose_hot_neurons", "calibrate_hot_neurons_", "fastest_count", "rotate_ms",
           "HOT_CANDIDATES"]
