"""Differentiable sparse ReLU FFN block with fused L1, for training.

    y, l1, stats = sparse_gated_ffn_train(x, w_gate, w_up, w_down, l1_reduction="mean", state=st)
    y, l1, stats = sparse_nongated_ffn_train(x, w_up, w_down, l1_reduction="mean", state=st)

- y = (relu(x W_g^T) * (x W_u^T)) W_d^T (non-gated: relu(x W_u^T) W_d^T), x [..., K], weights in nn.Linear
  layouts (w_gate/w_up [N, K], w_down [K, N]).
- l1 = the layer's L1 term exactly as models.sparsity.l1_penalty(h, l1_reduction) with h the tensor fed to
  down_proj: "mean" = sum |h| / (M N), "sum" = sum |h| / M. 0-dim fp32, differentiable.
- Both are differentiable w.r.t. x and every weight; gradients are exact (no dropped rows, ever).
- stats: {"path": "sparse" | "dense", "nnz_per_token": int32 [M] (detached), "backup_rows": rows kept dense (a
  0-dim device tensor on the cuda backend: reading it is a host sync; an int on torch), "width": ELL width kept,
  "kept_bytes": bytes saved for backward by the block (sparse path)}.
  With want_last_active=True also "last_active_row": int64 [N] (last token row where each neuron fired, -1 if
  none; feed it to update_tokens_since_fire_sparse).

Autocast: under torch.autocast("cuda", dtype=bf16) the inputs are cast (differentiably) to the autocast dtype,
as F.linear would do, so fp32 master weights receive fp32 gradients.

Dispatch (mode="auto"): a per-layer DispatchState is a handle on a plan of the inference op's engine (the C++ plan
of kernels/twell/runtime.cpp), which keeps the activity measured in the previous calls (sync-free: read from pinned
host memory once their event has completed) and picks the sparse path only where it was measured faster: activity
<= config.train_dense_above and backup-row fraction <= config.train_backup_dense_above (a KernelConfig,
kernels/config.py); it also sets the sparse call's ELL width and backup block. The first call of a layer goes dense
(and measures). Settings: kernels/train/README.md. On a CUDA GPU that is not sm_90 (kernels/device.py) every call takes the
dense path, whatever mode says, with one warning (backend="cuda" is refused there, naming the reason).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import KernelConfig
from .device import dense_fallback, kernels_supported
from .layout import is_neuron_major, keep_down_layout
from .loader import KernelUnavailableError, load_twell
from .reference import _acc_dtype, check_ffn_layouts, in_backward
from .train import ops as _ops
from .twell import ops as twell_ops

_DEFAULT_CONFIG = KernelConfig()

_L1_REDUCTIONS = ("mean", "sum")


class DispatchState:
    """A layer's handle on its dispatch plan, the C++ plan that serves the inference op too (kernels/twell/runtime.cpp:
    train_decide, train_measure): the measured history and the decisions live there, one engine for both ops. Keep
    one per FFN module. The plan is made on the layer's first call on the "cuda" backend, for that call's config (a
    new config starts a new history); the "torch" backend and GPUs without the kernels keep no history."""

    def __init__(self) -> None:
        self.plan: twell_ops.Plan | None = None
        self.gated: bool | None = None
        self.last_path: str | None = None       # what the layer's last call ran, for logs and tests
        self.last_forward_path: str | None = None   # the same for its last call outside backward
        self.last_kept_bytes: int | None = None   # bytes the sparse path's last forward saved for backward
        self.last_backup_rows: Tensor | int | None = None  # rows its last forward kept dense (device count on cuda)

    def decide(self, cfg: KernelConfig, gated: bool, mode: str, m: int, width: int) -> tuple[bool, int, int]:
        """(sparse, ELL width, backup block rows) of the layer's next call on the "cuda" backend, from the history
        (runtime.cpp: train_decide; never waits for the GPU)."""
        plan = self.plan
        if plan is None or self.gated != gated or (plan.config is not cfg and plan.config != cfg):
            plan = self.plan = twell_ops.Plan(cfg)
            self.gated = gated
        return load_twell().train_decide(plan.id, plan.spec, gated, _MODES[mode], m, width, in_backward())

    def measure(self, stats: Tensor, rows: int, n_cols: int, light_at: int = 0, flagged_at: int = 1,
                widest_at: int = -1) -> None:
        """A call's measurement into the plan (int64 stats on the device, or the sparse op's pinned summary): taken
        unless one is in flight, or a CUDA graph is being captured (runtime.cpp: train_measure). No plan (no call on
        the "cuda" backend yet): nothing is kept."""
        if self.plan is not None and rows > 0:
            load_twell().train_measure(self.plan.id, self.plan.spec, self.gated, stats, rows, n_cols, light_at,
                                       flagged_at, widest_at)

    def record(self, nnz: Tensor, n_cols: int, width: int) -> None:
        """The measurement from per-row counts (the dense path without its fused kernel): light rows' non-zeros,
        heavy rows, the widest light row."""
        if self.plan is None or nnz.numel() == 0 or not nnz.is_cuda:
            return
        light = nnz <= width
        light_nnz = torch.where(light, nnz, 0)
        self.measure(torch.stack([light_nnz.sum(dtype=torch.int64), (~light).sum(dtype=torch.int64),
                                  light_nnz.max().to(torch.int64)]), nnz.numel(), n_cols, 0, 1, 2)

    def info(self) -> dict[str, Any]:
        """The plan's state (twell_ops.Plan.info) with every measurement that has landed: p (activity of the light
        rows), f (heavy-row fraction), widest_light, measurements, ...; empty before the first "cuda" call."""
        if self.plan is None:
            return {}
        load_twell().plan_poll(self.plan.id)
        return self.plan.info()

    @property
    def activity(self) -> float | None:
        """Mean active fraction of the light rows in the last measurement that reached the host."""
        return self.info().get("p")

    @property
    def backup_frac(self) -> float | None:
        """Fraction of heavy rows (nnz above the width, or non-finite) in that measurement."""
        info = self.info()
        return None if info.get("p") is None else info["f"]

    @property
    def widest_light(self) -> int | None:
        return self.info().get("widest_light")


_MODES = {"auto": 0, "sparse": 1, "dense": 2}   # runtime.cpp's Mode


def _state_for(key: Tensor) -> DispatchState:
    """Default per-layer state: stored on the caller's w_up tensor (a Parameter lives as long as its layer)."""
    st = getattr(key, "_sfl_train_state", None)
    if st is None:
        st = DispatchState()
        key._sfl_train_state = st
    return st


