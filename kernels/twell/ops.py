"""torch.library custom ops for the TwELL inference kernels, with fake (meta) implementations.

Ops (namespace ``sfl_twell``):
- ``d2t(x, w_gate, slots) -> (packed, counts, flag)``: h = ReLU(x w_gate^T) in TwELL (tile 256).
- ``gated_ffn(x, w_gate, w_up, w_down_t, w_down, mode, activity_hint, want_stats) -> (y, nnz)``
- ``nongated_ffn(x, w_up, w_down_t, w_down, mode, activity_hint, want_stats) -> (y, nnz)``

Paths (kernels/README.md has the full story):
- d2t (every sparse path but fused decode): on sm_90 the fused kernel (d2t_gemm.cu: tensor-core gate GEMM whose
  epilogue writes TwELL, no dense gate output in memory); elsewhere, or TWELL_D2T=cublas, a cuBLAS gate GEMM into a
  transient bf16 buffer (all rows when it fits the scratch budget, else chunks) and the compaction kernel.
- eager, M > decode_max_m: d2t with S = slots (default 32 = C 8), sparse up/down, and
  the rows flagged by compaction (tile overflow or non-finite gate) computed exactly with dense cuBLAS. The
  number of flagged rows reaches the host through a pinned copy that is waited on only after the up/down
  kernels are queued, so the GPU never idles on it.
- sync-free (M <= decode_max_m, or while a CUDA graph is being captured): S = 256 (lossless: no row can
  overflow), rows with a non-finite gate pre-activation become NaN.
- dense: cuBLAS GEMMs as HF computes them, with relu(g) * u fused into one in-place pass (fewer bytes than
  torch's relu then mul, same bits) that also measures the activity exactly.
- dispatch (mode auto): a per-weight history of measured activity (LayerHistory) picks sparse or dense with a
  crossover per M bucket. Both paths measure exactly and read back asynchronously (pinned buffer + event), used
  on the next call. No host sync.
"""
from __future__ import annotations

import bisect
import os
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor

TILE_N = 256
# path taken by the last call (for benchmarks/logs): "dense", "sparse", "sparse-syncfree"; not thread-safe
LAST_PATH = {"path": None, "flagged_rows": None, "p_est": None, "d2t": None}
MODE_AUTO, MODE_SPARSE, MODE_DENSE = 0, 1, 2

# Crossover per M bucket: "m:p,..." = for M >= m (largest such m), run sparse when the measured activity is
# <= p. Calibrated on the H100 against our dense path with the fused d2t (bash experiments/kernel_bench/calibrate.sh:
# the elementwise minimum of two runs, results/kernel_bench/calibration/calib_h100_r9{a,b}.jsonl); see
# kernels/README.md.
DEFAULT_CROSSOVER = ("1:0.0152,4:0.0193,8:0.0202,16:0.0019,32:0.002,64:0.0019,256:0,1024:0,4096:0.0025,8192:0.0025,"
                     "16384:0.0045,32768:0.0055,65536:0.0069")
# The non-gated block (relu(x W_u^T) W_d^T; no up-projection gather, so sparse wins to higher activity): its own
# table, calibrated the same way at K = 2048, N = 8192 (one run, calib_nongated_h100_r9.jsonl).
DEFAULT_CROSSOVER_NONGATED = ("1:0.0164,4:0.0184,8:0,16:0.0021,32:0,64:0.0018,256:0,1024:0.0025,4096:0.0044,"
                              "8192:0.0054,16384:0.0082,32768:0.0095,65536:0.0105")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


_KNOB_ENV = ("TWELL_CHUNK_ROWS", "TWELL_GATE_SCRATCH_MB", "TWELL_SLOTS", "TWELL_DECODE_MAX_M", "TWELL_CROSSOVER",
             "TWELL_FLAGGED_DENSE_ABOVE", "TWELL_DOWN_NB", "TWELL_DECODE_TILES_PER_WARP",
             "TWELL_FUSED_DECODE_MAX_M", "TWELL_UPDOWN_BLOCKS_PER_SM", "TWELL_COMPACT",
             "TWELL_SELF_TIMING", "TWELL_CROSSOVER_NONGATED", "TWELL_D2T", "TWELL_D2T_CTAS", "TWELL_D2T_OVERLAP_MIN_K",
             "TWELL_NONGATED_MEASURE_EVERY", "TWELL_PROMOTE_BAND")
