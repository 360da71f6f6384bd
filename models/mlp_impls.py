"""The implementations of SparseLlamaMLP's forward, keyed by config.mlp_impl, as transformers keys attention
implementations (ALL_ATTENTION_FUNCTIONS): the module looks its implementation up here and only computes.

Each entry is a function (mlp, x [..., K], l1_mode) -> (y [..., K], L1 term or None) and handles torch.compile
itself. "dense" and "reference" live here and need only torch: this file travels with a checkpoint (transformers'
custom code), beside a copy of the pure-PyTorch reference. "cuda" lives with its ops in the kernels
(kernels/sparse_llama_mlp.py) and is registered when the installed project is importable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from .sparsity import nnz_per_token

try:  # the installed project: its kernels, the CUDA entry among them
    from sfl.kernels.reference import gated_ffn_twell, in_backward, nongated_ffn_twell
    from sfl.kernels.sparse_llama_mlp import cuda_forward
except ModuleNotFoundError as e:  # a checkpoint's copy of this file, without the project: the reference beside it
    if e.name != "sfl":
        raise
    from .twell_reference import gated_ffn_twell, in_backward, nongated_ffn_twell
    cuda_forward = None

if TYPE_CHECKING:
    from .modeling_sparse_llama import SparseLlamaMLP

MLPForward = Callable[["SparseLlamaMLP", torch.Tensor, "str | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


def dense_forward(mlp: "SparseLlamaMLP", x: torch.Tensor, l1_mode: str | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Three F.linear; with statistics (the default) the activity is counted and L1 taken on h."""
    x2 = x.reshape(-1, x.shape[-1])
    if l1_mode is None and not mlp.config.track_sparsity_stats:
        # uninstrumented: exactly HF LlamaMLP's ops (the paper's dense baseline); no counts, no dead tracker
        y = F.linear(mlp.activation(x2)[1], mlp.down_proj.weight, mlp.down_proj.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1]), None
    a, h = mlp.activation(x2)
    y = F.linear(h, mlp.down_proj.weight, mlp.down_proj.bias)
    l1 = mlp.l1_term(h, l1_mode)
    mlp.record(nnz_per_token(a), a != 0)
    return y.reshape(*x.shape[:-1], y.shape[-1]), l1


@torch.library.custom_op("sfl_reference::twell_ffn", mutates_args=())
def _reference_twell_ffn(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor,
                         tile_n: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference TwELL FFN as one opaque op, for torch.compile: its data-dependent shapes (nonzero, sparse
    CSR products, overflow rows) cannot be traced, so a compiled model calls it whole. (y [M, K_out], int32 [M]
    non-zeros per token); the same Python function as the eager path, so the same results."""
    return _reference_ffn(x, w_gate, w_up, w_down, tile_n, slots)


@_reference_twell_ffn.register_fake
def _(x, w_gate, w_up, w_down, tile_n, slots):
    m = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], w_down.shape[0]), x.new_empty(m, dtype=torch.int32)


def _reference_ffn(x2, w_gate, w_up, w_down, tile_n: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w_gate is not None:
        y, st = gated_ffn_twell(x2, w_gate, w_up, w_down, tile_n=tile_n, slots=slots, return_stats=True)
    else:
        y, st = nongated_ffn_twell(x2, w_up, w_down, tile_n=tile_n, slots=slots, return_stats=True)
    return y, st["nnz_per_token"]


def reference_forward(mlp: "SparseLlamaMLP", x: torch.Tensor, l1_mode: str | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pure-PyTorch TwELL path (kernels/reference.py) with the layer's KernelConfig tile_n and slots."""
    x2 = x.reshape(-1, x.shape[-1])
    wg, wu, wd = mlp.weights()
    kc = mlp.kernel_config
    if torch.compiler.is_compiling() and not (torch.is_grad_enabled() and mlp.needs_grad(x2)):
        y, nnz = _reference_twell_ffn(x2, wg, wu, wd, kc.tile_n, kc.slots)  # opaque to the compiler (no backward)
    else:
        y, nnz = _reference_ffn(x2, wg, wu, wd, kc.tile_n, kc.slots)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    # Activity and L1 come from a dense recomputation of a and h when L1 or training needs them: the TwELL
    # path stores values in bf16 and does not return h, while statistics must be exact and L1 differentiable.
    if l1_mode is not None or mlp.training:
        a, h = mlp.activation(x2)
        mlp.record(nnz_per_token(a), a != 0)
        return y, mlp.l1_term(h, l1_mode)
    mlp.record(nnz.float(), None)
    return y, None


ALL_MLP_FUNCTIONS: dict[str, MLPForward] = {"dense": dense_forward, "reference": reference_forward}
if cuda_forward is not None:
    ALL_MLP_FUNCTIONS["cuda"] = cuda_forward


def mlp_function(impl: str) -> MLPForward:
    """The forward registered for mlp_impl `impl` (a one-line error naming what to install when it is missing)."""
    fn = ALL_MLP_FUNCTIONS.get(impl)
    if fn is None:
        raise ValueError(f"mlp_impl={impl!r} is not available here (registered: {sorted(ALL_MLP_FUNCTIONS)}): "
                         "mlp_impl='cuda' needs the installed project (pip install -e .); else use 'dense'")
    return fn


__all__ = ["ALL_MLP_FUNCTIONS", "MLPForward", "dense_forward", "reference_forward", "mlp_function", "in_backward"]
