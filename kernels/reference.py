"""Pure-PyTorch reference of the sparse activation formats and the FFN ops built on them.

This module *defines* the semantics that the CUDA kernels (kernels/ffn.py, kernels/train_ffn.py)
must match; the spec in words is kernels/FORMAT.md. Everything here runs on CPU and GPU with
stock PyTorch. Contents, in order: word packing; TwELL; Hybrid; the dense FFNs; which rows a
sparse FFN computes densely (heavy rows and the non-finite rule); the inference FFNs through
TwELL and Hybrid; the training op's forward and backward (its `torch` backend calls them).

Shapes follow nn.Linear: x [M, K], w_gate / w_up [N, K], w_down [K, N]
(K = hidden size, N = intermediate size). The activation is h = relu(x w_gate^T)
(non-gated: relu(x w_up^T)); an entry is *active* iff h != 0 (NaN counts as active).

Formats
  TwELL  (inference): per (row, tile of tile_n columns) up to `slots` packed int32 words
         (bf16 value bits << 16 | tile-local column) plus the true per-(row, tile) count.
         A row with any tile count > slots *overflows* and must go through the dense path.
  Hybrid (training):  per row up to `width` (global column, value) pairs; rows with more
         than `width` active entries are stored densely in a backup block (lossless).

It imports only torch and the standard library: a saved checkpoint carries a copy of this file (models/
twell_reference.py links here), so that mlp_impl='reference' runs where the project is not installed.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def in_backward() -> bool:
    """True while autograd runs a backward pass (activation-checkpoint recompute happens there): the model and the
    training op count statistics and pick paths once per forward, not again in the recompute."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1

__all__ = [
    "TwELL",
    "Hybrid",
    "pack_words",
    "unpack_words",
    "d2t",
    "t2d",
    "d2h",
    "h2d",
    "canonical",
    "gated_ffn_dense",
    "nongated_ffn_dense",
    "gated_ffn_twell",
    "nongated_ffn_twell",
    "gated_ffn_hybrid",
    "nongated_ffn_hybrid",
    "activation_stats",
    "dense_rows_mask",
    "dense_rows_forward",
    "dense_rows_backward",
    "TrainSaved",
    "train_ffn_forward",
    "train_ffn_backward",
    "csr_by_neuron",
]

MAX_TILE_N = 1 << 16  # the local column lives in the low 16 bits of a word


# ----------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------
def _check_tiling(n_cols: int, tile_n: int, slots: int) -> None:
    if not isinstance(tile_n, int) or not isinstance(slots, int):
        raise ValueError(f"tile_n and slots must be ints, got {tile_n!r} and {slots!r}")
    if not 0 < tile_n <= MAX_TILE_N:
        raise ValueError(f"tile_n must be in [1, {MAX_TILE_N}] (16-bit local column), got {tile_n}")
    if not 0 < slots <= tile_n:
        raise ValueError(f"slots must be in [1, tile_n={tile_n}], got {slots}")
    if n_cols <= 0 or n_cols % tile_n != 0:
        hint = math.gcd(max(n_cols, 0), tile_n)
        raise ValueError(
            f"N={n_cols} columns is not a positive multiple of tile_n={tile_n}; pass a tile_n that "
            f"divides N (e.g. tile_n={hint}, with slots <= tile_n)"
        )


def _check_matrix(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [M, N], got shape {tuple(t.shape)}; flatten leading dims with "
            f"{name}.reshape(-1, {name}.shape[-1])"
        )
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_ffn_layouts(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor,
                      w_down: torch.Tensor) -> tuple[int, int]:
    """Shapes of an FFN call in nn.Linear layouts (x [..., K], w_gate/w_up [N, K], w_down [K, N]); returns (K, N).

    Shared by the CUDA entry points (kernels.ffn, kernels.train_ffn), which add their own dtype/device rules.
    """
    if x.dim() < 1:
        raise ValueError("x must have shape [..., K]")
    k = x.shape[-1]
    if w_up.dim() != 2 or w_up.shape[1] != k:
        raise ValueError(f"w_up must be [N, K={k}] (nn.Linear layout), got {tuple(w_up.shape)}")
    n = w_up.shape[0]
    if w_gate is not None and tuple(w_gate.shape) != (n, k):
        raise ValueError(f"w_gate must be [N={n}, K={k}] like w_up, got {tuple(w_gate.shape)}")
    if w_down.dim() != 2 or tuple(w_down.shape) != (k, n):
        raise ValueError(f"w_down must be [K={k}, N={n}] (down_proj.weight in nn.Linear layout, not its "
                         f"transpose), got {tuple(w_down.shape)}")
    return k, n