class _SparseFFN(torch.autograd.Function):
    """The training op under autograd: kernels/train/ops.py's ffn_fwd and ffn_bwd, the registered C++ ops on the
    "cuda" backend (one dispatcher call per half, traced by torch.compile through their fakes), the reference on
    "torch"."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last, dw_nb,
                backend):
        out = _ops.ffn_fwd(x, w_gate, w_up, w_down, width, measure_width, scale, chunk_rows, backup_cap, want_last,
                           backend)
        y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last = out
        ctx.save_for_backward(x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host)
        ctx.scale, ctx.dw_nb, ctx.backup_cap, ctx.backend = scale, dw_nb, backup_cap, backend
        ctx.mark_non_differentiable(ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, gy, gl1, *_):
        x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(x)
        if gl1 is None:
            gl1 = torch.zeros((), device=x.device, dtype=torch.float32)
        dx, dwg, dwu, dwd = _ops.ffn_bwd(gy, gl1, x, w_gate, w_up, w_down, ell_col, ell_a, ell_u, nnz, flag,
                                         backup_rows, backup, host, ctx.scale, ctx.dw_nb, ctx.backup_cap, ctx.backend)
        return dx, (dwg if w_gate is not None else None), dwu, dwd, None, None, None, None, None, None, None, None


def _check(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, l1_reduction: str) -> None:
    for name, t in (("x", x), ("w_up", w_up), ("w_down", w_down)) + ((("w_gate", w_gate),) if w_gate is not None
                                                                     else ()):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    check_ffn_layouts(x, w_gate, w_up, w_down)
    devs = {t.device for t in (x, w_up, w_down) + ((w_gate,) if w_gate is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"x and all weights must be on one device, got {sorted(map(str, devs))}")
    if l1_reduction not in _L1_REDUCTIONS:
        raise ValueError(f"l1_reduction must be one of {_L1_REDUCTIONS}, got {l1_reduction!r}")


def _count_rows(a: Tensor) -> Tensor:
    """int32 per-row count of a != 0: our 16-byte-load kernel on bf16 CUDA (torch's (a != 0).sum(1) measured
    0.49 ms on [16384, 5632], ~375 GB/s), torch elsewhere."""
    if (a.is_cuda and a.dtype == torch.bfloat16 and a.shape[1] % 8 == 0 and a.stride(1) == 1 and a.stride(0) % 8 == 0
            and kernels_supported(a.device)[0]):
        try:
            return _ops.load_ext().count(a)
        except KernelUnavailableError:  # no extension here: the torch count is exact too, only slower
            pass
    return (a != 0).sum(1, dtype=torch.int32)


class _FusedDenseFFN(torch.autograd.Function):
    """The dense path with fused elementwise kernels: the same cuBLAS GEMMs as dense autograd, but relu(g) * u,
    |h| summed for the L1 term and the activity measurement in one forward pass (kernels/twell relu_mul_stats),
    and dh + L1 term -> dg, du in one backward pass (kernels/train dense_bwd). Saves g, u, h (dense autograd
    saves relu(g), u, h: the same bytes). Returns (y, l1, rownnz, stats, last_active); the last three are
    measurements (not differentiable)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, scale, row_cap, want_stats, want_last_active):
        tw = load_twell()
        gated = w_gate is not None
        M, N = x.shape[0], w_up.shape[0]
        g = torch.mm(x, (w_gate if gated else w_up).t())
        u = torch.mm(x, w_up.t()) if gated else None
        h = torch.empty_like(g) if gated else g   # non-gated: relu in place (a = h, g is not needed after)
        rownnz = torch.empty(M if want_stats else 0, device=x.device, dtype=torch.int32)
        stats = torch.zeros(2, device=x.device, dtype=torch.int64)
        part = torch.empty(M, device=x.device, dtype=torch.float32)   # per-row sum |h|: a deterministic L1
        last = _last_active_rows(g) if want_last_active else torch.empty(0, device=x.device, dtype=torch.int64)
        tw.relu_mul_stats(g, u if gated else x.new_empty(0), h, N, 256, row_cap, rownnz, stats, part)
        y = torch.mm(h, w_down.t())
        l1 = part.sum() * scale
        ctx.save_for_backward(x, w_gate, w_up, w_down, g if gated else None, u, h)
        ctx.scale = scale
        ctx.mark_non_differentiable(rownnz, stats, last)
        return y, l1, rownnz, stats, last

    @staticmethod
    def backward(ctx, gy, gl1, *_):
        x, w_gate, w_up, w_down, g, u, h = ctx.saved_tensors
        gated = w_gate is not None
        gy = gy.to(h.dtype).contiguous()
        dg = torch.mm(gy, w_down)   # dh; becomes dg in place
        du = torch.empty_like(dg) if gated else dg.new_empty(0)
        gl1 = (gl1 if gl1 is not None else torch.zeros((), device=gy.device)).float().reshape(1).contiguous()
        _ops.load_ext().dense_bwd(dg, g if gated else h, u if gated else dg.new_empty(0), h, du, gl1, ctx.scale)
        need = ctx.needs_input_grad
        dx = dwg = dwu = dwd = None
        if need[0]:
            dx = torch.mm(dg, w_gate if gated else w_up)
            if gated:
                dx.addmm_(du, w_up)
        if gated and need[1]:
            dwg = torch.mm(dg.t(), x)
        if need[2]:
            dwu = torch.mm((du if gated else dg).t(), x)
        if need[3]:  # in w_down's strides, so that autograd accumulates it without a copy (kernels/layout.py)
            dwd = torch.mm(h.t(), gy).t() if is_neuron_major(w_down) else torch.mm(gy.t(), h)
        return dx, dwg, dwu, dwd, None, None, None, None


