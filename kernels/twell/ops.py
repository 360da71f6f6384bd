"""torch.library custom ops for the TwELL inference kernels, with fake (meta) implementations.

Ops (namespace ``sfl_twell``):
- ``d2t(x, w_gate, slots) -> (packed, counts, flag)``: h = ReLU(x w_gate^T) in TwELL (tile 256).
- ``gated_ffn(x, w_gate, w_up, w_down_t, w_down, mode, activity_hint, want_stats) -> (y, nnz)``
- ``nongated_ffn(x, w_up, w_down_t, w_down, mode, activity_hint, want_stats) -> (y, nnz)``

Paths (kernels/README.md has the full story):
- eager, M > decode_max_m: chunked cuBLAS gate GEMM into an L2-sized bf16 scratch, compaction to TwELL with
  S = slots (default 32 = C 8), one host sync after the first chunk for dispatch (measured activity), sparse
  up/down kernels, then one sync to gather the flagged rows (tile overflow or non-finite gate) and compute
  them exactly with dense cuBLAS (bf16, same math as PyTorch).
- sync-free (M <= decode_max_m, or while a CUDA graph is being captured): S = 256 (lossless: no row can
  overflow), dispatch from ``activity_hint``, rows with a non-finite gate pre-activation become NaN.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

TILE_N = 256
# path taken by the last call (for benchmarks/logs): "dense", "sparse", "sparse-syncfree"; not thread-safe
LAST_PATH = {"path": None, "flagged_rows": None}
MODE_AUTO, MODE_SPARSE, MODE_DENSE = 0, 1, 2


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def knobs() -> dict[str, float]:
    """Current knob values (env vars read at call time so a benchmark can sweep them)."""
    return {
        "chunk_rows": _env_int("TWELL_CHUNK_ROWS", 4096),
        "slots": _env_int("TWELL_SLOTS", 32),
        "decode_max_m": _env_int("TWELL_DECODE_MAX_M", 64),
        "dense_above": _env_float("TWELL_DENSE_ABOVE", 0.007),
        "probe_rows": _env_int("TWELL_PROBE_ROWS", 1024),
        "syncfree_sparse_max_m": _env_int("TWELL_SYNCFREE_SPARSE_MAX_M", 16),
        "flagged_dense_above": _env_float("TWELL_FLAGGED_DENSE_ABOVE", 0.3),
        "down_nb": _env_int("TWELL_DOWN_NB", 4),
        "decode_tiles_per_warp": _env_int("TWELL_DECODE_TILES_PER_WARP", 4),
    }


def _ext():
    from kernels.loader import load_twell

    return load_twell()


def _dense(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, want_h: bool):
    """Dense bf16 FFN exactly as HF computes it (three/two F.linear)."""
    if w_gate is not None:
        h = F.relu(F.linear(x, w_gate))
        y = F.linear(h * F.linear(x, w_up), w_down)
    else:
        h = F.relu(F.linear(x, w_up))
        y = F.linear(h, w_down)
    return y, (h if want_h else None)


def _dense_from_pre(g: Tensor, x: Tensor, gated: bool, w_up: Tensor, w_down: Tensor):
    h = F.relu(g)
    hu = h * F.linear(x, w_up) if gated else h
    return F.linear(hu, w_down), h


def _gate_chunks(x: Tensor, w: Tensor, packed: Tensor, counts: Tensor, flag: Tensor, chunk: int, ext,
                 start: int = 0, scratch: Tensor | None = None) -> Tensor:
    """Gate GEMM chunk by chunk into a reused scratch (stays in L2), compacting each chunk to TwELL."""
    M, N = x.shape[0], w.shape[0]
    if scratch is None:
        scratch = torch.empty(min(chunk, M), N, device=x.device, dtype=torch.bfloat16)
    for c0 in range(start, M, chunk):
        c1 = min(M, c0 + chunk)
        g = scratch[: c1 - c0]
        torch.mm(x[c0:c1], w.t(), out=g)
        ext.compact(g, N, packed[c0:c1], counts[c0:c1], flag[c0:c1])
    return scratch


def _ffn_impl(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down_t: Tensor, w_down: Tensor, mode: int,
              activity_hint: float, want_stats: bool) -> tuple[Tensor, Tensor]:
    kn = knobs()
    M, K = x.shape
    N = w_up.shape[0]
    T = N // TILE_N
    gated = w_gate is not None
    gate_w = w_gate if gated else w_up
    dev = x.device
    empty_stats = torch.empty(0, device=dev, dtype=torch.int32)
    if M == 0:
        return x.new_empty(0, K), (torch.empty(0, device=dev, dtype=torch.int32) if want_stats else empty_stats)
    capturing = torch.cuda.is_current_stream_capturing()
    sync_free = capturing or M <= kn["decode_max_m"]

    small_dense = capturing is False and kn["syncfree_sparse_max_m"] < M <= kn["decode_max_m"]
    if mode == MODE_DENSE or (sync_free and mode == MODE_AUTO and (activity_hint > kn["dense_above"] or small_dense)):
        y, h = _dense(x, w_gate, w_up, w_down, want_stats)
        nnz = (h != 0).sum(1, dtype=torch.int32) if want_stats else empty_stats
        LAST_PATH.update(path="dense", flagged_rows=None)
        return y, nnz

    ext = _ext()
    chunk = max(1, kn["chunk_rows"])
    S = TILE_N if sync_free else kn["slots"]
    if not 1 <= S <= TILE_N:
        raise ValueError(f"TWELL_SLOTS must be in 1..{TILE_N}, got {S}")
    if not sync_free and mode == MODE_AUTO:
        # probe the first rows (gate GEMM + compaction of <= probe_rows rows into small buffers, one host sync);
        # go dense for the whole call when the measured activity says sparse would not win. Nothing of size M is
        # allocated before this decision, so the dense path costs dense + the probe.
        P = min(M, max(1, kn["probe_rows"]))
        pp = torch.empty(P, T, S, device=dev, dtype=torch.int32)
        pc = torch.empty(P, T, device=dev, dtype=torch.int32)
        pf = torch.zeros(P, device=dev, dtype=torch.int32)
        _gate_chunks(x[:P], gate_w, pp, pc, pf, P, ext)
        bad = pf != 0
        nnz_ok, n_bad = torch.stack([(pc.sum(1) * (~bad)).sum(), bad.sum()]).tolist()
        del pp, pc, pf
        p = nnz_ok / (max(1, P - n_bad) * N)
        if p > kn["dense_above"] or n_bad / P > kn["flagged_dense_above"]:
            y, h = _dense(x, w_gate, w_up, w_down, want_stats)
            LAST_PATH.update(path="dense", flagged_rows=None)
            return y, ((h != 0).sum(1, dtype=torch.int32) if want_stats else empty_stats)

    packed = torch.empty(M, T, S, device=dev, dtype=torch.int32)
    counts = torch.empty(M, T, device=dev, dtype=torch.int32)
    flag = torch.zeros(M, device=dev, dtype=torch.int32)
    y = torch.empty(M, K, device=dev, dtype=torch.bfloat16)

    if sync_free:
        _gate_chunks(x, gate_w, packed, counts, flag, chunk, ext)
        hval = torch.empty(0, device=dev, dtype=torch.float32)
        if gated:
            hval = torch.empty(M, T, S, device=dev, dtype=torch.float32)
            ext.gated_up(x, w_up, packed, counts, flag, hval, 1 if M <= kn["decode_max_m"] else T)
        tpw = max(1, min(T, kn["decode_tiles_per_warp"]))
        if M <= kn["decode_max_m"] and tpw < T:
            # few rows: split tiles across warps (parallelism), fp32 atomics, then convert
            yacc = torch.zeros(M, K, device=dev, dtype=torch.float32)
            ext.down(w_down_t, packed, counts, flag, hval, y, yacc, 1, tpw, 1)
            ext.finalize(yacc, flag, y, 1)
        elif M <= kn["decode_max_m"]:
            ext.down(w_down_t, packed, counts, flag, hval, y, torch.empty(0, device=dev), 1, T, 1)
        else:
            ext.down(w_down_t, packed, counts, flag, hval, y, torch.empty(0, device=dev), kn["down_nb"], T, 1)
        LAST_PATH.update(path="sparse-syncfree", flagged_rows=None)
        return y, (counts.sum(1, dtype=torch.int32) if want_stats else empty_stats)

    # eager large-M path: whole gate in L2-sized chunks, sparse up/down, exact dense backup of flagged rows
    _gate_chunks(x, gate_w, packed, counts, flag, chunk, ext)
    hval = torch.empty(0, device=dev, dtype=torch.float32)
    if gated:
        hval = torch.empty(M, T, S, device=dev, dtype=torch.float32)
        ext.gated_up(x, w_up, packed, counts, flag, hval, T)
    ext.down(w_down_t, packed, counts, flag, hval, y, torch.empty(0, device=dev), kn["down_nb"], T, 0)
    rows = torch.nonzero(flag).squeeze(1)  # host sync: the backup must cover every flagged row, however many
    if rows.numel() > 0:
        yb, _ = _dense(x.index_select(0, rows), w_gate, w_up, w_down, False)
        y.index_copy_(0, rows, yb)
    LAST_PATH.update(path="sparse", flagged_rows=int(rows.numel()))
    return y, (counts.sum(1, dtype=torch.int32) if want_stats else empty_stats)


# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("sfl_twell::d2t", mutates_args=())
def d2t(x: Tensor, w_gate: Tensor, slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """TwELL of ReLU(x w_gate^T): packed int32 [M, T, slots], counts int32 [M, T], flag int32 [M]."""
    M, N = x.shape[0], w_gate.shape[0]
    T = N // TILE_N
    packed = torch.empty(M, T, slots, device=x.device, dtype=torch.int32)
    counts = torch.empty(M, T, device=x.device, dtype=torch.int32)
    flag = torch.zeros(M, device=x.device, dtype=torch.int32)
    if M > 0:
        _gate_chunks(x, w_gate, packed, counts, flag, max(1, knobs()["chunk_rows"]), _ext())
    return packed, counts, flag


@d2t.register_fake
def _(x: Tensor, w_gate: Tensor, slots: int):
    M, N = x.shape[0], w_gate.shape[0]
    T = N // TILE_N
    return (x.new_empty(M, T, slots, dtype=torch.int32), x.new_empty(M, T, dtype=torch.int32),
            x.new_empty(M, dtype=torch.int32))


@torch.library.custom_op("sfl_twell::gated_ffn", mutates_args=())
def gated_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, w_down: Tensor, mode: int,
              activity_hint: float, want_stats: bool) -> tuple[Tensor, Tensor]:
    return _ffn_impl(x, w_gate, w_up, w_down_t, w_down, mode, activity_hint, want_stats)


@gated_ffn.register_fake
def _(x, w_gate, w_up, w_down_t, w_down, mode, activity_hint, want_stats):
    return x.new_empty(x.shape[0], x.shape[1]), x.new_empty(x.shape[0] if want_stats else 0, dtype=torch.int32)


@torch.library.custom_op("sfl_twell::nongated_ffn", mutates_args=())
def nongated_ffn(x: Tensor, w_up: Tensor, w_down_t: Tensor, w_down: Tensor, mode: int, activity_hint: float,
                 want_stats: bool) -> tuple[Tensor, Tensor]:
    return _ffn_impl(x, None, w_up, w_down_t, w_down, mode, activity_hint, want_stats)


@nongated_ffn.register_fake
def _(x, w_up, w_down_t, w_down, mode, activity_hint, want_stats):
    return x.new_empty(x.shape[0], x.shape[1]), x.new_empty(x.shape[0] if want_stats else 0, dtype=torch.int32)