def _check_ffn_args(x: Any, named_weights: list[tuple[str, Any, str]]) -> tuple[int, int, int]:
    """Check x [..., K] and weights against the nn.Linear layouts; return (K, N, K_out)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError("x must be a floating-point tensor of shape [..., K]")
    k = x.shape[-1]
    n = named_weights[0][1].shape[0] if isinstance(named_weights[0][1], torch.Tensor) else -1
    k_out = -1
    for name, w, layout in named_weights:
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor in nn.Linear layout {layout}")
        if w.dtype != x.dtype:
            raise ValueError(
                f"{name} has dtype {w.dtype} but x has {x.dtype}; cast them to one dtype "
                f"(as nn.Linear would require)"
            )
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}; move them to one device")
        if layout == "[N, K]":
            if tuple(w.shape) != (n, k):
                raise ValueError(
                    f"{name} must have shape [N, K] = [{n}, {k}] (nn.Linear weight), got {tuple(w.shape)}"
                )
        else:  # "[K, N]" (down projection; its output size may differ from K in principle)
            if w.shape[1] != n:
                raise ValueError(
                    f"{name} must have shape [K, N] with N = {n} (down_proj.weight, not its transpose), "
                    f"got {tuple(w.shape)}"
                )
            k_out = w.shape[0]
    return k, n, k_out


# ----------------------------------------------------------------------------------------
# word packing
# ----------------------------------------------------------------------------------------
def pack_words(values: torch.Tensor, local_cols: torch.Tensor) -> torch.Tensor:
    """Pack values (cast to bf16) and 16-bit local columns into int32 words.

    word = (bf16 bit pattern) << 16 | local_col, stored as int32 (two's complement), so a
    negative or NaN bf16 (bit 15 set) gives a negative word. Any bf16 round-trips exactly.
    """
    if values.shape != local_cols.shape:
        raise ValueError(f"values {tuple(values.shape)} and local_cols {tuple(local_cols.shape)} must match")
    if local_cols.numel() and (int(local_cols.min()) < 0 or int(local_cols.max()) >= MAX_TILE_N):
        raise ValueError("local columns must lie in [0, 65535] to fit the low 16 bits of a word")
    # The int16 view is sign-extended to int32; times 2^16 it stays inside int32 range
    # ([-2^31, 2^31 - 2^16]), so no shift overflow; the low 16 bits are then zero.
    hi = values.to(torch.bfloat16).view(torch.int16).to(torch.int32) * (1 << 16)
    return hi | local_cols.to(torch.int32)


def unpack_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_words: (bf16 values, int32 local columns), same shape as words."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    cols = words & 0xFFFF
    # Arithmetic right shift returns the sign-extended upper half, i.e. exactly the int16 bits.
    values = (words >> 16).to(torch.int16).view(torch.bfloat16)
    return values, cols


# ----------------------------------------------------------------------------------------
# TwELL
# ----------------------------------------------------------------------------------------
@dataclass
class TwELL:
    """Tile-wise ELL activations (see FORMAT.md).

    packed: int32 [M, n_tiles, slots]: words (bf16 bits << 16 | local column); slot s of
            (row, tile) is meaningful only for s < min(counts[row, tile], slots).
    counts: int32 [M, n_tiles]: TRUE number of active entries of each (row, tile), never capped.
    """

    packed: torch.Tensor
    counts: torch.Tensor
    n_cols: int
    tile_n: int
    slots: int

    def __post_init__(self) -> None:
        _check_tiling(self.n_cols, self.tile_n, self.slots)
        t = self.n_cols // self.tile_n
        p = self.packed
        if p.dtype != torch.int32 or p.dim() != 3 or tuple(p.shape[1:]) != (t, self.slots):
            raise ValueError(
                f"TwELL.packed must be int32 [M, {t}, {self.slots}], got {self.packed.dtype} {tuple(self.packed.shape)}"
            )
        if self.counts.dtype != torch.int32 or tuple(self.counts.shape) != (self.packed.shape[0], t):
            raise ValueError(
                f"TwELL.counts must be int32 [M, {t}], got {self.counts.dtype} {tuple(self.counts.shape)}"
            )

    @property
    def n_rows(self) -> int:
        return self.packed.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.n_cols // self.tile_n

    @property
    def compression(self) -> float:
        """C = tile_n / slots: how many times fewer words than dense columns."""
        return self.tile_n / self.slots

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 4 + self.counts.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def overflow_mask(self) -> torch.Tensor:
        """Bool [M]: rows with some tile count > slots (packed contents undefined there)."""
        return (self.counts > self.slots).any(dim=1)

    def overflow_rows(self) -> torch.Tensor:
        """int64 [R], ascending: indices of overflowing rows."""
        return self.overflow_mask().nonzero().flatten()

    def valid_mask(self) -> torch.Tensor:
        """Bool [M, n_tiles, slots]: slots holding a meaningful word (non-overflow rows only)."""
        slot = torch.arange(self.slots, device=self.device, dtype=torch.int32)
        valid = slot < self.counts.unsqueeze(-1)
        return valid & ~self.overflow_mask()[:, None, None]

    def to(self, device: torch.device | str) -> "TwELL":
        return TwELL(self.packed.to(device), self.counts.to(device), self.n_cols, self.tile_n, self.slots)


def d2t(h: torch.Tensor, tile_n: int = 256, slots: int = 32) -> TwELL:
    """Dense [M, N] activations -> TwELL. Values are stored as bf16 (exact for a bf16 h).

    The reference writes each (row, tile)'s first min(count, slots) active entries in
    ascending column order and zero-fills the remaining slots (consumers may not rely on
    either). For overflowing rows the packed contents are undefined (here: the first
    `slots` active entries) and their counts are still exact.
    """
    _check_matrix(h, "h")
    m, n = h.shape
    _check_tiling(n, tile_n, slots)
    n_tiles = n // tile_n
    tiles = h.reshape(m, n_tiles, tile_n)
    active = tiles != 0  # NaN != 0, so NaN is active
    counts = active.sum(dim=-1, dtype=torch.int32)
    # Rank of each active entry among the active entries of its tile = its slot.
    rank = active.cumsum(dim=-1, dtype=torch.int32) - 1
    keep = active & (rank < slots)
    # Entries that are not kept are scattered into a scratch slot that is dropped afterwards.
    slot = torch.where(keep, rank, slots).long()
    local = torch.arange(tile_n, device=h.device, dtype=torch.int32).expand(m, n_tiles, tile_n)
    words = pack_words(tiles, local)
    packed = torch.zeros(m, n_tiles, slots + 1, dtype=torch.int32, device=h.device)
    packed.scatter_(-1, slot, words)
    return TwELL(packed[..., :slots].contiguous(), counts, n, tile_n, slots)


def t2d(tw: TwELL, backup: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """TwELL -> dense bf16 [M, N].

    Overflowing rows cannot be rebuilt from the packed words. Pass their dense contents as
    backup=(rows, dense_rows) (int [R] row indices covering every overflowing row, and
    [R, N] values); otherwise a ValueError is raised. Rows listed in backup are taken
    from dense_rows (cast to bf16) whether they overflow or not.
    """
    m, n, tn, s = tw.n_rows, tw.n_cols, tw.tile_n, tw.slots
    ovf = tw.overflow_mask()
    values, cols = unpack_words(tw.packed)
    valid = tw.valid_mask()
    if bool((valid & (cols >= tn)).any()):
        raise ValueError(f"TwELL holds a local column >= tile_n={tn} in a valid slot: corrupt packed words")
    # Invalid slots scatter into a scratch column tn, dropped below.
    idx = torch.where(valid, cols, tn).long()
    dense = torch.zeros(m, tw.n_tiles, tn + 1, dtype=torch.bfloat16, device=tw.device)
    dense.scatter_(-1, idx, torch.where(valid, values, torch.zeros((), dtype=torch.bfloat16, device=tw.device)))
    dense = dense[..., :tn].reshape(m, n)

    covered = torch.zeros(m, dtype=torch.bool, device=tw.device)
    if backup is not None:
        rows, dense_rows = _check_backup(backup, m, n, tw.device)
        dense[rows] = dense_rows.to(torch.bfloat16)
        covered[rows] = True
    missing = ovf & ~covered
    if bool(missing.any()):
        bad = missing.nonzero().flatten()
        raise ValueError(
            f"{bad.numel()} TwELL row(s) overflow (a tile count > slots={s}), e.g. rows "
            f"{bad[:8].tolist()}; their packed words are incomplete. Pass their dense values via "
            f"t2d(tw, backup=(rows, dense_rows)) (rows = tw.overflow_rows()), or use a larger slots"
        )
    return dense


def _check_backup(backup: Any, m: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(backup, (tuple, list)) and len(backup) == 2):
        raise ValueError("backup must be a pair (rows [R] int tensor, dense_rows [R, N] tensor)")
    rows, dense_rows = backup
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool:
        raise ValueError("backup rows must be a 1-D integer tensor of row indices")
    rows = rows.to(device=device, dtype=torch.int64)
    if not isinstance(dense_rows, torch.Tensor) or tuple(dense_rows.shape) != (rows.numel(), n):
        raise ValueError(f"backup dense_rows must have shape [R, N] = [{rows.numel()}, {n}]")
    if rows.numel():
        if int(rows.min()) < 0 or int(rows.max()) >= m:
            raise ValueError(f"backup rows must lie in [0, {m})")
        if rows.unique().numel() != rows.numel():
            raise ValueError("backup rows must not repeat")
    return rows, dense_rows.to(device)


# ----------------------------------------------------------------------------------------
# Hybrid
# ----------------------------------------------------------------------------------------
@dataclass
class Hybrid:
    """ELL rows plus a dense backup block for heavy rows (see FORMAT.md).

    ell_col: int32 [M, width] global columns; ell_val: [M, width] (h's dtype). For a row with
             nnz <= width, slots < nnz are meaningful; the rest are padding (reference: -1 / 0).
    nnz:     int32 [M] true number of active entries per row.
    backup_rows: int64 [R] ascending: every row with nnz > width, plus the rows the producer chose
             to keep dense (the FFN ops: rows with a non-finite gate pre-activation, see
             dense_rows_mask); their ELL slots are ignored. backup: [R, N] dense values of those
             rows (h's dtype).
    """

    ell_col: torch.Tensor
    ell_val: torch.Tensor
    nnz: torch.Tensor
    backup_rows: torch.Tensor
    backup: torch.Tensor
    n_cols: int
    width: int

    def __post_init__(self) -> None:
        m = self.nnz.shape[0] if self.nnz.dim() == 1 else -1
        if self.nnz.dtype != torch.int32 or self.nnz.dim() != 1:
            raise ValueError(f"Hybrid.nnz must be int32 [M], got {self.nnz.dtype} {tuple(self.nnz.shape)}")
        if self.width <= 0:
            raise ValueError(f"Hybrid.width must be positive, got {self.width}")
        if self.ell_col.dtype != torch.int32 or tuple(self.ell_col.shape) != (m, self.width):
            raise ValueError(
                f"Hybrid.ell_col must be int32 [{m}, {self.width}], got {self.ell_col.dtype} {tuple(self.ell_col.shape)}"
            )
        if tuple(self.ell_val.shape) != (m, self.width):
            raise ValueError(f"Hybrid.ell_val must have shape [{m}, {self.width}], got {tuple(self.ell_val.shape)}")
        if self.backup_rows.dtype != torch.int64 or self.backup_rows.dim() != 1:
            raise ValueError("Hybrid.backup_rows must be int64 [R]")
        if tuple(self.backup.shape) != (self.backup_rows.numel(), self.n_cols):
            raise ValueError(f"Hybrid.backup must have shape [R, N] = [{self.backup_rows.numel()}, {self.n_cols}]")

    @property
    def n_rows(self) -> int:
        return self.nnz.shape[0]

    @property
    def nbytes(self) -> int:
        ts = (self.ell_col, self.ell_val, self.nnz, self.backup_rows, self.backup)
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def device(self) -> torch.device:
        return self.nnz.device

    def overflow_mask(self) -> torch.Tensor:
        """Bool [M]: rows with nnz > width (they must be in the dense backup)."""
        return self.nnz > self.width

    def overflow_rows(self) -> torch.Tensor:
        """int64 [R] ascending: the rows held in the backup."""
        return self.backup_rows

    def backup_mask(self) -> torch.Tensor:
        """Bool [M]: rows held in the dense backup (a superset of overflow_mask())."""
        mask = torch.zeros(self.n_rows, dtype=torch.bool, device=self.device)
        mask[self.backup_rows] = True
        return mask

    def valid_mask(self) -> torch.Tensor:
        """Bool [M, width]: ELL slots holding a meaningful (column, value) pair (light rows only)."""
        slot = torch.arange(self.width, device=self.device, dtype=torch.int32)
        return (slot < self.nnz.unsqueeze(-1)) & ~self.backup_mask().unsqueeze(-1)

    def to(self, device: torch.device | str) -> "Hybrid":
        return Hybrid(
            self.ell_col.to(device), self.ell_val.to(device), self.nnz.to(device),
            self.backup_rows.to(device), self.backup.to(device), self.n_cols, self.width,
        )


def d2h(h: torch.Tensor, width: int = 128, keep_dense: torch.Tensor | None = None) -> Hybrid:
    """Dense [M, N] -> Hybrid (lossless; values keep h's dtype).

    Rows with nnz <= width keep their active entries in ascending column order in the ELL
    part; rows with nnz > width, and the rows marked in keep_dense (bool [M], optional), go
    entirely (all N values) to the dense backup.
    """
    _check_matrix(h, "h")
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"width must be a positive int, got {width!r}")
    m, n = h.shape
    active = h != 0
    nnz = active.sum(dim=1, dtype=torch.int32)
    heavy = nnz > width
    if keep_dense is not None:
        if keep_dense.dtype != torch.bool or tuple(keep_dense.shape) != (m,):
            raise ValueError(f"keep_dense must be a bool [M={m}] row mask, got {keep_dense.dtype} "
                             f"{tuple(keep_dense.shape)}")
        heavy = heavy | keep_dense.to(h.device)
    rank = active.cumsum(dim=1, dtype=torch.int32) - 1
    keep = active & ~heavy.unsqueeze(1)  # rank < width holds automatically for light rows
    slot = torch.where(keep, rank, width).long()
    cols = torch.arange(n, device=h.device, dtype=torch.int32).expand(m, n)
    ell_col = torch.full((m, width + 1), -1, dtype=torch.int32, device=h.device)
    ell_col.scatter_(1, slot, torch.where(keep, cols, -1))
    ell_val = torch.zeros(m, width + 1, dtype=h.dtype, device=h.device)
    ell_val.scatter_(1, slot, torch.where(keep, h, torch.zeros((), dtype=h.dtype, device=h.device)))
    backup_rows = heavy.nonzero().flatten()
    return Hybrid(
        ell_col[:, :width].contiguous(), ell_val[:, :width].contiguous(), nnz,
        backup_rows, h[backup_rows].clone(), n, width,
    )


def h2d(hy: Hybrid) -> torch.Tensor:
    """Hybrid -> dense [M, N] in ell_val's dtype; exactly reproduces the h given to d2h."""
    m, n = hy.n_rows, hy.n_cols
    br = hy.backup_rows
    if br.numel() and (int(br.min()) < 0 or int(br.max()) >= m or not bool((br[1:] > br[:-1]).all())):
        raise ValueError(f"Hybrid.backup_rows must be ascending row indices in [0, {m}) without repeats")
    missing = hy.overflow_mask() & ~hy.backup_mask()
    if bool(missing.any()):
        raise ValueError(
            "Hybrid.backup_rows must hold every row with nnz > width; "
            f"{int(missing.sum())} heavy row(s) missing, e.g. {missing.nonzero().flatten()[:8].tolist()}"
        )
    valid = hy.valid_mask()
    if bool((valid & ((hy.ell_col < 0) | (hy.ell_col >= n))).any()):
        raise ValueError(f"Hybrid holds a column outside [0, {n}) in a valid ELL slot: corrupt ell_col")
    idx = torch.where(valid, hy.ell_col, n).long()  # padding scatters into scratch column n
    zero = torch.zeros((), dtype=hy.ell_val.dtype, device=hy.device)
    dense = torch.zeros(m, n + 1, dtype=hy.ell_val.dtype, device=hy.device)
    dense.scatter_(1, idx, torch.where(valid, hy.ell_val, zero))
    dense = dense[:, :n]
    dense[hy.backup_rows] = hy.backup.to(dense.dtype)
    return dense


def canonical(fmt: TwELL | Hybrid) -> TwELL | Hybrid:
    """Same content with every undefined part fixed: valid entries sorted by column,
    padding zero-filled (Hybrid: col -1, value 0), overflow rows' slots cleared.

    Two encodings of one matrix (e.g. a CUDA kernel's output and d2t's) are equivalent iff
    their canonical forms are equal (and, for Hybrid, their backups).
    """
    if isinstance(fmt, TwELL):
        valid = fmt.valid_mask()
        _, cols = unpack_words(fmt.packed)
        key = torch.where(valid, cols, MAX_TILE_N)  # invalid slots sort last
        order = key.argsort(dim=-1, stable=True)
        packed = torch.gather(fmt.packed, -1, order)
        packed = torch.where(torch.gather(valid, -1, order), packed, 0)
        return TwELL(packed, fmt.counts.clone(), fmt.n_cols, fmt.tile_n, fmt.slots)
    if isinstance(fmt, Hybrid):
        valid = fmt.valid_mask()
        key = torch.where(valid, fmt.ell_col.long(), fmt.n_cols)
        order = key.argsort(dim=-1, stable=True)
        v = torch.gather(valid, -1, order)
        col = torch.where(v, torch.gather(fmt.ell_col, -1, order), -1)
        zero = torch.zeros((), dtype=fmt.ell_val.dtype, device=fmt.device)
        val = torch.where(v, torch.gather(fmt.ell_val, -1, order), zero)
        return Hybrid(col, val, fmt.nnz.clone(), fmt.backup_rows.clone(), fmt.backup.clone(), fmt.n_cols, fmt.width)
    raise ValueError(f"canonical() takes a TwELL or Hybrid, got {type(fmt).__name__}")


# ----------------------------------------------------------------------------------------
# dense FFNs (what HF's LlamaMLP computes, with ReLU)
# ----------------------------------------------------------------------------------------
def gated_ffn_dense(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """y = (relu(x w_gate^T) * (x w_up^T)) w_down^T, in x's dtype (three F.linear calls)."""
    _check_ffn_args(x, [("w_gate", w_gate, "[N, K]"), ("w_up", w_up, "[N, K]"), ("w_down", w_down, "[K, N]")])
    return F.linear(F.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def nongated_ffn_dense(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """y = relu(x w_up^T) w_down^T, in x's dtype."""
    _check_ffn_args(x, [("w_up", w_up, "[N, K]"), ("w_down", w_down, "[K, N]")])
    return F.linear(F.relu(F.linear(x, w_up)), w_down)


# ----------------------------------------------------------------------------------------
# which rows the sparse FFNs compute with the dense FFN's own ops
# ----------------------------------------------------------------------------------------
def dense_rows_mask(g: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor,
                    x: torch.Tensor) -> torch.Tensor:
    """Bool [M]: rows a sparse FFN must compute with the dense FFN's ops, besides its heavy rows.

    Skipping an inactive neuron j is exact only where the dense FFN's terms for j are finite:
    dense forms 0 * u_j (gated) and 0 * w_down[:, j] there, and 0 * Inf = NaN. Hence
    (FORMAT.md, "Non-finite values"):
      - a row whose gate pre-activation g (x w_gate^T; non-gated: x w_up^T) has a non-finite
        entry. This covers a non-finite x (every entry of its g row is then non-finite) and a
        non-finite w_gate entry (it reaches that neuron's g in every row);
      - every row when w_up (gated) or w_down holds a non-finite value;
      - gated: a row whose u = x w_up^T overflows to +-Inf in x's dtype (finite x and w_up).
    Rows outside this mask have finite x, g, u and weights, so their inactive neurons add exactly 0.
    """
    rows = ~torch.isfinite(g).all(dim=1)
    weights = ([w_up] if w_up is not None else []) + [w_down]
    if not all(bool(torch.isfinite(w).all()) for w in weights):
        return torch.ones_like(rows)
    if w_up is not None:
        rows |= _up_overflow_rows(x, w_up)
    return rows


def _up_overflow_rows(x: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Bool [M]: rows where the dense u = x w_up^T (rounded to x's dtype) holds a non-finite value.

    |u_rj| <= |x_r| |w_up[j]| (Cauchy-Schwarz), so only rows whose bound reaches half the dtype's
    largest value (a margin for rounding) can overflow; u is computed for those rows alone."""
    bound = x.double().norm(dim=1) * w_up.double().norm(dim=1).max()
    rows = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    cand = (~(bound < torch.finfo(x.dtype).max / 2)).nonzero().flatten()  # NaN bounds are candidates too
    if cand.numel():
        rows[cand] = ~torch.isfinite(F.linear(x[cand], w_up)).all(dim=1)
    return rows


def dense_rows_forward(x_rows: torch.Tensor, a_rows: torch.Tensor, w_up: torch.Tensor | None,
                       w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) of some rows by the dense FFN's ops, from a = relu(g) of those rows (w_up None: non-gated).
    The CUDA training op's backup rows run these ops one for one (kernels/train/binding.cpp, ffn_fwd_rows)."""
    h = a_rows * F.linear(x_rows, w_up) if w_up is not None else a_rows
    return h, F.linear(h, w_down)


# ----------------------------------------------------------------------------------------
# FFN through a format: shared sparse core
# ----------------------------------------------------------------------------------------
def _sparse_rows_ffn(
    x: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    gate_vals: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    out: torch.Tensor,
    method: str | None = None,
) -> None:
    """Add the FFN output of a list of active entries into out (fp32/fp64 accumulator [M, K_out]).

    Entry e = (row r_e, neuron j_e, activation a_e). Gated: u_e = x[r_e] . w_up[j_e],
    h_e = a_e * u_e; non-gated (w_up None): h_e = a_e. Then out[r] += sum_e h_e w_down[:, j_e].
    Only the w_up rows / w_down columns of active neurons are touched. Intermediates are
    rounded to x's dtype where the dense path rounds them (u, h), accumulations are wide.
    Entries must be sorted by (row, column).
    """
    if rows.numel() == 0:
        return
    acc = out.dtype
    dt = x.dtype
    if method is None:
        # torch.sparse CSR kernels (MKL) are fast on CPU; the gather path uses only core ops.
        method = "csr" if x.device.type == "cpu" else "gather"
    a = gate_vals.to(acc)
    if method == "csr":
        m, n = out.shape[0], w_down.shape[1]
        crow = torch.zeros(m + 1, dtype=torch.int64, device=x.device)
        crow[1:] = torch.bincount(rows, minlength=m).cumsum(0)
        col = cols.long()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            if w_up is not None:
                pattern = torch.sparse_csr_tensor(crow, col, torch.ones_like(a), (m, n))
                # SDDMM: u_e = x[r_e] . w_up[j_e] only at the pattern's entries (same order).
                u = torch.sparse.sampled_addmm(pattern, x.to(acc), w_up.to(acc).t(), beta=0.0).values()
                a = a * u.to(dt).to(acc)
            h = a.to(dt).to(acc)
            hs = torch.sparse_csr_tensor(crow, col, h, (m, n))
            out += hs @ w_down.to(acc).t()
        return
    if method != "gather":
        raise ValueError(f"unknown method {method!r}; use 'csr' or 'gather'")
    w_down_t = w_down.t()
    chunk = max(1, (1 << 22) // max(1, x.shape[1] + w_down.shape[0]))  # bound the gathered temporaries
    for s in range(0, rows.numel(), chunk):
        r, j, h = rows[s:s + chunk], cols[s:s + chunk], a[s:s + chunk]
        if w_up is not None:
            u = torch.bmm(x[r].to(acc).unsqueeze(1), w_up[j].to(acc).unsqueeze(2)).flatten()
            h = h * u.to(dt).to(acc)
        h = h.to(dt).to(acc)
        out.index_add_(0, r, w_down_t[j].to(acc) * h.unsqueeze(1))


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def _stats_from_counts(tile_counts: torch.Tensor, overflow: torch.Tensor, neuron_active: torch.Tensor | None,
                       slots: int | None) -> dict[str, Any]:
    nnz = tile_counts.sum(dim=1, dtype=torch.int32)
    m = nnz.numel()
    stats: dict[str, Any] = {
        "n_tokens": m,
        "nnz_per_token": nnz,
        "nnz_mean": float(nnz.float().mean()) if m else 0.0,
        "nnz_max": int(nnz.max()) if m else 0,
        "n_overflow_rows": int(overflow.sum()),
        "overflow_frac": float(overflow.float().mean()) if m else 0.0,
    }
    if slots is not None:
        stats["slots"] = slots
        stats["tile_max_count"] = tile_counts.amax(dim=0) if m else tile_counts.new_zeros(tile_counts.shape[1])
        stats["max_tile_count"] = int(tile_counts.max()) if tile_counts.numel() else 0
    if neuron_active is not None:
        stats["neuron_active"] = neuron_active
        stats["dead_neurons"] = int((~neuron_active).sum())
        stats["dead_frac"] = float((~neuron_active).float().mean())
    return stats


def activation_stats(h: torch.Tensor, tile_n: int = 256, slots: int = 32) -> dict[str, Any]:
    """Sparsity statistics of activations h [..., N] (leading dims flattened to M tokens).

    Keys: n_tokens; nnz_per_token (int32 [M]); nnz_mean; nnz_max; slots; tile_max_count
    (int32 [n_tiles], max count of each tile over tokens); max_tile_count; n_overflow_rows /
    overflow_frac (TwELL rows with a tile count > slots); neuron_active (bool [N]: active in
    at least one token); dead_neurons / dead_frac (neurons never active in this batch).
    """
    if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() < 1:
        raise ValueError("h must be a floating-point tensor of shape [..., N]")
    h2 = h.reshape(-1, h.shape[-1])
    m, n = h2.shape
    _check_tiling(n, tile_n, slots)
    active = h2 != 0
    counts = active.reshape(m, n // tile_n, tile_n).sum(dim=-1, dtype=torch.int32)
    return _stats_from_counts(counts, (counts > slots).any(dim=1), active.any(dim=0), slots)


# ----------------------------------------------------------------------------------------
# FFN through TwELL
# ----------------------------------------------------------------------------------------
def _twell_entries(tw: TwELL, h: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, global cols, activation values) of the valid entries of tw outside the dense rows,
    sorted by (row, col)."""
    valid = tw.valid_mask() & ~dense[:, None, None]
    values, local = unpack_words(tw.packed)
    r, t, s = valid.nonzero(as_tuple=True)
    cols = t.to(torch.int64) * tw.tile_n + local[r, t, s].to(torch.int64)
    if h.dtype == torch.bfloat16 and not h.requires_grad:
        vals = values[r, t, s]  # the stored bf16 equals h exactly
    else:
        # TwELL stores bf16; to keep wider-dtype references exact (the CUDA path is bf16 only)
        # and to keep autograd's graph through h, read the value at the decoded position from h.
        vals = h[r, cols]
    order = (r * tw.n_cols + cols).argsort()  # kernels may write a tile's slots in any order
    return r[order], cols[order], vals[order]


def _ffn_twell(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor,
               tile_n: int, slots: int, return_stats: bool, method: str | None):
    gated = w_gate is not None
    named = ([("w_gate", w_gate, "[N, K]")] if gated else []) + [("w_up", w_up, "[N, K]"), ("w_down", w_down, "[K, N]")]
    k, n, k_out = _check_ffn_args(x, named)
    _check_tiling(n, tile_n, slots)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    g = F.linear(x2, w_gate if gated else w_up)
    h = F.relu(g)
    tw = d2t(h, tile_n, slots)
    # Overflowing rows (incomplete words) and the non-finite rule's rows take the dense ops (exact).
    dense = tw.overflow_mask() | dense_rows_mask(g, w_up if gated else None, w_down, x2)
    out = torch.zeros(x2.shape[0], k_out, dtype=_acc_dtype(x.dtype), device=x.device)
    rows, cols, vals = _twell_entries(tw, h, dense)
    _sparse_rows_ffn(x2, rows, cols, vals, w_up if gated else None, w_down, out, method)
    y = out.to(x.dtype)
    rd = dense.nonzero().flatten()
    if rd.numel():
        y[rd] = dense_rows_forward(x2[rd], h[rd], w_up if gated else None, w_down)[1]
    y = y.reshape(*lead, k_out)
    if not return_stats:
        return y
    return y, _stats_from_counts(tw.counts, tw.overflow_mask(), (h != 0).any(dim=0), slots)


def gated_ffn_twell(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                    tile_n: int = 256, slots: int = 32, *, return_stats: bool = False,
                    method: str | None = None):
    """Gated FFN computed through TwELL; equals gated_ffn_dense up to summation order.

    gate GEMM -> relu -> d2t; for every non-overflowing row only its active neurons are used
    (u_j = x . w_up[j], h_j = g_j u_j, y = sum_j h_j w_down[:, j]); overflowing rows are
    computed densely, and so are the rows of dense_rows_mask (non-finite values). x is [..., K];
    returns [..., K_out] (and a stats dict if return_stats,
    see activation_stats). method: None (auto), "csr" or "gather" (sparse core backend).
    """
    return _ffn_twell(x, w_gate, w_up, w_down, tile_n, slots, return_stats, method)


def nongated_ffn_twell(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                       tile_n: int = 256, slots: int = 32, *, return_stats: bool = False,
                       method: str | None = None):
    """Non-gated FFN y = relu(x w_up^T) w_down^T computed through TwELL (see gated_ffn_twell)."""
    return _ffn_twell(x, None, w_up, w_down, tile_n, slots, return_stats, method)


# ----------------------------------------------------------------------------------------
# FFN through Hybrid
# ----------------------------------------------------------------------------------------
def _hybrid_entries(hy: Hybrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, slots, global cols, values) of the light rows' ELL entries, sorted by (row, col)."""
    rows, slot = hy.valid_mask().nonzero(as_tuple=True)
    cols = hy.ell_col[rows, slot].to(torch.int64)
    order = (rows * hy.n_cols + cols).argsort()  # producers may write a row's slots in any order
    rows, slot, cols = rows[order], slot[order], cols[order]
    return rows, slot, cols, hy.ell_val[rows, slot]


def _ffn_hybrid(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor,
                width: int, return_stats: bool, method: str | None):
    gated = w_gate is not None
    named = ([("w_gate", w_gate, "[N, K]")] if gated else []) + [("w_up", w_up, "[N, K]"), ("w_down", w_down, "[K, N]")]
    k, n, k_out = _check_ffn_args(x, named)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    g = F.linear(x2, w_gate if gated else w_up)
    h = F.relu(g)
    hy = d2h(h, width, keep_dense=dense_rows_mask(g, w_up if gated else None, w_down, x2))
    rows, _, cols, vals = _hybrid_entries(hy)
    out = torch.zeros(x2.shape[0], k_out, dtype=_acc_dtype(x.dtype), device=x.device)
    _sparse_rows_ffn(x2, rows, cols, vals, w_up if gated else None, w_down, out, method)
    y = out.to(x.dtype)
    br = hy.backup_rows
    if br.numel():  # heavy rows and the non-finite rule's rows: dense math on the backup block
        y[br] = dense_rows_forward(x2[br], hy.backup, w_up if gated else None, w_down)[1]
    y = y.reshape(*lead, k_out)
    if not return_stats:
        return y
    stats = _stats_from_counts(hy.nnz.unsqueeze(1), hy.overflow_mask(), (h != 0).any(dim=0), None)
    stats["width"] = width
    return y, stats


def gated_ffn_hybrid(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     width: int = 128, *, return_stats: bool = False, method: str | None = None):
    """Gated FFN computed through the Hybrid format (ELL rows sparse, backup rows dense)."""
    return _ffn_hybrid(x, w_gate, w_up, w_down, width, return_stats, method)


def nongated_ffn_hybrid(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        width: int = 128, *, return_stats: bool = False, method: str | None = None):
    """Non-gated FFN computed through the Hybrid format."""
    return _ffn_hybrid(x, None, w_up, w_down, width, return_stats, method)


# ----------------------------------------------------------------------------------------
# The training op (kernels/train, kernels/train_ffn.py): forward, saved state, backward
# ----------------------------------------------------------------------------------------
@dataclass
class TrainSaved:
    """What the training forward keeps for the backward of one call (besides x and the weights).

    hy:    the Hybrid form of a = relu(g); its backup rows are the heavy rows plus dense_rows_mask's.
    ell_u: [M, width] u_e = x_r . w_up[j] at every stored ELL entry (accumulation dtype; padding 0);
           [0, 0] for the non-gated block.
    Dense autograd keeps three [M, N] tensors instead (a, u, h).
    """

    hy: Hybrid
    ell_u: torch.Tensor


def _entry_chunks(n_entries: int, k: int):
    """Slices of the entry list that bound the gathered [E, K] temporaries to ~4M elements."""
    step = max(1, (1 << 22) // max(1, k))
    for s in range(0, n_entries, step):
        yield slice(s, min(n_entries, s + step))


def _hybrid_rows(hy: Hybrid, rows: torch.Tensor) -> torch.Tensor:
    """Dense [R, N] values of the given rows of hy (ELL rows decoded, backup rows copied)."""
    n = hy.n_cols
    valid = hy.valid_mask()[rows]
    zero = torch.zeros((), dtype=hy.ell_val.dtype, device=hy.device)
    out = torch.zeros(rows.numel(), n + 1, dtype=hy.ell_val.dtype, device=hy.device)
    out.scatter_(1, torch.where(valid, hy.ell_col[rows], n).long(), torch.where(valid, hy.ell_val[rows], zero))
    out = out[:, :n]
    in_backup = hy.backup_mask()[rows]
    out[in_backup] = hy.backup[torch.searchsorted(hy.backup_rows, rows[in_backup])]
    return out


def dense_rows_backward(x_rows: torch.Tensor, a_rows: torch.Tensor, dy_rows: torch.Tensor,
                        w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor, c: torch.Tensor):
    """Dense autograd's backward of some rows, op for op: (dx_rows, dW_g part or None, dW_u part, dW_d part
    TRANSPOSED, i.e. neuron-major [N, K]). The CUDA training op's backup rows run these ops one for one
    (kernels/train/binding.cpp, ffn_bwd).

    c = dL/dl1 * scale. abs's backward is grad * sgn(h) (torch: sgn(NaN) = 0); relu's is
    threshold_backward(grad, a, 0): exactly 0 where a <= 0, even where grad is NaN or Inf, and grad
    elsewhere (a NaN a passes it). A mask product (grad * (a > 0)) would turn 0 * Inf into NaN there.
    """
    gated = w_gate is not None
    u = F.linear(x_rows, w_up) if gated else None
    h = a_rows * u if gated else a_rows
    dh = dy_rows @ w_down + c.to(h.dtype) * h.sgn()
    da = dh * u if gated else dh
    dg = torch.where(a_rows <= 0, torch.zeros_like(da), da)
    dx = dg @ (w_gate if gated else w_up)
    if gated:
        du = dh * a_rows
        dx = dx + du @ w_up
        return dx, dg.t() @ x_rows, du.t() @ x_rows, h.t() @ dy_rows
    return dx, None, dg.t() @ x_rows, h.t() @ dy_rows


def train_ffn_forward(x: torch.Tensor, w_gate: torch.Tensor | None, w_up: torch.Tensor, w_down: torch.Tensor,
                      width: int = 128, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, TrainSaved]:
    """The training op's forward: (y, l1 = scale * sum |h|, saved state for train_ffn_backward).

    x [M, K], weights in nn.Linear layouts; w_gate None = the non-gated block (h = relu(x w_up^T)).
    a = relu(g) is kept as a Hybrid of `width` slots. Its backup rows (heavy rows, dense_rows_mask)
    are computed by the dense FFN's ops. A light row touches only its active neurons:
    u_e = x_r . w_up[j] (kept in ell_u), h_e = a_e u_e, y_r = sum_e h_e w_down[:, j]. u, h and the
    sums stay in the accumulation dtype (fp32; fp64 for fp64 inputs), as in the CUDA kernels.
    """
    gated = w_gate is not None
    w_up_gated = w_up if gated else None
    m, k = x.shape
    acc = _acc_dtype(x.dtype)
    g = F.linear(x, w_gate if gated else w_up)
    a = F.relu(g)
    hy = d2h(a, width, keep_dense=dense_rows_mask(g, w_up_gated, w_down, x))
    y = torch.zeros(m, w_down.shape[0], dtype=acc, device=x.device)
    ell_u = torch.zeros(hy.ell_col.shape if gated else (0, 0), dtype=acc, device=x.device)
    l1 = torch.zeros((), dtype=acc, device=x.device)
    rows, slot, cols, a_e = _hybrid_entries(hy)
    for e in _entry_chunks(rows.numel(), k):
        r, j, h = rows[e], cols[e], a_e[e].to(acc)
        if gated:
            u = (x[r].to(acc) * w_up[j].to(acc)).sum(-1)
            ell_u[r, slot[e]] = u
            h = h * u
        y.index_add_(0, r, w_down.t()[j].to(acc) * h.unsqueeze(1))
        l1 = l1 + h.abs().sum()
    y = y.to(x.dtype)
    br = hy.backup_rows
    if br.numel():
        h_b, y_b = dense_rows_forward(x[br], hy.backup, w_up_gated, w_down)
        y[br] = y_b
        l1 = l1 + h_b.abs().sum(dtype=acc)
    return y, l1 * scale, TrainSaved(hy, ell_u)


def train_ffn_backward(dy: torch.Tensor, gl1: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor | None,
                       w_up: torch.Tensor, w_down: torch.Tensor, saved: TrainSaved, scale: float = 1.0):
    """Gradients of <dy, y> + gl1 * l1 for train_ffn_forward: (dx, dw_gate or None, dw_up, dw_down).

    Weight gradients are in nn.Linear layouts. With c = gl1 * scale, a light row's stored entry e
    (row r, neuron j) gives dh_e = dy_r . w_down[:, j] + c sgn(h_e); gated: dg_e = dh_e u_e and
    du_e = dh_e a_e, non-gated: dg_e = dh_e; then dx_r += dg_e w_gate[j] + du_e w_up[j],
    dW_g[j] += dg_e x_r, dW_u[j] += du_e x_r, dW_d[:, j] += h_e dy_r. Its inactive neurons add
    exactly 0 as long as dy_r and c are finite. So these rows take dense autograd's ops instead:
    the forward's backup rows, rows whose dy has a non-finite value, and every row when c is not
    finite (FORMAT.md, "Non-finite values").
    """
    gated = w_gate is not None
    hy = saved.hy
    m, k = x.shape
    n = w_up.shape[0]
    acc = _acc_dtype(x.dtype)
    dy = dy.to(x.dtype)
    c = gl1.reshape(()).to(acc) * scale
    dense = hy.backup_mask() | ~torch.isfinite(dy).all(dim=1)
    if not bool(torch.isfinite(c)):
        dense = torch.ones_like(dense)
    dx = torch.zeros(m, k, dtype=acc, device=x.device)
    dwg = torch.zeros(n if gated else 0, k, dtype=acc, device=x.device)
    dwu = torch.zeros(n, k, dtype=acc, device=x.device)
    dwd_t = torch.zeros(n, dy.shape[1], dtype=acc, device=x.device)  # neuron-major: row j = dW_d[:, j]
    rows, slot, cols, a_e = _hybrid_entries(hy)
    light = ~dense[rows]
    rows, slot, cols, a_e = rows[light], slot[light], cols[light], a_e[light]
    for e in _entry_chunks(rows.numel(), k):
        r, j, a = rows[e], cols[e], a_e[e].to(acc)
        dy_r, x_r = dy[r].to(acc), x[r].to(acc)
        dh = (dy_r * w_down.t()[j].to(acc)).sum(-1)
        if gated:
            u = saved.ell_u[r, slot[e]]
            h = a * u
            dh = dh + c * h.sgn()
            dg, du = dh * u, dh * a
            dx.index_add_(0, r, w_gate[j].to(acc) * dg.unsqueeze(1) + w_up[j].to(acc) * du.unsqueeze(1))
            dwg.index_add_(0, j, x_r * dg.unsqueeze(1))
            dwu.index_add_(0, j, x_r * du.unsqueeze(1))
        else:
            h = a
            dg = dh + c * h.sgn()
            dx.index_add_(0, r, w_up[j].to(acc) * dg.unsqueeze(1))
            dwu.index_add_(0, j, x_r * dg.unsqueeze(1))
        dwd_t.index_add_(0, j, dy_r * h.unsqueeze(1))
    rd = dense.nonzero().flatten()
    if rd.numel():
        a_rows = _hybrid_rows(hy, rd)  # exactly the forward's a (decoded from the ELL, or the backup)
        dx_d, dwg_d, dwu_d, dwd_t_d = dense_rows_backward(x[rd], a_rows, dy[rd], w_gate, w_up, w_down, c)
        dx[rd] = dx_d.to(acc)
        if gated:
            dwg += dwg_d.to(acc)
        dwu += dwu_d.to(acc)
        dwd_t += dwd_t_d.to(acc)
    dt = x.dtype
    return dx.to(dt), (dwg.to(dt) if gated else None), dwu.to(dt), dwd_t.t().contiguous().to(dt)


def csr_by_neuron(hy: Hybrid) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose of the light ELL entries, for per-neuron weight gradients: (perm, colptr).

    perm: int64 [M * width], flat ELL indices (row * width + slot) sorted by neuron; the entries of
    neuron j are perm[colptr[j]:colptr[j + 1]], rows ascending (a stable sort: deterministic sums).
    colptr: int64 [N + 1]. Core ops only and no host sync (the CUDA backward uses it as is).
    """
    keys = torch.where(hy.valid_mask(), hy.ell_col, hy.n_cols).flatten()
    sorted_keys, perm = torch.sort(keys, stable=True)
    colptr = torch.searchsorted(sorted_keys, torch.arange(hy.n_cols + 1, device=keys.device, dtype=keys.dtype))
    return perm, colptr