def _fused_dense_ok(x2: Tensor, backend: str, cfg: KernelConfig, N: int) -> bool:
    """The fused dense path takes bf16 CUDA inputs with N % 256 == 0 when both extensions load (eager only)."""
    if not cfg.train_fused_dense or backend != "cuda" or x2.dtype != torch.bfloat16 or N % 256 != 0 or x2.shape[0] == 0:
        return False
    if torch.compiler.is_compiling():  # plain torch ops trace cleanly, and inductor fuses the elementwise part itself
        return False
    try:
        load_twell()
        _ops.load_ext()
    except KernelUnavailableError:
        return False
    return True


def _dense(x2, w_gate, w_up, w_down, scale, want_last_active, want_stats, st, cfg, M, N, backend="torch"):
    """Dense path: the fused function above where it applies, else plain dense autograd (the same ops as
    models' dense MLP); both measure activity for dispatch."""
    if _fused_dense_ok(x2, backend, cfg, N):
        ws = [w.contiguous() if w is not None else None for w in (w_gate, w_up)]
        y, l1, nnz, dstats, last = _FusedDenseFFN.apply(x2.contiguous(), ws[0], ws[1], keep_down_layout(w_down),
                                                        scale, cfg.train_width, want_stats, want_last_active)
        st.measure(dstats, M, N)
        stats = {"path": "dense", "nnz_per_token": nnz if want_stats else None, "backup_rows": None,
                 "width": None, "kept_bytes": None}
        if want_last_active:
            stats["last_active_row"] = last
        return y, l1, stats
    a = F.relu(F.linear(x2, w_gate if w_gate is not None else w_up))
    h = a * F.linear(x2, w_up) if w_gate is not None else a
    y = F.linear(h, w_down)
    l1 = h.abs().sum(dtype=_acc_dtype(h.dtype)) * scale
    with torch.no_grad():
        if want_stats:  # per-token counts (what models' dense MLP logs); NaN != 0 counts as active
            nnz = _count_rows(a)
            st.record(nnz, N, cfg.train_width)
        else:  # dispatch only needs an estimate: count a row sample (cheap next to the GEMMs)
            nnz = None
            st.record(_count_rows(a[: cfg.train_probe_rows]), N, cfg.train_width)
        stats = {"path": "dense", "nnz_per_token": nnz, "backup_rows": None, "width": None, "kept_bytes": None}
        if want_last_active:
            stats["last_active_row"] = _last_active_rows(a)
    return y, l1, stats


