"""Which GPUs run the TwELL kernels, decided in one place, and the dense path the others take.

The kernels use sm_90a-only instructions (wgmma, TMA; the loader builds for "9.0a"), so they run on compute
capability (9, 0), the Hopper GPUs (H100, H200, GH200, H800, H20). Every other GPU (Ampere, Ada, Blackwell, ROCm)
takes the dense path: the same GEMMs and elementwise steps as HF's LlamaMLP, the same results, with one warning per
GPU that says why. No build of the extension is attempted there (kernels/loader.py refuses with the same reason).

    ok, why = kernels_supported(device)   # (True, "") on Hopper, else (False, the reason)
    if dense_fallback(x.device): ...      # a CUDA tensor on a GPU without the kernels: warns once, True
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

HOPPER = (9, 0)

_SUPPORT: dict[int, tuple[bool, str]] = {}   # per device index: the decision never changes within a process
_WARNED: set[int] = set()
_FALLBACK: dict[torch.device, bool] = {}


def _device_index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def decide(name: str, capability: tuple[int, int], rocm: bool = False) -> tuple[bool, str]:
    """(True, "") if a GPU of this name and compute capability runs the kernels, else (False, why)."""
    if rocm:
        return False, f"the TwELL kernels need an NVIDIA sm_90 (Hopper) GPU; {name} is a ROCm GPU"
    if tuple(capability) == HOPPER:
        return True, ""
    major, minor = capability
    return False, (f"the TwELL kernels need an sm_90 (Hopper) GPU (they use sm_90a-only wgmma/TMA instructions); "
                   f"{name} is sm_{major}{minor}")


def kernels_supported(device: torch.device | int | str | None = None) -> tuple[bool, str]:
    """(True, "") where the TwELL kernels run on `device` (default: the current CUDA device), else (False, why).
    Cached per device."""
    if not torch.cuda.is_available():
        return False, "the TwELL kernels need a CUDA GPU (torch.cuda.is_available() is False)"
    index = _device_index(device)
    got = _SUPPORT.get(index)
    if got is None:
        got = _SUPPORT[index] = decide(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                                       torch.version.hip is not None)
    return got


@torch.compiler.assume_constant_result  # a compiled model traces one path: the device's answer never changes
def dense_fallback(device: torch.device) -> bool:
    """True when `device` is a CUDA GPU without the kernels: the caller takes the dense path (one warning per GPU,
    saying why). False on Hopper, and for CPU tensors (the callers' own errors name the CPU paths). One dict lookup
    after the first call: the op asks on every call."""
    got = _FALLBACK.get(device)
    if got is None:
        got = _FALLBACK[device] = _fallback(device)
    return got


def _fallback(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    ok, why = kernels_supported(device)
    if ok:
        return False
    index = _device_index(device)
    if index not in _WARNED:
        _WARNED.add(index)
        warnings.warn(f"sfl: {why}: using the dense path (same results)", RuntimeWarning, stacklevel=3)
    return True


def dense_ffn(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, stats: Tensor | None = None) -> Tensor:
    """The FFN on a GPU without the kernels: HF LlamaMLP's ops (non-gated: relu(x W_u^T) W_d^T), any weight strides.
    stats (int64 [3], mutated): accumulates what the op's kernels count, non-zeros of relu(gate) summed over tokens,
    the largest per-token count, tokens."""
    a = F.relu(F.linear(x, w_gate if w_gate is not None else w_up))
    h = a * F.linear(x, w_up) if w_gate is not None else a
    if stats is not None and a.numel() > 0:
        with torch.no_grad():
            nnz = (a != 0).reshape(-1, a.shape[-1]).sum(1, dtype=torch.int64)
            stats[0] += nnz.sum()
            stats[1] = torch.maximum(stats[1], nnz.max())
            stats[2] += nnz.numel()
    return F.linear(h, w_down)


__all__ = ["kernels_supported", "dense_fallback", "dense_ffn", "decide", "HOPPER"]
