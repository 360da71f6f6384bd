"""Public entry points of the TwELL inference kernels: functions and nn.Modules.

    y = sparse_gated_ffn(x, w_gate, w_up, w_down)                  # (relu(x Wg^T) * (x Wu^T)) Wd^T
    y = sparse_nongated_ffn(x, w_up, w_down)                       # relu(x Wu^T) Wd^T
    y = sparse_gated_ffn(x, wg, wu, wd, config=KernelConfig(mode="sparse"))
    y = sparse_gated_ffn(x, wg, wu, wd, mode="dense")              # plain torch: three F.linear, any device
    mlp = TwELLGatedMLP.from_linears(gate_proj, up_proj, down_proj)  # state-dict compatible with HF LlamaMLP

Weights in nn.Linear layouts: w_gate/w_up [N, K], w_down [K, N]; x [..., K] bf16 on CUDA (copied if it is not
contiguous or not 16-byte aligned). Exact on every input: rows that overflow the TwELL slots or have a non-finite
gate are computed by dense GEMMs. Each call is one C++ op (kernels/twell/ops.py, runtime.cpp) whose per-layer plan
keeps the layer's measured activity for dispatch. On CPU, or without nvcc, a KernelUnavailableError names the
pure-PyTorch reference (kernels.reference). On a CUDA GPU that is not sm_90 (not Hopper: the kernels use sm_90a
instructions) every call takes the dense path, the same results, with one warning saying why (kernels/device.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import KernelConfig
from .device import dense_ffn
from .layout import set_down_layout_
from .loader import REFERENCE_HINT, KernelUnavailableError
from .twell import ops

_DEFAULT = KernelConfig()
_PLANS: OrderedDict[tuple, ops.Plan] = OrderedDict()
_PLANS_MAX = 4096


def plan_for(w: Tensor, config: KernelConfig, gated: bool, mode: str | None = None) -> ops.Plan:
    """The functional API's plan for a layer, keyed by its gate weight's storage (non-gated: the up weight), the
    config and the mode that overrides it: callers pass fresh .detach() views, which share the storage. A weight
    allocated where a freed one lived has a new storage object, so it never inherits another layer's measurements.
    The mode is its own key part, so that a forced call builds its config once, not per call (a replace costs tens
    of microseconds of host time, most of a decode-size call)."""
    key = (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape), gated, config, mode)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.popitem(last=False)
        cfg = config if mode is None or mode == config.mode else config.replace(mode=mode)
        plan = _PLANS[key] = ops.Plan(cfg, shape=(w.shape[1], w.shape[0]))
    return plan


def _inference_only(*ts: Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts):
        # no backward here: refuse rather than return a result whose gradients are silently missing
        raise ValueError("kernels.ffn is inference-only (no backward): call it under torch.no_grad() / "
                         "torch.inference_mode() or pass detached tensors; to train, use "
                         "sfl.kernels.train_ffn.sparse_gated_ffn_train / sparse_nongated_ffn_train")


def _call(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, config: KernelConfig | None,
          mode: str | None, plan: ops.Plan | None, stats: Tensor | None) -> Tensor:
    if plan is None and stats is None and (mode or (config or _DEFAULT).mode) == "dense":
        # an explicit dense request costs the dense path only: no plan, no dispatch, no op call (and, being plain
        # torch ops, it is differentiable)
        return dense_ffn(x, w_gate, w_up, w_down)
    _inference_only(x, w_gate, w_up, w_down)
    if x.device.type != "cuda":
        raise KernelUnavailableError(f"x is on {x.device}: the TwELL kernels run on CUDA tensors only; move the "
                                     f"inputs with .cuda(), or use {REFERENCE_HINT}")
    if plan is None:
        plan = plan_for(w_gate if w_gate is not None else w_up, config or _DEFAULT, w_gate is not None, mode)
    return ops.ffn(x, w_gate, w_up, w_down, plan, stats)  # on a GPU without the kernels: the dense path, warned


def sparse_gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *, config: KernelConfig | None = None,
                     mode: Literal["auto", "sparse", "dense"] | None = None, plan: ops.Plan | None = None,
                     stats: Tensor | None = None) -> Tensor:
    """y = (relu(x w_gate^T) * (x w_up^T)) w_down^T through TwELL; exact (overflow rows go dense).

    config: a KernelConfig (default: the measured defaults); mode overrides config.mode. plan: this layer's Plan
    (default: one per gate weight and config). stats: an int64 [3] CUDA tensor to accumulate (sum of non-zeros,
    largest per-token count, tokens) into. Dense (mode or config.mode "dense") without plan and stats runs
    device.dense_ffn: HF's plain torch ops, on any device."""
    return _call(x, w_gate, w_up, w_down, config, mode, plan, stats)