def _last_active_dense(active: Tensor) -> Tensor:
    m = active.shape[0]
    fired = active.any(0)
    last = m - 1 - active.flip(0).to(torch.uint8).argmax(0).to(torch.int64)
    return torch.where(fired, last, torch.full_like(last, -1))


def _last_active_rows(a: Tensor) -> Tensor:
    """int64 [N]: the last row where each column of a [M, N] (a pre-activation g or a = relu(g)) is relu-active
    (> 0 or NaN), -1 if none: our column-scan kernel on bf16 CUDA (one read of a at most), else torch's mask."""
    if (a.is_cuda and a.dtype == torch.bfloat16 and a.shape[1] % 8 == 0 and a.stride(1) == 1 and a.stride(0) % 8 == 0
            and a.data_ptr() % 16 == 0 and kernels_supported(a.device)[0]):
        try:
            return _ops.load_ext().last_active(a)
        except KernelUnavailableError:  # no extension here: the torch mask is exact too
            pass
    return _last_active_dense((a > 0) | torch.isnan(a))


def update_tokens_since_fire_sparse(tokens_since_fire: Tensor, last_active_row: Tensor, n_tokens: int) -> None:
    """Same update as models.sparsity.update_tokens_since_fire, from stats['last_active_row'] (no [M, N] mask)."""
    with torch.no_grad():
        since = (n_tokens - 1 - last_active_row).to(tokens_since_fire.dtype)
        tokens_since_fire.copy_(torch.where(last_active_row >= 0, since, tokens_since_fire + n_tokens))


