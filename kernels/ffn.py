"""Public entry points of the TwELL CUDA kernels (inference).

    y = sparse_gated_ffn(x, w_gate, w_up, w_down)          # relu(x Wg^T) * (x Wu^T) @ Wd^T
    y = sparse_nongated_ffn(x, w_up, w_down)               # relu(x Wu^T) @ Wd^T
    y, stats = sparse_gated_ffn(..., return_stats=True)    # stats['nnz_per_token']: int32 [M]

Weights in nn.Linear layouts: w_gate/w_up [N, K], w_down [K, N]. x [..., K] bf16 CUDA, contiguous.
Exact on every input: rows that overflow the TwELL slots or have a non-finite gate go through dense cuBLAS.
On CPU or without the extension a KernelUnavailableError names the pure-PyTorch reference path.
"""
from __future__ import annotations

import weakref
from typing import Literal

import torch
from torch import Tensor

from .loader import REFERENCE_HINT, KernelUnavailableError
from .reference import check_ffn_layouts

_MODES = {"auto": 0, "sparse": 1, "dense": 2}
_WDT_CACHE: dict[tuple, tuple] = {}
_WDT_CACHE_MAX = 16


def _ops():
    import sfl.kernels.twell.ops  # noqa: F401  (registers torch.ops.sfl_twell.*)

    return torch.ops.sfl_twell


def transposed_down(w_down: Tensor) -> Tensor:
    """Neuron-major copy W_d^T [N, K] (each active neuron's row contiguous), cached per live tensor + version.

    The cache holds a weak reference to the source and checks identity, so a new tensor that reuses a freed
    tensor's memory (same data_ptr) never hits a stale entry.
    """
    key = (w_down.data_ptr(), w_down._version, tuple(w_down.shape), w_down.device, w_down.dtype)
    hit = _WDT_CACHE.get(key)
    if hit is not None and hit[0]() is w_down:
        return hit[1]
    if len(_WDT_CACHE) >= _WDT_CACHE_MAX:
        _WDT_CACHE.pop(next(iter(_WDT_CACHE)))
    t = w_down.t().contiguous()
    _WDT_CACHE[key] = (weakref.ref(w_down), t)
    return t


def validate(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor) -> None:
    """Raise a ValueError/KernelUnavailableError that says what to do for any unsupported input."""
    names = [("x", x), ("w_up", w_up), ("w_down", w_down)] + ([("w_gate", w_gate)] if w_gate is not None else [])
    for name, t in names:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise KernelUnavailableError(
                f"{name} is on {t.device}: the TwELL kernels run on CUDA tensors only; move the inputs with "
                f".cuda(), or use {REFERENCE_HINT}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} has dtype {t.dtype}: the TwELL kernels take torch.bfloat16; "
                             f"cast with .to(torch.bfloat16)")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous: call .contiguous() first")
    if len({t.device for _, t in names}) != 1:
        raise ValueError("x and all weights must be on the same CUDA device")
    K, N = check_ffn_layouts(x, w_gate, w_up, w_down)
    if K % 64 != 0 or K > 4096:
        raise ValueError(f"hidden size K={K} unsupported: need K % 64 == 0 and K <= 4096; use {REFERENCE_HINT}")
    if N % 256 != 0 or N == 0:
        raise ValueError(f"intermediate size N={N} unsupported: need N % 256 == 0 (TwELL tile 256); "
                         f"use {REFERENCE_HINT}")


def _aligned(t: Tensor | None) -> Tensor | None:
    """The kernels read rows with 16-byte vector loads; a tensor whose storage starts mid-vector (a view at an odd
    element offset) is copied to a fresh, aligned buffer rather than faulting."""
    return t.clone() if t is not None and t.data_ptr() % 16 else t


def _run(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, return_stats: bool, mode: str,
         activity_hint: float, w_down_t: Tensor | None):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_gate, w_up, w_down)):
        # the inference kernels have no backward: refuse rather than return a result whose gradients are missing
        raise ValueError("sfl.kernels.ffn is inference-only (no backward): call it under torch.no_grad() / "
                         "torch.inference_mode() or pass detached tensors; to train, use "
                         "sfl.kernels.train_ffn.sparse_gated_ffn_train / sparse_nongated_ffn_train")
    validate(x, w_gate, w_up, w_down)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    lead = x.shape[:-1]
    x2 = _aligned(x.reshape(-1, x.shape[-1]))
    w_gate, w_up, w_down = _aligned(w_gate), _aligned(w_up), _aligned(w_down)
    wdt = _aligned(w_down_t) if w_down_t is not None else transposed_down(w_down)
    ops = _ops()
    if not torch.compiler.is_compiling():
        # eager (CUDA-graph capture included): call the implementation directly; the torch.library op costs
        # tens of microseconds of host time per call, which the GPU waits for at small M
        from .twell.ops import _ffn_impl

        y, nnz = _ffn_impl(x2, w_gate, w_up, wdt, w_down, _MODES[mode], float(activity_hint), return_stats)
    elif w_gate is not None:
        y, nnz = ops.gated_ffn(x2, w_gate, w_up, wdt, w_down, _MODES[mode], float(activity_hint), return_stats)
    else:
        y, nnz = ops.nongated_ffn(x2, w_up, wdt, w_down, _MODES[mode], float(activity_hint), return_stats)
    y = y.reshape(*lead, x.shape[-1])
    if return_stats:
        return y, {"nnz_per_token": nnz}
    return y


def sparse_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *, return_stats: bool = False,
                     mode: Literal["auto", "sparse", "dense"] = "auto", activity_hint: float = 0.0,
                     w_down_t: Tensor | None = None):
    """y = (relu(x w_gate^T) * (x w_up^T)) w_down^T through TwELL; exact (overflow rows go dense)."""
    return _run(x, w_gate, w_up, w_down, return_stats, mode, activity_hint, w_down_t)


def sparse_nongated_ffn(x: Tensor, w_up: Tensor, w_down: Tensor, *, return_stats: bool = False,
                        mode: Literal["auto", "sparse", "dense"] = "auto", activity_hint: float = 0.0,
                        w_down_t: Tensor | None = None):
    """y = relu(x w_up^T) w_down^T through TwELL; exact (overflow rows go dense)."""
    return _run(x, None, w_up, w_down, return_stats, mode, activity_hint, w_down_t)


def twell_d2t(x: Tensor, w_gate: Tensor, slots: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """TwELL of relu(x w_gate^T): (packed int32 [M, T, slots], counts int32 [M, T], flag int32 [M])."""
    validate(x, w_gate, w_gate, torch.empty(w_gate.shape[1], w_gate.shape[0], device=w_gate.device,
                                             dtype=w_gate.dtype))
    if not 1 <= slots <= 256:
        raise ValueError(f"slots must be in 1..256, got {slots}")
    return _ops().d2t(_aligned(x.reshape(-1, x.shape[-1])), _aligned(w_gate), slots)


from .twell.module import TwELLGatedMLP, TwELLMLP  # noqa: E402  (re-export)

__all__ = ["sparse_gated_ffn", "sparse_nongated_ffn", "twell_d2t", "transposed_down", "validate",
           "TwELLGatedMLP", "TwELLMLP", "KernelUnavailableError"]