_KNOB_CACHE: dict = {}


def _parse_knobs() -> dict:
    return {
        "chunk_rows": _env_int("TWELL_CHUNK_ROWS", 0),
        "gate_scratch_mb": _env_int("TWELL_GATE_SCRATCH_MB", 1024),
        "slots": _env_int("TWELL_SLOTS", 32),
        "decode_max_m": _env_int("TWELL_DECODE_MAX_M", 64),
        "crossover": os.environ.get("TWELL_CROSSOVER", DEFAULT_CROSSOVER),
        "crossover_nongated": os.environ.get("TWELL_CROSSOVER_NONGATED", DEFAULT_CROSSOVER_NONGATED),
        "flagged_dense_above": _env_float("TWELL_FLAGGED_DENSE_ABOVE", 0.05),
        "down_nb": _env_int("TWELL_DOWN_NB", 4),
        "decode_tiles_per_warp": _env_int("TWELL_DECODE_TILES_PER_WARP", 4),
        "fused_decode_max_m": _env_int("TWELL_FUSED_DECODE_MAX_M", 8),
        "updown_blocks_per_sm": _env_int("TWELL_UPDOWN_BLOCKS_PER_SM", 0),
        "compact": _env_int("TWELL_COMPACT", 2),
        "self_timing": _env_int("TWELL_SELF_TIMING", 1),
        "d2t": os.environ.get("TWELL_D2T", "fused"),
        "d2t_ctas": _env_int("TWELL_D2T_CTAS", 0),
        "d2t_overlap_min_k": _env_int("TWELL_D2T_OVERLAP_MIN_K", 4096),
        "nongated_measure_every": _env_int("TWELL_NONGATED_MEASURE_EVERY", 16),
        # off by default: timing samples are not tied to the activity they were measured at, so a stale sample can
        # promote a slower sparse path (kernels/README.md, KNOBS)
        "promote_band": _env_float("TWELL_PROMOTE_BAND", 0.0),
    }


def knobs() -> dict:
    """Current knob values. Env vars are read at every call (a benchmark can sweep them); the parsed values are
    cached on the raw strings, which keeps this cheap: host time before the first launch is GPU idle time."""
    data = getattr(os.environ, "_data", None)  # CPython's raw bytes dict: no encode/decode per lookup
    if data is None:
        return _parse_knobs()
    key = tuple(data.get(k) for k in _KNOB_ENV_B)
    kn = _KNOB_CACHE.get(key)
    if kn is None:
        if len(_KNOB_CACHE) > 64:
            _KNOB_CACHE.clear()
        kn = _KNOB_CACHE[key] = _parse_knobs()
    return dict(kn)


_KNOB_ENV_B = tuple(os.environ.encodekey(k) if hasattr(os.environ, "encodekey") else k for k in _KNOB_ENV)


_XO_CACHE: dict[str, tuple[list[int], list[float]]] = {}


def crossover(M: int, spec: str | None = None) -> float:
    """Largest activity at which auto runs sparse for M rows (from the TWELL_CROSSOVER table)."""
    spec = spec if spec is not None else knobs()["crossover"]
    tab = _XO_CACHE.get(spec)
    if tab is None:
        try:
            pairs = sorted((int(a), float(b)) for a, b in (kv.split(":") for kv in spec.split(",") if kv.strip()))
        except ValueError as e:
            raise ValueError(f"TWELL_CROSSOVER={spec!r} must look like '1:0.012,17:0,32768:0.006' "
                             f"(M bucket start : max activity for sparse)") from e
        if not pairs or pairs[0][0] > 1:
            pairs.insert(0, (1, 0.0))
        tab = ([m for m, _ in pairs], [q for _, q in pairs])
        _XO_CACHE[spec] = tab
    i = bisect.bisect_right(tab[0], M) - 1
    return tab[1][max(0, i)]


