"""mlp_impl="cuda": SparseLlamaMLP's forward through the TwELL kernels, registered in models/mlp_impls.py.

Without grad, inference through the one C++ op (kernels/twell/ops.py) on the layer's plan; with grad, training
through the hybrid-format op (kernels/train_ffn.py). The MLP module (models/modeling_sparse_llama.py) holds the
weights, the plan, the statistics and these paths' per-layer state (_train_state, _cast_cache); it is passed in
and read by duck typing, so the kernels do not import the models.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import train_ffn
from .layout import keep_down_layout
from .reference import in_backward
from .twell import ops


def cuda_forward(mlp: Any, x: Tensor, l1_mode: str | None) -> tuple[Tensor, Tensor | None]:
    """(y, L1 term): inference without grad (h never leaves the kernels: no L1 term), else training."""
    if not (torch.is_grad_enabled() and mlp.needs_grad(x)):
        return _inference(mlp, x), None  # the op takes [..., K] as it is
    x2 = x.reshape(-1, x.shape[-1])
    # under torch.compile the training forward runs eagerly (a graph break around each MLP): its dispatch reads the
    # layer's measured history (activity, widest row, backup fraction: host values that change every step), on
    # which a traced region would specialise and recompile each step until dynamo's recompile limit sent the whole
    # frame to eager; outside compile the plain function runs (no wrapper on the hot path)
    fwd = _train_eager if torch.compiler.is_compiling() else _train
    y, l1 = fwd(mlp, x2, l1_mode)
    return y.reshape(*x.shape[:-1], y.shape[-1]), l1


def _inference(mlp: Any, x: Tensor) -> Tensor:
    """Dispatch, kernels, exact backup and the statistics all happen in the op (which loads the kernels, or takes
    the dense path on a GPU without them)."""
    wg, wu, wd = inference_weights(mlp)
    if x.dtype != wu.dtype:  # the residual stream may be wider than the kernels' bf16 (autocast evaluation)
        x = x.to(wu.dtype)
    # Inductor cannot lower the op with its optional mutable argument left out (seen with torch 2.11: "getitem is
    # not an OpOverload"), so a compiled model always passes the buffer: statistics stay on while compiled
    track = mlp.config.track_sparsity_stats or torch.compiler.is_compiling()
    return ops.ffn(x, wg, wu, wd, mlp.plan, mlp.nnz_stats if track else None)


def inference_weights(mlp: Any) -> tuple[Tensor | None, Tensor, Tensor]:
    """The weights in the dtype the inference kernels run in: bf16 under CUDA autocast (fp32 master weights during
    training-time evaluation), else as stored. Casts are cached per weight version (mlp._cast_cache), so the
    kernels' per-weight caches (transposed w_down, dispatch history) see stable tensors."""
    ws = mlp.weights()
    dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else ws[1].dtype
    if all(w is None or w.dtype == dt for w in ws):
        return ws
    key = (dt,) + tuple(None if w is None else (w.data_ptr(), w._version) for w in ws)
    cache = mlp._cast_cache
    if cache is None or cache[0] != key:
        with torch.no_grad():  # W_d keeps a neuron-major layout through the cast (kernels/layout.py)
            wg, wu, wd = (None if w is None else w.detach().to(dt) for w in ws)
            cache = (key, (None if wg is None else wg.contiguous(), wu.contiguous(), keep_down_layout(wd)))
        mlp._cast_cache = cache
    return cache[1]


def _train(mlp: Any, x2: Tensor, l1_mode: str | None) -> tuple[Tensor, Tensor | None]:
    """Training through the hybrid-format op of kernels/train_ffn.py: exact y, L1 and gradients."""
    if mlp.config.mlp_bias:
        raise ValueError("mlp_impl='cuda' training supports mlp_bias=False only; use mlp_impl='dense'")
    if mlp._train_state is None:
        mlp._train_state = train_ffn.DispatchState()  # this layer's measured-activity history
    wg, wu, wd = mlp.weights()
    recompute = in_backward()  # activation checkpointing: statistics were taken in the first forward
    kc = mlp.kernel_config  # config.get_kernel_config(), taken once per plan (refresh_plan), not per call
    kw = dict(l1_reduction=mlp.config.l1_reduction, state=mlp._train_state, mode=kc.train_mode, config=kc,
              want_last_active=mlp.training and not recompute)
    if wg is not None:
        y, l1, st = train_ffn.sparse_gated_ffn_train(x2, wg, wu, wd, **kw)
    else:
        y, l1, st = train_ffn.sparse_nongated_ffn_train(x2, wu, wd, **kw)
    mlp.record(st["nnz_per_token"].float(), None)
    if mlp.training and not recompute:
        train_ffn.update_tokens_since_fire_sparse(mlp.tokens_since_fire, st["last_active_row"], x2.shape[0])
    return y, (None if l1_mode is None else l1 if l1_mode == "grad" else l1.detach())


_train_eager = torch.compiler.disable(_train)

__all__ = ["cuda_forward", "inference_weights"]
