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

Dispatch (mode="auto"): a per-layer DispatchState remembers the activity measured in the previous calls
(sync-free: device stats copied to pinned host memory and read once their event has completed) and picks the
sparse path only where it was measured faster: activity <= config.train_dense_above and backup-row fraction <=
config.train_backup_dense_above (a KernelConfig, kernels/config.py). The first call of a layer goes dense (and
measures). Settings: kernels/train/README.md. On a CUDA GPU that is not sm_90 (kernels/device.py) every call takes the
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

_DEFAULT_CONFIG = KernelConfig()

_L1_REDUCTIONS = ("mean", "sum")


class DispatchState:
    """Per-layer activity history for mode='auto' (keep one per FFN module; cheap, no tensors of size M)."""

    def __init__(self) -> None:
        self.activity: float | None = None     # mean active fraction of a, last completed measurement
        self.backup_frac: float | None = None  # fraction of rows with nnz > width
        self.last_path: str | None = None
        self.last_forward_path: str | None = None
        self.widest_light: int | None = None  # the widest row with nnz <= width (sparse calls only)
        self.last_kept_bytes: int | None = None   # bytes the sparse path's last forward saved for backward
        self.last_backup_rows: Tensor | int | None = None  # rows its last forward kept dense (device count on cuda)
        self._pending: tuple[Any, int, int, tuple[int, int, int]] | None = None  # (ready, rows, n_cols, layout)
        self._host: Tensor | None = None

    def _poll(self) -> None:
        if self._pending is None or _capturing():
            return  # while a CUDA graph is captured no event is queried: the decisions of the last eager call stand
        ready, rows, n, (i_light, i_heavy, i_widest) = self._pending
        if ready is not None and not ready():
            return  # not finished yet: keep the previous decision (no host sync)
        vals = self._host.tolist()
        light_nnz, heavy = vals[i_light], vals[i_heavy]
        light_rows = rows - heavy
        if i_widest >= 0 and light_rows > 0:
            self.widest_light = vals[i_widest]
        if rows > 0:
            # activity of the rows the sparse kernels would take; heavy rows are priced by backup_frac
            self.activity = light_nnz / (max(1, light_rows) * n)
            self.backup_frac = heavy / rows
        self._pending = None

    def record(self, nnz: Tensor, n_cols: int, width: int) -> None:
        """Queue an async device->host copy of (nnz of light rows, heavy rows) for a later decision, from per-row
        counts. Never blocks: no host->device tensors, one reused pinned buffer, skipped while a copy is in flight."""
        if nnz.numel() == 0 or self._busy():
            return
        light = nnz <= width
        light_nnz = torch.where(light, nnz, 0)
        self._queue(torch.stack([light_nnz.sum(dtype=torch.int64), (~light).sum(dtype=torch.int64),
                                 light_nnz.max().to(torch.int64)]), nnz.numel(), n_cols, (0, 1, 2))

    def record_summary(self, host: Tensor, rows: int, n_cols: int) -> None:
        """The same from the sparse op's own summary (ops.host_summary's layout), already on its way to pinned memory:
        no reduction and no copy of ours."""
        if rows == 0 or self._busy():
            return
        self._host = host
        self._pending = (lambda: _ops.summary_ready(host), rows, n_cols, (2, 3, 1))

    def record_pair(self, stats: Tensor, rows: int, n_cols: int) -> None:
        """The same from a device int64 [2] = (nnz of light rows, heavy rows) already reduced (fused dense path)."""
        if rows == 0 or self._busy():
            return
        self._queue(stats, rows, n_cols, (0, 1, -1))

    def call_width(self, width: int, shrink: bool) -> int:
        """The ELL width of the next sparse call: with shrink, the widest light row measured so far plus a quarter,
        rounded up to 8 (rows above it are exact backup rows; the next measurement adapts), else `width`. Known on
        the host without a sync: the measurement of an earlier call."""
        self._poll()
        if not shrink or self.widest_light is None:
            return width
        return min(width, max(8, -(-(self.widest_light * 5 // 4 + 1) // 8) * 8))

    def backup_capacity(self, m: int) -> int:
        """Rows of the next sparse call's dense cuBLAS backup block: the measured backup fraction plus a quarter and
        32 rows (M/16 before any measurement), none where the last measurement saw no backup row (the block's ~10
        launches would be host time for nothing). Rows beyond it are still exact (a slower CUDA-core kernel)."""
        frac = self.backup_frac
        if frac == 0:
            return 0
        cap = m // 16 if frac is None else int(frac * m * 1.25) + 32
        return min(m, -(-cap // 32) * 32)

    def _busy(self) -> bool:
        """True while a measurement is in flight, and while a CUDA graph is captured: a captured call records nothing
        (its replays would write the pinned buffer at times no event tells)."""
        if _capturing():
            return True
        self._poll()
        return self._pending is not None

    def _queue(self, dev: Tensor, rows: int, n_cols: int, layout: tuple[int, int, int]) -> None:
        """Copy the int64 stats `dev` to (pinned) host memory without a sync; _poll reads them once landed. layout:
        the positions of (light non-zeros, heavy rows, widest light row or -1)."""
        if not dev.is_cuda:
            self._host = dev
            self._pending = (None, rows, n_cols, layout)
            return
        if self._host is None or self._host.numel() != dev.numel() or not self._host.is_pinned():
            self._host = torch.empty(dev.numel(), dtype=torch.int64, pin_memory=True)
        self._host.copy_(dev, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._pending = (ev.query, rows, n_cols, layout)

    def choose(self, cfg: KernelConfig, m: int) -> str:
        self._poll()
        if in_backward() and self.last_forward_path is not None:
            # activation-checkpoint recompute: take the path of this layer's last forward, so the recomputed
            # saved tensors have the metadata the checkpoint recorded
            return self.last_forward_path
        if m < cfg.train_sparse_min_m:
            return "dense"  # measured: fixed costs (host syncs, small launches) lose below this size
        if self.activity is None:
            return "dense"  # nothing measured yet: the dense path measures
        # measured: from 16384 rows sparse won at 1% activity (with 1% heavy rows too); at 8192 rows it lost there
        # with heavy rows (kernels/train/README.md, train_dense_above_large)
        limit = cfg.train_dense_above_large if m >= cfg.train_large_m else cfg.train_dense_above
        if self.activity > limit or (self.backup_frac or 0.0) > cfg.train_backup_dense_above:
            return "dense"
        return "sparse"


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never before CUDA is initialised)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


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
        st.record_pair(dstats, M, N)
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
        path = "dense" if no_kernels else mode
        if path == "auto":
            # the torch backend is a correctness fallback, never faster than dense: auto keeps it off
            path = st.choose(cfg, M) if backend == "cuda" else "dense"
        st.last_path = path
        if not in_backward():
            st.last_forward_path = path
        if path == "dense" or M == 0:
            y, l1, stats = _dense(x2, ws[0], ws[1], ws[2], scale, want_last_active, want_stats, st, cfg, M, N,
                                  backend)
        else:
            x2 = x2.contiguous()
            wsc = [w.contiguous() if w is not None else None for w in ws[:2]] + [keep_down_layout(ws[2])]
            w_call = st.call_width(width, cfg.train_shrink)  # from earlier measurements: no sync
            out = _SparseFFN.apply(x2, wsc[0], wsc[1], wsc[2], w_call, width, scale, cfg.train_chunk_rows,
                                   st.backup_capacity(M), want_last_active, cfg.train_dw_nb, backend)
            y, l1, ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup, host, last = out
            st.record_summary(host, M, N)  # measured against the configured width: dispatch, the next call's width
            kept = sum(t.numel() * t.element_size() for t in (ell_col, ell_a, ell_u, nnz, flag, backup_rows, backup))
            # backup rows: a device count on "cuda" (reading it here would be a host sync), an int on "torch"
            n_backup = flag.sum() if backend == "cuda" else int(backup_rows.numel())
            stats = {"path": "sparse", "nnz_per_token": nnz, "backup_rows": n_backup, "width": w_call,
                     "kept_bytes": int(kept), "backend": backend}
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
