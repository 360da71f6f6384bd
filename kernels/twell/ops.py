"""The inference ops of the TwELL kernels: schemas and fake implementations (here), CUDA implementations (runtime.cpp).

    y = torch.ops.sfl_twell.ffn(x, w_gate, w_up, w_down, stats, plan.id, plan.spec)
    packed, counts, flag = torch.ops.sfl_twell.d2t(x, w_gate, slots, plan_spec(config))

``ffn`` is one C++ op per FFN call (gated, or non-gated with ``w_gate=None``): checks, dispatch, workspaces, kernels
and the exact dense backup run in C++ (runtime.cpp; kernels/README.md, "The op"). Its state between calls lives in a
per-layer **plan** that the C++ side creates on the first call naming ``plan.id``, from the configuration the call
carries (``plan.spec``: a KernelConfig's fields by name, ``plan_spec``). ``stats`` (optional, int64 [3],
mutated) accumulates the model's statistics on the device: non-zeros summed over tokens, the largest per-token
count, tokens.

Schemas and fakes are defined in Python so that the ops exist, and torch.compile traces them, on any machine; the
CUDA kernels register when the extension loads (``load()``; the fakes load it too, so a model compiled before its
first eager call still finds the kernels at run time).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import KernelConfig, TILE_N
from .. import tables
from ..device import dense_ffn, dense_fallback, kernels_supported
from ..loader import load_twell, loaded

_lib = torch.library.Library("sfl_twell", "DEF")
_lib.define("ffn(Tensor x, Tensor? w_gate, Tensor w_up, Tensor w_down, Tensor(a!)? stats, int plan, str config) "
            "-> Tensor")
_lib.define("d2t(Tensor x, Tensor w_gate, int slots, str config) -> (Tensor, Tensor, Tensor)")

# The training fields a plan reads (runtime.cpp: train_decide, the training op's dispatch on the same plans); the
# training op's other fields (width, chunk rows, dW blocks, ...) are its arguments (kernels/train_ffn.py).
TRAIN_PLAN_FIELDS = ("train_dense_above", "train_dense_above_large", "train_backup_dense_above", "train_large_m",
                     "train_sparse_min_m", "train_shrink")
# The fields the C++ plan reads (runtime.cpp: parse_config): the inference op's, and the training dispatch's.
OP_FIELDS = tuple(f for f in KernelConfig().to_dict() if not f.startswith("train_") or f in TRAIN_PLAN_FIELDS)


def load():
    """Build (once per source version, cached on disk) and load the extension: registers the CUDA kernels."""
    return load_twell()


def ensure_loaded() -> None:
    """Load the extension unless it is loaded (cheap: one dict lookup; a constant to a compiled model)."""
    if loaded("twell") is None:
        load_twell()


def _load_if_cuda() -> None:
    if loaded("twell") is None and kernels_supported()[0]:
        load_twell()


@torch.library.register_fake("sfl_twell::ffn")
def _ffn_fake(x, w_gate, w_up, w_down, stats, plan, config):
    _load_if_cuda()
    return torch.empty_like(x)


@torch.library.register_fake("sfl_twell::d2t")
def _d2t_fake(x, w_gate, slots, config):
    _load_if_cuda()
    M, T = x.numel() // x.shape[-1], w_gate.shape[0] // TILE_N
    return (x.new_empty(M, T, slots, dtype=torch.int32), x.new_empty(M, T, dtype=torch.int32),
            x.new_empty(M, dtype=torch.int32))


def _spec_value(cfg: KernelConfig, name: str) -> str:
    if name in ("crossover", "crossover_nongated"):  # as parsed: bucket starts ascending, bucket 1 present
        ms, ps = cfg.crossover_table(name == "crossover")
        return ",".join(f"{m}:{p!r}" for m, p in zip(ms, ps))
    value = getattr(cfg, name)
    return str(int(value)) if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)


def plan_spec(cfg: KernelConfig) -> str:
    """A KernelConfig as the op receives it: "name=value;..." for every field in OP_FIELDS (runtime.cpp:
    parse_config looks each up by name and refuses missing or unknown ones). Floats in repr, so exact."""
    return ";".join(f"{name}={_spec_value(cfg, name)}" for name in OP_FIELDS)


_IDS = itertools.count(1)


_RETIRED: list[int] = []   # plans whose handle died while the current stream captured a CUDA graph


def _free(plan_id: int) -> None:
    """Release a plan whose handle is gone, unless the current stream is capturing a CUDA graph: destroying a plan
    frees its pinned slot, and cudaFreeHost synchronises, which would invalidate the capture. Python's cyclic GC frees
    handles at any time, for instance while inductor records another model's compiled step; such a plan waits for the
    next free outside a capture."""
    ext = loaded("twell")
    if ext is None:
        return
    _RETIRED.append(plan_id)
    try:
        if torch.cuda.is_current_stream_capturing():
            return
    except RuntimeError:  # CUDA already shut down (a finalizer at exit): nothing is captured any more
        pass
    while _RETIRED:
        ext.plan_free(_RETIRED.pop())


@dataclass(eq=False)
class Plan:
    """A layer's handle on its C++ plan: the id the op is called with and the configuration it carries. Freed with
    the object. One plan per layer (its dispatch history is the layer's measured activity). shape: the layer's
    (K, N); with it, a crossover table left at its built-in value becomes the one measured for this GPU and shape
    where there is one (kernels/tables.py: the user's calibration, then the GPU's table of record)."""

    config: KernelConfig
    shape: tuple[int, int] | None = None
    id: int = 0
    spec: str = ""

    def __post_init__(self) -> None:
        if self.shape is not None:
            self.config = tables.for_current_gpu(self.config, *self.shape)
        self.id = next(_IDS)
        self.spec = plan_spec(self.config)
        weakref.finalize(self, _free, self.id)

    def info(self) -> dict:
        """The layer's dispatch state and its last call: p (measured activity), f (flagged-row fraction),
        measurements, sparse_calls, dense_calls, path ("dense" | "sparse" | "sparse-syncfree" at decode sizes),
        d2t ("fused" | "cublas" | "decode-fused" | "decode-rows"), flagged_rows (in the latest measurement that
        reached the host: a call's own once a later call has run after it completed), backup_cap (the last sparse
        call's dense backup block, rows), timings. Empty before the first call (and on a GPU without the kernels,
        where no call reaches them)."""
        ext = loaded("twell")
        return {} if ext is None else dict(ext.plan_info(self.id))

    def reset(self) -> None:
        """Forget the measured activity and timings (the next auto call starts as a first call)."""
        ext = loaded("twell")
        if ext is not None:  # not loaded: no call has made the C++ plan yet, there is nothing to forget
            ext.plan_reset(self.id)


def ffn(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, plan: Plan,
        stats: Tensor | None = None) -> Tensor:
    """One FFN call through the op (x [..., K] bf16 CUDA; weights in nn.Linear layouts). On a GPU without the
    kernels (kernels/device.py) the dense path, with one warning per GPU."""
    if dense_fallback(x.device):
        return dense_ffn(x, w_gate, w_up, w_down, stats)
    ensure_loaded()
    return torch.ops.sfl_twell.ffn(x, w_gate, w_up, w_down, stats, plan.id, plan.spec)


__all__ = ["Plan", "plan_spec", "OP_FIELDS", "TRAIN_PLAN_FIELDS", "ffn", "load", "ensure_loaded"]