def _run(x, w_gate, w_up, w_down, l1_reduction, mode, state, width, backend, want_last_active, want_stats, config):
    _check(x, w_gate, w_up, w_down, l1_reduction)
    if mode not in ("auto", "sparse", "dense"):
        raise ValueError(f"mode must be 'auto', 'sparse' or 'dense', got {mode!r}")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig (sfl.kernels.config), got {type(config).__name__}")
    cfg = config if config is not None else _DEFAULT_CONFIG
    width = int(width if width is not None else cfg.train_width)
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    st = state if state is not None else _state_for(w_up)
    dev_type = x.device.type
    lead = x.shape[:-1]
    K, N = x.shape[-1], w_up.shape[0]
    ws = [w_gate, w_up, w_down]
    if torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        x = x.to(dt)
        ws = [w.to(dt) if w is not None else None for w in ws]
    elif len({t.dtype for t in [x] + [w for w in ws if w is not None]}) != 1:
        raise ValueError("x and the weights must share one dtype (or run under torch.autocast)")
    x2 = x if x.dim() == 2 else x.reshape(-1, K)  # no view node (forward and backward) for a 2-D input
    M = x2.shape[0]
    scale = 0.0 if M == 0 or N == 0 else (1.0 / (M * N) if l1_reduction == "mean" else 1.0 / M)
    with torch.autocast(dev_type, enabled=False):
        why_not = _ops.cuda_backend_supported(x2, w_up)
        no_kernels = backend is None and dense_fallback(x2.device)  # a GPU without the kernels: dense, warned once
        if backend is None:
            backend = "cuda" if why_not is None else "torch"
        elif backend == "cuda" and why_not is not None:
            raise ValueError(f"backend='cuda' cannot take these inputs: {why_not}; use backend='torch' "
                             "(slow, exact) or mode='dense'")
        elif backend not in ("cuda", "torch"):
            raise ValueError(f"backend must be 'cuda', 'torch' or None, got {backend!r}")
        if backend == "cuda" and not no_kernels:
            sparse, w_call, cap = st.decide(cfg, w_gate is not None, mode, M, width)
            path = "sparse" if sparse else "dense"
        else:  # the torch backend is a correctness fallback, never faster than dense: auto keeps it off
            path, w_call, cap = "dense" if no_kernels or mode == "auto" else mode, width, 0
        st.last_path = path
        if not in_backward():
            st.last_forward_path = path
        if path == "dense" or M == 0:
            y, l1, stats = _dense(x2, ws[0], ws[1], ws[2], scale, want_last_active, want_stats, st, cfg, M, N,
                                  backend)
        else:
            x2 = x2.contiguous()
            wsc = [w.contiguous() if w is not None else None for w in ws[:2]] + [keep_down_layout(ws[2])]
            out = _SparseFFN.apply(x2, wsc[0], wsc[1], wsc[2], w_call, width, scale, cfg.train_chunk_rows, cap,
                                   want_last_active, cfg.train_dw_nb, backend)
            y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last = out
            # the op's summary (ops.host_summary's layout), measured against the configured width, on its way to
            # pinned memory: dispatch and the next call's width, with no reduction and no copy of ours
            st.measure(host, M, N, light_at=2, flagged_at=3, widest_at=1)
            kept = sum(t.numel() * t.element_size() for t in (ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup))
            # backup rows: a device count on "cuda" (reading it here would be a host sync), an int on "torch"
            n_backup = flag.sum() if backend == "cuda" else int(backup_rows.numel())
            stats = {"path": "sparse", "nnz_per_token": nnz, "backup_rows": n_backup,
                     "width": int(ell_col.shape[1]), "kept_bytes": int(kept), "backend": backend}
            st.last_kept_bytes, st.last_backup_rows = stats["kept_bytes"], n_backup
            if want_last_active:
                stats["last_active_row"] = last
    return (y if x.dim() == 2 else y.reshape(*lead, y.shape[-1])), l1, stats


def sparse_gated_ffn_train(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *,
                           l1_reduction: Literal["mean", "sum"] = "mean",
                           mode: Literal["auto", "sparse", "dense"] = "auto", state: DispatchState | None = None,
                           width: int | None = None, backend: Literal["cuda", "torch"] | None = None,
                           want_last_active: bool = False, want_stats: bool = True,
                           config: KernelConfig | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Gated ReLU FFN + its L1 term, differentiable, exact; sparse (hybrid format) where that is faster.

    Returns (y [..., K], l1 0-dim fp32, stats). mode: "auto" (per-layer measured dispatch), "sparse", "dense"
    (models pass their KernelConfig's train_mode). state: the layer's DispatchState (default: one per w_up
    tensor). config: a KernelConfig whose train_* fields set the dispatch thresholds and kernel settings
    (default: KernelConfig()). width: ELL width W (default config.train_width = 128). backend: "cuda" (kernels;
    bf16 CUDA) / "torch" (core ops, any device) / None. want_stats=False: the dense path skips the per-token count
    (stats["nnz_per_token"] is None there) and measures activity on config.train_probe_rows rows only; the sparse
    path gets its counts for free.
    """
    return _run(x, w_gate, w_up, w_down, l1_reduction, mode, state, width, backend, want_last_active, want_stats,
                config)


def sparse_nongated_ffn_train(x: Tensor, w_up: Tensor, w_down: Tensor, *,
                              l1_reduction: Literal["mean", "sum"] = "mean",
                              mode: Literal["auto", "sparse", "dense"] = "auto", state: DispatchState | None = None,
                              width: int | None = None, backend: Literal["cuda", "torch"] | None = None,
                              want_last_active: bool = False, want_stats: bool = True,
                              config: KernelConfig | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Non-gated y = relu(x W_u^T) W_d^T + L1 of h = relu(x W_u^T); see sparse_gated_ffn_train."""
    return _run(x, None, w_up, w_down, l1_reduction, mode, state, width, backend, want_last_active, want_stats,
                config)


__all__ = ["sparse_gated_ffn_train", "sparse_nongated_ffn_train", "DispatchState",
           "update_tokens_since_fire_sparse"]