# ------------------------------------------------------------------------------------------------------
class LayerHistory:
    """Measured activity of one gate weight (one layer): what auto dispatch decides from.

    ``p``: active fraction of the unflagged rows of the last measurement (None before the first one);
    ``f``: fraction of rows that were flagged (would overflow S slots, or non-finite). Measurements are
    enqueued on the stream and copied into a pinned buffer owned by this history (allocated on the layer's
    first call, then reused: no allocation, no sync); ``poll`` picks them up once their event completed, so
    the estimate lags by one call (more when the host runs far ahead of the GPU, in which case a new
    measurement is skipped until the previous one landed).
    """

    HOST_WORDS = 4  # int32 words per pinned slot: one int64 [2] measurement

    def __init__(self) -> None:
        self.p: float | None = None
        self.f: float = 0.0
        self.measurements = 0
        self.sparse_calls = 0
        self.dense_calls = 0
        self._pending: tuple | None = None
        self._host: list[Tensor] | None = None
        self._events: list[torch.cuda.Event] | None = None
        # self-timing (below): (M bucket, path) -> last GPU times in ms; timed calls in flight; calls per bucket
        self.times: dict[tuple[int, str], list[float]] = {}
        self._tpending: list[tuple] = []
        self.bucket_calls: dict[int, int] = {}

    def busy(self) -> bool:
        """True while the previous asynchronous measurement has not been read back yet."""
        return self._pending is not None

    def poll(self) -> None:
        pend = self._pending
        if pend is None or not pend[0].query():
            return
        self._pending = None
        _, buf, kind, rows, n = pend
        nnz_ok, n_bad = buf.tolist()  # int64 [2]: (nnz over unflagged rows, flagged rows)
        self.update(nnz_ok, n_bad, rows, n)

    def update(self, nnz_ok: int, n_bad: int, rows: int, n: int) -> None:
        self.p = 1.0 if rows == n_bad else nnz_ok / ((rows - n_bad) * n)
        self.f = n_bad / max(1, rows)
        self.measurements += 1

    def to_host(self, t: Tensor, slot: int) -> tuple[torch.cuda.Event, Tensor]:
        """Copy a small device tensor into pinned slot `slot` (0: asynchronous, 1: waited on in the call)."""
        if self._host is None:
            self._host = [torch.empty(self.HOST_WORDS, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        buf = self._host[slot].view(t.dtype)[: t.numel()].view(t.shape)
        buf.copy_(t, non_blocking=True)
        ev = self._events[slot]
        ev.record()
        return ev, buf

    def expect(self, event: torch.cuda.Event, buf: Tensor, kind: str, rows: int, n: int) -> None:
        self._pending = (event, buf, kind, rows, n)

    # ---- self-timing: the crossover table is calibrated on one shape and GPU; these timings catch the cases where
    # it is wrong for this layer (another shape, another GPU, a heavy-row profile) so auto never stays on the
    # slower path. Per M bucket (power of two) and path, the last few GPU times of timed calls (CUDA events, read
    # back without a sync like the activity).
    TIMING_KEEP = 3       # samples kept per (bucket, path); decisions use their minimum (robust to warm-up)
    REPROBE_EVERY = 256   # a bucket where sparse was measured slower runs sparse again every this many calls

    def count_call(self, bucket: int) -> int:
        n = self.bucket_calls.get(bucket, 0) + 1
        self.bucket_calls[bucket] = n
        return n

    def want_timing(self, bucket: int, path: str) -> bool:
        if len(self._tpending) >= 4:
            return False
        return len(self.times.get((bucket, path), ())) < self.TIMING_KEEP or self.bucket_calls.get(bucket, 0) % 64 == 0

    def add_timing(self, start: torch.cuda.Event, end: torch.cuda.Event, bucket: int, path: str) -> None:
        self._tpending.append((start, end, bucket, path))

    def poll_timings(self) -> None:
        keep = []
        for start, end, bucket, path in self._tpending:
            if end.query():
                self.add_sample(bucket, path, start.elapsed_time(end))
            else:
                keep.append((start, end, bucket, path))
        self._tpending = keep

    def add_sample(self, bucket: int, path: str, ms: float) -> None:
        lst = self.times.setdefault((bucket, path), [])
        lst.append(ms)
        del lst[: -self.TIMING_KEEP]

    def needs_dense_probe(self, bucket: int) -> bool:
        """The table says sparse but this bucket has fewer than 2 dense timings to compare with."""
        return len(self.times.get((bucket, "dense"), ())) < 2

    def needs_sparse_probe(self, bucket: int) -> bool:
        """Promotion band (just above the crossover): fewer than 2 sparse timings, or the periodic re-probe."""
        return (len(self.times.get((bucket, "sparse"), ())) < 2
                or self.bucket_calls.get(bucket, 0) % self.REPROBE_EVERY == 0)

    def sparse_faster(self, bucket: int) -> bool:
        """Measured here: sparse faster than dense by more than 2% (>= 2 samples each, minimum vs minimum)."""
        sp, de = self.times.get((bucket, "sparse"), ()), self.times.get((bucket, "dense"), ())
        return len(sp) >= 2 and len(de) >= 2 and min(sp) < 0.98 * min(de)

    def sparse_slower(self, bucket: int) -> bool:
        """Measured here: sparse slower than dense at this bucket (>= 2 samples each, minimum vs minimum)."""
        sp, de = self.times.get((bucket, "sparse"), ()), self.times.get((bucket, "dense"), ())
        if self.bucket_calls.get(bucket, 0) % self.REPROBE_EVERY == 0:
            return False  # re-probe: the activity may have fallen since
        return len(sp) >= 2 and len(de) >= 2 and min(sp) > min(de)

    def __repr__(self) -> str:
        return (f"LayerHistory(p={self.p}, f={self.f:.4f}, measurements={self.measurements}, "
                f"sparse_calls={self.sparse_calls}, dense_calls={self.dense_calls})")


_HISTORY: OrderedDict[tuple, LayerHistory] = OrderedDict()
_HISTORY_MAX = 4096


def history_for(w_gate: Tensor) -> LayerHistory:
    """The dispatch history of a gate weight (non-gated: the up weight), keyed by its storage.

    Keyed by (device, data_ptr, shape, storage object), not tensor identity: modules pass a fresh .detach() view
    every call, and views share the storage. A new weight allocated where a freed one lived has a new storage
    object, so it does not inherit the old weight's activity estimate or timing samples (which the self-timing
    decisions trust).
    """
    key = (w_gate.device.index, w_gate.data_ptr(), tuple(w_gate.shape), w_gate.untyped_storage()._cdata)
    h = _HISTORY.get(key)
    if h is None:
        if len(_HISTORY) >= _HISTORY_MAX:
            _HISTORY.popitem(last=False)
        h = _HISTORY[key] = LayerHistory()
    return h


def reset_history() -> None:
    _HISTORY.clear()


def _ext():
    from ..loader import load_twell

    return load_twell()


def _dense(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor):
    """Dense bf16 FFN exactly as HF computes it (three/two F.linear); also returns h = relu(gate)."""
    if w_gate is not None:
        h = F.relu(F.linear(x, w_gate))
        y = F.linear(h * F.linear(x, w_up), w_down)
    else:
        h = F.relu(F.linear(x, w_up))
        y = F.linear(h, w_down)
    return y, h


_EMPTY: dict[tuple, Tensor] = {}


def _empty(dev: torch.device, dtype: torch.dtype) -> Tensor:
    """A cached 0-element tensor ("no such output" for the kernels): no allocation per call."""
    t = _EMPTY.get((dev, dtype))
    if t is None:
        t = _EMPTY[(dev, dtype)] = torch.empty(0, device=dev, dtype=dtype)
    return t


def _dense_measured(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down: Tensor, hist: LayerHistory | None,
                    want_stats: bool, kn: dict) -> tuple[Tensor, Tensor]:
    """The dense path: the same GEMMs as ``_dense``, with relu(g) * u done in one in-place pass (our kernel) that
    also measures the layer's activity exactly for the dispatch history (hist=None: no measurement).

    torch's relu then mul read/write five [M, N] bf16 arrays; the fused pass three, and the result is the same
    bits. The GEMMs are queued first, so the GPU has work while the host sets up the rest. Without the
    extension this is ``_dense`` (exact, no measurement)."""
    g = F.linear(x, w_gate if w_gate is not None else w_up)
    u = F.linear(x, w_up) if w_gate is not None else None
    try:
        ext = _ext()
    except Exception:  # no extension here: dense still works, the history just stays empty
        h = F.relu(g)
        y = F.linear(h * u if u is not None else h, w_down)
        return y, ((h != 0).sum(1, dtype=torch.int32) if want_stats else y.new_empty(0, dtype=torch.int32))
    if hist is None and u is None and not want_stats:   # nothing to measure: torch's relu (faster than ours alone)
        return F.linear(F.relu_(g), w_down), _empty(x.device, torch.int32)
    M, N = x.shape[0], w_up.shape[0]
    dev = x.device
    empty_i = _empty(dev, torch.int32)
    rownnz = torch.empty(M, device=dev, dtype=torch.int32) if want_stats else empty_i
    stats = torch.zeros(2, device=dev, dtype=torch.int64) if hist is not None else _empty(dev, torch.int64)
    h = u if u is not None else g   # in place
    ext.relu_mul_stats(g, u if u is not None else _empty(dev, torch.bfloat16), h, N, kn["slots"], N, rownnz, stats,
                       _empty(dev, torch.float32))
    y = F.linear(h, w_down)
    if hist is not None:
        ev, buf = hist.to_host(stats, 0)
        hist.expect(ev, buf, "exact", M, N)
    return y, rownnz


def _gate_chunks(x: Tensor, w: Tensor, packed: Tensor, counts: Tensor, flag: Tensor, chunk: int, ext,
                 start: int = 0, scratch: Tensor | None = None, compact_version: int = 2) -> Tensor:
    """Gate GEMM into a bf16 scratch of <= chunk rows, compacting each chunk to TwELL."""
    M, N = x.shape[0], w.shape[0]
    if scratch is None:
        scratch = torch.empty(min(chunk, M), N, device=x.device, dtype=torch.bfloat16)
    for c0 in range(start, M, chunk):
        c1 = min(M, c0 + chunk)
        g = scratch[: c1 - c0]
        torch.mm(x[c0:c1], w.t(), out=g)
        ext.compact(g, N, packed[c0:c1], counts[c0:c1], flag[c0:c1], compact_version)
    return scratch


_FUSED_D2T_OK: dict[int, bool] = {}


def fused_d2t_available(x: Tensor, w: Tensor, ext=None) -> bool:
    """Whether the fused d2t (d2t_gemm.cu: sm_90a tensor-core gate GEMM writing TwELL) can take this call."""
    if x.data_ptr() % 16 or w.data_ptr() % 16 or x.shape[1] % 64 or w.shape[0] % TILE_N:
        return False
    i = x.device.index if x.device.index is not None else torch.cuda.current_device()
    ok = _FUSED_D2T_OK.get(i)
    if ok is None:
        ok = _FUSED_D2T_OK[i] = bool((ext or _ext()).d2t_gemm_supported(i))
    return ok


def _d2t_into(x: Tensor, w: Tensor, packed: Tensor, counts: Tensor, flag: Tensor, kn: dict, ext) -> str:
    """TwELL of relu(x w^T) into packed/counts/flag (flag zeroed by the caller). Returns the variant used:
    "fused" (TWELL_D2T=fused, the default, on sm_90: no dense g in memory) or "cublas" (gate GEMM into a bf16
    scratch, then compaction; every other GPU, or TWELL_D2T=cublas)."""
    mode = kn["d2t"]
    if mode not in ("fused", "cublas"):
        raise ValueError(f"TWELL_D2T must be 'fused' or 'cublas', got {mode!r}")
    if mode == "fused" and fused_d2t_available(x, w, ext):
        ext.d2t_gemm(x, w, packed, counts, flag, x.shape[1] >= kn["d2t_overlap_min_k"], kn["d2t_ctas"])
        return "fused"
    _gate_chunks(x, w, packed, counts, flag, chunk_rows_for(x.shape[0], w.shape[0], kn), ext,
                 compact_version=kn["compact"])
    return "cublas"


def chunk_rows_for(M: int, N: int, kn: dict | None = None) -> int:
    """Rows per gate-GEMM call: TWELL_CHUNK_ROWS if set (> 0), else as many as TWELL_GATE_SCRATCH_MB holds."""
    kn = kn or knobs()
    if kn["chunk_rows"] > 0:
        return kn["chunk_rows"]
    return max(256, (kn["gate_scratch_mb"] << 20) // (2 * N))


_SM_COUNT: dict[int, int] = {}


def _grid_cap(dev: torch.device, blocks_per_sm: int) -> int:
    """TWELL_UPDOWN_BLOCKS_PER_SM -> a grid cap in blocks for gated_up/down (0: no cap, one warp per item)."""
    if blocks_per_sm <= 0:
        return 0
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(i)
    if n is None:
        n = _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return n * blocks_per_sm


def _fused_decode(x: Tensor, gate_w: Tensor, w_up: Tensor | None, w_down_t: Tensor, hist: LayerHistory,
                  measure: bool, want_stats: bool, ext) -> tuple[Tensor, Tensor]:
    """M <= 8: one kernel (gate GEMV + ReLU + up + down, fp32 atomics) and one conversion; sync-free, lossless.

    One zeroed workspace holds the fp32 accumulator and the int32 nnz/flag, so a call is 3 graph nodes."""
    M, K = x.shape
    N = gate_w.shape[0]
    ws = torch.zeros(M * K + 2 * M, device=x.device, dtype=torch.float32)
    yacc = ws[: M * K].view(M, K)
    nnz = ws[M * K: M * K + M].view(torch.int32)
    flag = ws[M * K + M:].view(torch.int32)
    wu = w_up if w_up is not None else torch.empty(0, device=x.device, dtype=torch.bfloat16)
    ext.decode_fused(x, gate_w, wu, w_down_t, yacc, nnz, flag)
    if measure:
        stats = torch.zeros(2, device=x.device, dtype=torch.int64)
        ext.row_stats(nnz.view(M, 1), flag, stats)   # one "tile" per row: the row's nnz
        ev, host = hist.to_host(stats, 0)
        hist.expect(ev, host, "exact", M, N)
    y = torch.empty(M, K, device=x.device, dtype=torch.bfloat16)
    ext.finalize(yacc, flag, y, 1)
    LAST_PATH.update(path="sparse-syncfree", flagged_rows=None, d2t="decode-fused")
    return y, (nnz if want_stats else y.new_empty(0, dtype=torch.int32))


def _flagged_rows(flag: Tensor, R: int) -> Tensor:
    """Indices (ascending) of the R flagged rows, without a host sync."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(flag, size=R).squeeze(1)
    return torch.nonzero(flag).squeeze(1)  # older torch: syncs, still exact


def _ffn_impl(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down_t: Tensor, w_down: Tensor, mode: int,
              activity_hint: float, want_stats: bool) -> tuple[Tensor, Tensor]:
    kn = knobs()
    M, K = x.shape
    gated = w_gate is not None
    gate_w = w_gate if gated else w_up
    if M == 0:
        return x.new_empty(0, K), torch.empty(0, device=x.device, dtype=torch.int32)
    capturing = torch.cuda.is_current_stream_capturing()
    sync_free = capturing or M <= kn["decode_max_m"]
    hist = history_for(gate_w)

    if mode == MODE_AUTO:
        if not capturing:  # event queries are not allowed while capturing; the graph keeps the choice made here
            hist.poll()
        p = hist.p if hist.p is not None else (activity_hint if activity_hint > 0 else None)
        f = hist.f if hist.p is not None else 0.0
        # first call of a layer (no history, no hint): dense, and measure
        xo = crossover(M, kn["crossover"] if gated else kn["crossover_nongated"])
        sparse = p is not None and p <= xo and (sync_free or f <= kn["flagged_dense_above"])
        table_dense = p is not None and p > xo   # measured above the crossover: see the non-gated rule below
        LAST_PATH["p_est"] = p
    else:
        sparse = mode == MODE_SPARSE
        table_dense = False
        LAST_PATH["p_est"] = None
    timed = False
    # Self-timing (eager M > decode_max_m only: small-M eager calls are host-bound, and decode is calibrated and
    # used as CUDA-graph replays, where the table's choice is the one that was timed).
    if mode == MODE_AUTO and kn["self_timing"] and not sync_free:
        bucket = M.bit_length()
        if not capturing:
            hist.poll_timings()
            hist.count_call(bucket)
        if sparse and not capturing and hist.needs_dense_probe(bucket):
            sparse = False          # time dense here first (a dense call is never slower than dense)
        elif sparse and hist.sparse_slower(bucket):
            sparse = False          # measured slower on this layer: the table does not fit it
        elif (not sparse and mode == MODE_AUTO and p is not None and 0 < xo < p <= kn["promote_band"] * xo
              and f <= kn["flagged_dense_above"] and not capturing
              and (hist.needs_sparse_probe(bucket) or hist.sparse_faster(bucket))):
            sparse = True           # just above the table's crossover: sparse timed here, and run when faster
        timed = not capturing and hist.want_timing(bucket, "sparse" if sparse else "dense")
    if timed:
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
    if not sparse:
        # measure unless capturing (no event queries in a graph) or the previous measurement is still in flight
        measure = mode == MODE_AUTO and not capturing and not hist.busy()
        every = kn["nongated_measure_every"]
        if measure and not gated and table_dense and every > 1 and hist.dense_calls % every:
            # non-gated: the measuring pass is ~8% slower than torch's relu (no mul to fuse it with), so a layer
            # measured above the crossover is re-measured only every `every` dense calls (the others run as HF
            # does); a drop in activity is then seen up to `every` calls late (those calls stay dense: exact)
            measure = False
        out = _dense_measured(x, w_gate, w_up, w_down, hist if measure else None, want_stats, kn)
        hist.dense_calls += 1
        LAST_PATH.update(path="dense", flagged_rows=None, d2t=None)
    else:
        out = _sparse_call(x, w_gate, w_up, w_down_t, w_down, want_stats, kn, hist, capturing, sync_free)
    if timed:
        t1.record()
        hist.add_timing(t0, t1, bucket, "sparse" if sparse else "dense")
    return out


def _sparse_call(x: Tensor, w_gate: Tensor | None, w_up: Tensor, w_down_t: Tensor, w_down: Tensor, want_stats: bool,
                 kn: dict, hist: LayerHistory, capturing: bool, sync_free: bool) -> tuple[Tensor, Tensor]:
    """The TwELL path (eager, sync-free or fused decode), exact on every row."""
    M, K = x.shape
    N = w_up.shape[0]
    T = N // TILE_N
    gated = w_gate is not None
    gate_w = w_gate if gated else w_up
    dev = x.device
    ext = _ext()
    hist.sparse_calls += 1
    if sync_free and M <= min(8, kn["fused_decode_max_m"]):
        return _fused_decode(x, gate_w, w_up if gated else None, w_down_t, hist,
                             not capturing and not hist.busy(), want_stats, ext)
    S = TILE_N if sync_free else kn["slots"]
    if not 1 <= S <= TILE_N:
        raise ValueError(f"TWELL_SLOTS must be in 1..{TILE_N}, got {S}")
    packed = torch.empty(M, T, S, device=dev, dtype=torch.int32)
    counts = torch.empty(M, T, device=dev, dtype=torch.int32)
    flag = torch.zeros(M, device=dev, dtype=torch.int32)
    y = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
    d2t_variant = _d2t_into(x, gate_w, packed, counts, flag, kn, ext)
    ext.set_grid_cap(_grid_cap(dev, kn["updown_blocks_per_sm"]))
    measure = not capturing and (not sync_free or not hist.busy())
    if measure:  # exact activity of this call, for the history (and the flagged-row count below)
        stats = torch.zeros(2, device=dev, dtype=torch.int64)
        ext.row_stats(counts, flag, stats)
        ev, host = hist.to_host(stats, 0 if sync_free else 1)

    if sync_free:
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
        ext.set_grid_cap(0)
        if measure:
            hist.expect(ev, host, "exact", M, N)
        LAST_PATH.update(path="sparse-syncfree", flagged_rows=None, d2t=d2t_variant)
        return y, (counts.sum(1, dtype=torch.int32) if want_stats else y.new_empty(0, dtype=torch.int32))

    # eager large-M path: sparse up/down queued first, then wait only for the (earlier) flagged-row count
    hval = torch.empty(0, device=dev, dtype=torch.float32)
    if gated:
        hval = torch.empty(M, T, S, device=dev, dtype=torch.float32)
        ext.gated_up(x, w_up, packed, counts, flag, hval, T)
    ext.down(w_down_t, packed, counts, flag, hval, y, torch.empty(0, device=dev), kn["down_nb"], T, 0)
    ext.set_grid_cap(0)
    ev.synchronize()  # the compaction is done; up/down keep the GPU busy meanwhile
    nnz_ok, R = (int(v) for v in host.tolist())
    hist.update(nnz_ok, R, M, N)
    if R > 0:  # exact dense backup of every flagged row, however many
        rows = _flagged_rows(flag, R)
        yb, _ = _dense(x.index_select(0, rows), w_gate, w_up, w_down)
        y.index_copy_(0, rows, yb)
    LAST_PATH.update(path="sparse", flagged_rows=R, d2t=d2t_variant)
    return y, (counts.sum(1, dtype=torch.int32) if want_stats else y.new_empty(0, dtype=torch.int32))


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
        _d2t_into(x, w_gate, packed, counts, flag, knobs(), _ext())
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