def sparse_nongated_ffn(x: Tensor, w_up: Tensor, w_down: Tensor, *, config: KernelConfig | None = None,
                        mode: Literal["auto", "sparse", "dense"] | None = None, plan: ops.Plan | None = None,
                        stats: Tensor | None = None) -> Tensor:
    """y = relu(x w_up^T) w_down^T through TwELL; exact (overflow rows go dense). Arguments as sparse_gated_ffn."""
    return _call(x, None, w_up, w_down, config, mode, plan, stats)


def twell_d2t(x: Tensor, w_gate: Tensor, slots: int = 32, *, config: KernelConfig | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """TwELL of relu(x w_gate^T): (packed int32 [M, T, slots], counts int32 [M, T], flag int32 [M])."""
    if not 1 <= slots <= 256:
        raise ValueError(f"slots must be in 1..256, got {slots}")
    if x.device.type != "cuda":
        raise KernelUnavailableError(f"x is on {x.device}: twell_d2t runs on CUDA; use kernels.reference.d2t")
    cfg = config or _DEFAULT
    ops.load()
    return torch.ops.sfl_twell.d2t(x, w_gate, slots, ops.plan_spec(cfg))


# ------------------------------------------------------------------------------------------------ modules
class _TwELLBase(nn.Module):
    def __init__(self, config: KernelConfig | None, track_stats: bool, shape: tuple[int, int], device=None) -> None:
        super().__init__()
        self.plan = ops.Plan(config or _DEFAULT, shape=shape)  # shape (K, N): the GPU's measured tables
        # non-zeros summed over tokens, the largest per-token count, tokens: accumulated on the device by the op
        self.register_buffer("nnz_stats", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)
        self.track_stats = track_stats

    @property
    def config(self) -> KernelConfig:
        return self.plan.config

    @staticmethod
    def _check_linear(lin: nn.Linear, name: str) -> None:
        if lin.bias is not None:
            raise ValueError(f"{name} has a bias: the TwELL kernels implement bias-free MLPs (mlp_bias=False)")

    def _run(self, x: Tensor, w_gate: Tensor | None) -> Tensor:
        # an inference module: its parameters may require grad (nn.Linear's default); only x is checked, as before
        _inference_only(x)
        return ops.ffn(x, w_gate, self.up_proj.weight, self.down_proj.weight, self.plan,
                       self.nnz_stats if self.track_stats else None)


class TwELLGatedMLP(_TwELLBase):
    """y = down(relu(gate(x)) * up(x)) through TwELL; exact on every input. Inference only."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, config: KernelConfig | None = None,
                 track_stats: bool = False, device=None, dtype=torch.bfloat16) -> None:
        super().__init__(config, track_stats, (hidden_size, intermediate_size), device)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        set_down_layout_(self.down_proj)  # neuron-major: the plan reads W_d as it is, no copy kept (kernels/layout.py)

    @classmethod
    def from_linears(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, **kw) -> "TwELLGatedMLP":
        for lin, n in ((gate, "gate"), (up, "up"), (down, "down")):
            cls._check_linear(lin, n)
        m = cls(gate.in_features, gate.out_features, device=gate.weight.device, dtype=gate.weight.dtype, **kw)
        with torch.no_grad():
            m.gate_proj.weight.copy_(gate.weight)
            m.up_proj.weight.copy_(up.weight)
            m.down_proj.weight.copy_(down.weight)
        return m

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x, self.gate_proj.weight)


class TwELLMLP(_TwELLBase):
    """Non-gated: y = down(relu(up(x))) through TwELL; exact on every input. Inference only."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, config: KernelConfig | None = None,
                 track_stats: bool = False, device=None, dtype=torch.bfloat16) -> None:
        super().__init__(config, track_stats, (hidden_size, intermediate_size), device)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        set_down_layout_(self.down_proj)  # neuron-major: the plan reads W_d as it is, no copy kept (kernels/layout.py)

    @classmethod
    def from_linears(cls, up: nn.Linear, down: nn.Linear, **kw) -> "TwELLMLP":
        for lin, n in ((up, "up"), (down, "down")):
            cls._check_linear(lin, n)
        m = cls(up.in_features, up.out_features, device=up.weight.device, dtype=up.weight.dtype, **kw)
        with torch.no_grad():
            m.up_proj.weight.copy_(up.weight)
            m.down_proj.weight.copy_(down.weight)
        return m

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x, None)


__all__ = ["sparse_gated_ffn", "sparse_nongated_ffn", "dense_ffn", "twell_d2t", "plan_for", "TwELLGatedMLP", "TwELLMLP",
           "KernelConfig", "KernelUnavailableError"]
