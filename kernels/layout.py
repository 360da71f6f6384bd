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

FSDP2 (and DCP's resharding) only take contiguous parameters. For them the trainer swaps each neuron-major down_proj
for a NeuronMajorLinear: the same bytes as one contiguous [N, K] parameter `weight_t` (FSDP2 then shards neurons),
with `weight` its [K, N] view, so the kernels still read W_d without a copy. Its state dict shows nn.Linear's
`weight` [K, N], so checkpoints, save_pretrained and load_state_dict see the usual key and shape.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
    if not isinstance(linear, nn.Linear):  # a NeuronMajorLinear: neuron-major by construction
        return
    w = linear.weight
    if w.device.type == "meta" or w.dim() != 2 or is_neuron_major(w) == neuron_major:
        return
    w.data = w.data.t().contiguous().t() if neuron_major else w.data.contiguous()


class NeuronMajorLinear(nn.Module):
    """An nn.Linear whose weight is stored as its own contiguous transpose: the parameter `weight_t` [in, out], and
    `weight` = weight_t.t() [out, in] (a view, neuron-major for a down projection). The state dict holds `weight`
    in nn.Linear's key and shape; loading one converts back."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight
        # shares linear's storage when it is neuron-major (w.t() is then contiguous): no copy
        self.weight_t = nn.Parameter(w.data.t().contiguous(), requires_grad=w.requires_grad)
        self.bias = linear.bias
        self.register_state_dict_post_hook(_weight_as_linear)
        self.register_load_state_dict_pre_hook(_weight_from_linear)

    @property
    def weight(self) -> Tensor:
        return self.weight_t.t()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _weight_as_linear(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    key = prefix + "weight_t"
    if key in state_dict:
        state_dict[prefix + "weight"] = state_dict.pop(key).t()


def _weight_from_linear(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[prefix + "weight_t"] = state_dict.pop(key).t()


def make_down_shardable_(mlps: list[nn.Module]) -> int:
    """Swap every neuron-major down_proj of `mlps` for a NeuronMajorLinear over the same bytes (before fully_shard
    and before the optimizer is built: the parameter object changes). Returns how many were swapped."""
    swapped = 0
    for mlp in mlps:
        down = mlp.down_proj
        if isinstance(down, nn.Linear) and down.weight.device.type != "meta" and is_neuron_major(down.weight):
            mlp.down_proj = NeuronMajorLinear(down)
            swapped += 1
    return swapped


__all__ = ["is_neuron_major", "keep_down_layout", "set_down_layout_", "NeuronMajorLinear", "make_down_shardable_"]
