"""nn.Modules around the TwELL kernels, state-dict compatible with HF LlamaMLP (gate_proj/up_proj/down_proj)."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn


class _TwELLBase(nn.Module):
    def __init__(self, mode: Literal["auto", "sparse", "dense"], activity_hint: float):
        super().__init__()
        self.mode = mode
        # auto dispatch learns each layer's activity by itself (kernels/README.md, Dispatch); this hint (expected
        # fraction of active neurons) is only a prior used until the first measurement of the layer lands
        self.activity_hint = activity_hint
        self.last_nnz_per_token: Tensor | None = None
        self._wdt: Tensor | None = None
        self._wdt_key: tuple | None = None

    def _down_t(self) -> Tensor:
        w = self.down_proj.weight
        key = (w.data_ptr(), w._version, w.device, w.dtype)
        if self._wdt is None or self._wdt_key != key:
            self._wdt = w.detach().t().contiguous()
            self._wdt_key = key
        return self._wdt

    @staticmethod
    def _check_linear(lin: nn.Linear, name: str) -> None:
        if lin.bias is not None:
            raise ValueError(f"{name} has a bias: the TwELL kernels implement bias-free MLPs (mlp_bias=False)")


class TwELLGatedMLP(_TwELLBase):
    """y = down(relu(gate(x)) * up(x)) through TwELL; exact on every input."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, mode: Literal["auto", "sparse", "dense"] = "auto",
                 activity_hint: float = 0.0, track_stats: bool = False, device=None, dtype=torch.bfloat16):
        super().__init__(mode, activity_hint)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.track_stats = track_stats

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
        from ..ffn import sparse_gated_ffn

        out = sparse_gated_ffn(x.contiguous(), self.gate_proj.weight.detach(), self.up_proj.weight.detach(),
                               self.down_proj.weight.detach(), return_stats=self.track_stats, mode=self.mode,
                               activity_hint=self.activity_hint, w_down_t=self._down_t())
        if self.track_stats:
            out, stats = out
            self.last_nnz_per_token = stats["nnz_per_token"]
        return out


class TwELLMLP(_TwELLBase):
    """Non-gated: y = down(relu(up(x))) through TwELL; exact on every input."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, mode: Literal["auto", "sparse", "dense"] = "auto",
                 activity_hint: float = 0.0, track_stats: bool = False, device=None, dtype=torch.bfloat16):
        super().__init__(mode, activity_hint)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.track_stats = track_stats

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
        from ..ffn import sparse_nongated_ffn

        out = sparse_nongated_ffn(x.contiguous(), self.up_proj.weight.detach(), self.down_proj.weight.detach(),
                                  return_stats=self.track_stats, mode=self.mode, activity_hint=self.activity_hint,
                                  w_down_t=self._down_t())
        if self.track_stats:
            out, stats = out
            self.last_nnz_per_token = stats["nnz_per_token"]
        return out
