"""W_d's storage: the down projection kept neuron-major, so that no kernel transposes it per call.

Every sparse kernel reads W_d by neuron: an active neuron j adds h_j * W_d[:, j] to its row of y, and the
training backward's dW_d and dh walk neurons too. nn.Linear stores down_proj.weight as [K, N] row-major, so neuron
j's column is K elements N apart, and the ops made a neuron-major copy: the inference plan kept one per layer
(N x K bf16, 23 MB at the 1.5B shape), the training op transposed W_d twice per step and its gradient once.

Stored neuron-major, the parameter keeps nn.Linear's shape [K, N] (state dicts, HF checkpoints and F.linear see
the usual tensor) with strides (1, K): w_down.t() is then a contiguous [N, K] tensor, which the kernels read as
it is, and the training op returns dW_d in the same strides, which autograd accumulates without a copy. The
values are the same; only the order of the bytes in memory differs. Any other layout still works: the ops copy
it, as before.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def is_neuron_major(w_down: Tensor) -> bool:
    """True if the [K, N] tensor w_down is stored neuron-major (w_down.t() contiguous)."""
    return w_down.dim() == 2 and w_down.t().is_contiguous()


def keep_down_layout(w_down: Tensor) -> Tensor:
    """w_down as the kernels read it without a copy: itself when neuron-major, else contiguous [K, N]."""
    return w_down if is_neuron_major(w_down) else w_down.contiguous()


@torch.no_grad()
def set_down_layout_(linear: nn.Linear, neuron_major: bool = True) -> None:
    """Re-lay out linear.weight in place: neuron-major ([K, N] with strides (1, K)) or nn.Linear's row-major.
    The Parameter object stays the same (optimizers and hooks keep their references); only its storage changes.
    A weight already in the asked layout, or on the meta device, is left alone."""
    w = linear.weight
    if w.device.type == "meta" or w.dim() != 2 or is_neuron_major(w) == neuron_major:
        return
    w.data = w.data.t().contiguous().t() if neuron_major else w.data.contiguous()


__all__ = ["is_neuron_major", "keep_down_layout", "set_down_layout_"]
