"""KernelConfig: every setting of the sparse FFN kernels, as data.

One frozen dataclass carried by the model config (``SparseLlamaConfig.kernel_config``), accepted by the functional
API (``sparse_gated_ffn(..., config=cfg)``) and written into every benchmark, training and eval log
(``cfg.to_dict()``). A run's YAML sets it in its ``kernel:`` block (experiments/trainer/config.py). Nothing reads the
environment but ``KernelConfig.from_env()``, an explicit, read-once override for benchmark sweeps (the
``SFL_KERNEL_*`` names below); neither the model nor the trainer calls it.

A value the kernels cannot serve is refused here, when the config is built, with the field's name.

It imports only the standard library: a saved checkpoint carries a copy of this file (models/kernel_config.py
links here), read by the checkpoint's own configuration code where the project is not installed.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

TILE_N = 256          # TwELL tile width (columns per tile); fixed by the kernels
FUSED_DECODE_MAX_M_LIMIT = 8  # the fused decode kernel takes at most 8 rows
FUSED_DECODE_MAX_M = 2        # ... and serves up to this many (decode_rows is faster above: kernels/README.md, 5b)
ROWS_DECODE_MAX_M = 64        # decode_rows (cuBLAS gate) serves the decode calls above that, up to this many

# Crossover per M bucket, "m:p,...": for M >= m (largest such m) auto runs sparse when the layer's measured activity
# is <= p. Calibrated on the H100 at K = 2048, N = 5632 against our dense path with the fused d2t and up_down (the
# elementwise minimum of two runs, results/kernel_bench/calibration/calib_h100_r18{a,b}.jsonl, M >= 256 at 0.1-2%
# activity: sparse wins to ~1% from M = 16384 up, ~0.8% at 4096; kernels/README.md, Dispatch). The
# decode buckets (M <= 64) come from calib_decode_h100_r21{a,b}.jsonl (M = 1, 2, 4, 8, 16, 32, 64 at 0.1-25%
# activity, the fused decode kernel to M = 2 and decode_rows above; merged by experiments/kernel_bench/
# decode_crossover.py): sparse wins to ~20% activity at M = 1, ~10% at M = 3-8, ~6% at 9-16, ~4% at 17-32,
# ~1.3% at 33-64.
DEFAULT_CROSSOVER = ("1:0.198,2:0.1699,3:0.1112,5:0.0948,9:0.0592,17:0.0425,33:0.0134,"
                     "256:0,1024:0.0025,4096:0.0078,8192:0.0043,16384:0.0101,32768:0.0108,65536:0.0113")
# The non-gated block (no up-projection gather, so sparse wins to higher activity), calibrated the same way at
# K = 2048, N = 8192: from M = 256 the elementwise minimum of calib_nongated_h100_r22{a,b}.jsonl (against the dense
# call with the ReLU in the GEMM's epilogue: ~0.5% at M = 4096, ~0.65% at 8192-16384, ~0.8-0.9% above), the decode
# buckets from calib_decode_nongated_h100_r17{a,b}.jsonl (decode_crossover.py --kind nongated): ~12% at M = 1,
# ~9-11% at M = 2-8, ~7% at 9-16, ~1.4% at 33-64.
DEFAULT_CROSSOVER_NONGATED = ("1:0.121,2:0.0908,3:0.1167,5:0.1017,9:0.0669,17:0.0443,33:0.0138,"
                              "256:0,1024:0.0015,4096:0.0052,8192:0.0062,16384:0.0067,32768:0.0078,65536:0.009")

MODES = ("auto", "sparse", "dense")
D2T_VARIANTS = ("fused", "cublas")


def parse_crossover(spec: str, name: str = "crossover") -> tuple[tuple[int, ...], tuple[float, ...]]:
    """'m:p,...' -> (bucket starts ascending, activities); a bucket 1 with activity 0 is added if missing."""
    try:
        pairs = sorted((int(a), float(b)) for a, b in (kv.split(":") for kv in spec.split(",") if kv.strip()))
    except ValueError as e:
        raise ValueError(f"KernelConfig.{name}={spec!r} must look like '1:0.012,17:0,32768:0.006' "
                         "(M bucket start : largest activity that runs sparse)") from e
    if any(m < 1 or not 0 <= p <= 1 for m, p in pairs):
        raise ValueError(f"KernelConfig.{name}={spec!r}: bucket starts must be >= 1 and activities in [0, 1]")
    if not pairs or pairs[0][0] > 1:
        pairs.insert(0, (1, 0.0))
    return tuple(m for m, _ in pairs), tuple(p for _, p in pairs)


def crossover_at(spec: str, M: int) -> float:
    """The largest activity at which auto runs sparse for M rows under table `spec`."""
    ms, ps = parse_crossover(spec)
    return ps[max(0, bisect.bisect_right(ms, M) - 1)]


# Fields of earlier versions that no longer steer anything: dropped when an old config dict (a saved model's
# config.json, a log row) is read. down_nb: the down kernel's chunks per lane, gone with the split up/down path.
RETIRED_FIELDS = frozenset({"down_nb"})


@dataclass(frozen=True)
class KernelConfig:
    """Settings of the sparse FFN kernels (inference and training). Defaults are the measured best on the H100.

    Format (every path, the pure-PyTorch reference included):
        tile_n: TwELL tile width (columns per tile); the CUDA kernels are built for 256 (TILE_N), the reference
            takes any width dividing the intermediate size.
        slots: TwELL slots S per (row, tile) (compression C = tile_n / S); on CUDA above decode_max_m (below it
            the kernels use S = 256, lossless). A row with a fuller tile (or a non-finite gate value) is flagged
            and computed exactly by the dense backup.
    Inference (kernels.ffn, mlp_impl="cuda" without grad):
        mode: "auto" (per-layer measured dispatch between the TwELL path and our dense path), "sparse", "dense".
        backup_rows: rows of the dense backup's cuBLAS block per sparse call above decode_max_m, and per sparse
            training call (the same plan rule for both ops). -1: from the layer's last measurement (1.25 x its
            flagged rows + 32; none if it saw none; M / 16 before one).
            Flagged rows past the block are still exact, on CUDA cores (slower); no host sync either way.
        decode_max_m: M at or below this takes the decode paths (S = 256, lossless). Larger values cost
            M * N * 8 bytes of TwELL buffers above rows_decode_max_m.
        fused_decode_max_m: decode calls of at most this many rows (0..8) take the fused decode kernel (gate
            products on CUDA cores, W_g read once).
        rows_decode_max_m: above fused_decode_max_m, decode calls of at most this many rows take the cuBLAS
            gate GEMM and the decode_rows kernel (compaction, up and down per row; 0: off).
        decode_rows_slices: K slices (blocks) per row in decode_rows, 1..8 (a thread-block cluster on sm_90); 0:
            2 x SMs / M, at most 8, fewer where the M clusters would not all be resident at once.
        crossover / crossover_nongated: dispatch tables ("m:p,...", see DEFAULT_CROSSOVER).
        flagged_dense_above: eager auto runs dense when more than this fraction of rows was flagged last time.
        self_timing: eager auto times both paths per M bucket: above decode_max_m it leaves sparse where it measured
            slower; at decode sizes (activity <= 25%) it runs the faster of the two. Graph captures follow the table.
        activity_hint: prior activity used until a layer's first measurement lands (0: none, first call dense).
        measure_every: dense calls of a layer measured above its crossover re-measure activity only every this many
            calls (the read-back costs a few small operations per call; non-gated, the measuring pass is also ~8%
            slower than torch's relu); a fall in activity is then seen up to this many calls late.
        up_list_min_m: from this many rows the gated large-M path runs its up and down steps as two kernels
            (up_list writes each row's entries, the down step reads W_dT one L2-sized slice at a time) instead of
            one (up_down); 0: always one. Costs M * N / 256 * slots * 8 bytes of transient entry lists. Measured
           12% faster from 4096 rows at uniform activity, but 2% slower to 8192 rows
            on the paper-like profile and in the calibrated model's prefill, even from 16384; the non-gated block
            (no W_u rows to read) lost with it everywhere and keeps up_down.
        hot_neurons: the layer's first hot_neurons neurons (a multiple of 256, below N) are computed as dense GEMMs
            in sparse calls above decode_max_m, the others through TwELL ("hot/cold"; 0: off). For layers whose
            neurons fire at very different rates, put in front by SparseLlamaForCausalLM.order_hot_neurons_, which
            sets it per layer. Eager auto then times both paths per M bucket and runs the faster one (the crossover
            table does not describe hot/cold calls). Measured: on the paper-like
            profile, M = 65536, 1.15x -> 1.44x of dense at 1% activity and 1.04x -> 1.19x at 2%; no gain at 0.5% there
            or on uniform activity.
        d2t: "fused" (sm_90: the gate GEMM's epilogue writes TwELL) or "cublas" (gate GEMM, then compaction).
        d2t_overlap_min_k: fused d2t: K at or above which compaction warps overlap the next tile's mainloop.
        d2t_max_ctas: > 0 caps the fused d2t's persistent grid (tests); 0 = one CTA per SM.
        gate_scratch_mb: cuBLAS d2t only: bf16 gate-output scratch budget (rows are chunked beyond it).
        decode_tiles_per_warp: tiles per warp in the decode-size down kernel (fp32 atomic split).
    Training (kernels.train_ffn, mlp_impl="cuda" with grad):
        train_width: ELL width W kept for the backward (rows with more non-zeros go to the dense backup).
        train_dense_above / train_backup_dense_above: auto runs dense above this activity / flagged-row fraction;
            from train_large_m rows the activity limit is train_dense_above_large.
        train_sparse_min_m: auto runs dense below this many rows.
        train_chunk_rows, train_shrink, train_dw_nb, train_probe_rows, train_fused_dense: see kernels/train/README.md.
        train_mode: the mode models train with: "auto" (measured dispatch), or "sparse" / "dense" to test or
            benchmark one path inside a model.
    """

    tile_n: int = TILE_N
    slots: int = 32
    mode: str = "auto"
    backup_rows: int = -1
    decode_max_m: int = 64
    crossover: str = DEFAULT_CROSSOVER
    crossover_nongated: str = DEFAULT_CROSSOVER_NONGATED
    flagged_dense_above: float = 0.05
    self_timing: bool = True
    activity_hint: float = 0.0
    measure_every: int = 16
    d2t: str = "fused"
    d2t_overlap_min_k: int = 4096
    d2t_max_ctas: int = 0
    gate_scratch_mb: int = 1024
    decode_tiles_per_warp: int = 4
    fused_decode_max_m: int = FUSED_DECODE_MAX_M
    rows_decode_max_m: int = ROWS_DECODE_MAX_M
    decode_rows_slices: int = 0
    up_list_min_m: int = 16384
    hot_neurons: int = 0
    train_width: int = 128
    train_dense_above: float = 0.007
    train_dense_above_large: float = 0.01  # from train_large_m rows (kernels/train/README.md: crossover by M)
    train_large_m: int = 16384
    train_backup_dense_above: float = 0.15  # model-level: layers at 1.5-12.9% backup rows still won (train/README)
    train_sparse_min_m: int = 8192
    train_chunk_rows: int = 16384
    train_shrink: bool = True
    train_dw_nb: int = 0
    train_probe_rows: int = 2048
    train_fused_dense: bool = True
    train_mode: str = "auto"
    _parsed: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"KernelConfig.{name}={getattr(self, name)!r} is invalid: {why}")

        if self.mode not in MODES:
            raise bad("mode", f"must be one of {MODES}")
        if self.train_mode not in MODES:
            raise bad("train_mode", f"must be one of {MODES}")
        if self.d2t not in D2T_VARIANTS:
            raise bad("d2t", f"must be one of {D2T_VARIANTS}")
        for name in ("tile_n", "slots", "decode_max_m", "measure_every", "d2t_overlap_min_k", "gate_scratch_mb",
                     "decode_tiles_per_warp", "train_width", "train_chunk_rows", "train_probe_rows", "train_large_m"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be a positive integer")
        for name in ("d2t_max_ctas", "train_sparse_min_m", "rows_decode_max_m", "up_list_min_m", "hot_neurons"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an integer >= 0")
        for name, top in (("fused_decode_max_m", FUSED_DECODE_MAX_M_LIMIT), ("decode_rows_slices", 8)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise bad(name, f"must be an integer in 0..{top}")
        if isinstance(self.train_dw_nb, bool) or self.train_dw_nb not in (0, 1, 2, 4, 8):
            raise bad("train_dw_nb", "must be 0 (from the rows, kernels/train/README.md), 1, 2, 4 or 8")
        if isinstance(self.backup_rows, bool) or not isinstance(self.backup_rows, int) or self.backup_rows < -1:
            raise bad("backup_rows", "must be an integer >= -1 (-1: from the layer's measured flagged rows)")
        if self.hot_neurons % TILE_N:
            raise bad("hot_neurons", f"must be a multiple of {TILE_N} (whole TwELL tiles)")
        if self.slots > self.tile_n:
            raise bad("slots", f"must be <= tile_n={self.tile_n} (one tile holds tile_n columns)")
        for name in ("flagged_dense_above", "activity_hint", "train_dense_above", "train_dense_above_large",
                     "train_backup_dense_above"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise bad(name, "must be a number in [0, 1]")
        for name in ("self_timing", "train_shrink", "train_fused_dense"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        parsed = (parse_crossover(self.crossover, "crossover"),
                  parse_crossover(self.crossover_nongated, "crossover_nongated"))
        object.__setattr__(self, "_parsed", parsed)

    # ------------------------------------------------------------------------------------------------ access
    def crossover_table(self, gated: bool) -> tuple[tuple[int, ...], tuple[float, ...]]:
        return self._parsed[0 if gated else 1]

    def replace(self, **changes: Any) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The effective settings, for logs (every benchmark/training/eval row records them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "KernelConfig":
        d = {k: v for k, v in dict(d or {}).items() if k not in RETIRED_FIELDS}
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KernelConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_env(cls, base: "KernelConfig | None" = None, environ: Mapping[str, str] | None = None) -> "KernelConfig":
        """`base` with every SFL_KERNEL_<FIELD> variable applied (e.g. SFL_KERNEL_SLOTS=16). Read once, by the
        caller that builds the config: benchmark sweeps only (the model, the trainer and the kernels never read the
        environment; a run sets its kernels in its YAML's kernel: block)."""
        env = os.environ if environ is None else environ
        base = base or cls()
        changes: dict[str, Any] = {}
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            raw = env.get(f"SFL_KERNEL_{f.name.upper()}")
            if raw is None:
                continue
            cur = getattr(base, f.name)
            try:
                if isinstance(cur, bool):
                    if raw.lower() not in ("0", "1", "true", "false"):
                        raise ValueError(raw)
                    changes[f.name] = raw.lower() in ("1", "true")
                elif isinstance(cur, int):
                    changes[f.name] = int(raw)
                elif isinstance(cur, float):
                    changes[f.name] = float(raw)
                else:
                    changes[f.name] = raw
            except ValueError as e:
                raise ValueError(f"SFL_KERNEL_{f.name.upper()}={raw!r} is not a valid {type(cur).__name__} "
                                 f"for KernelConfig.{f.name}") from e
        return base.replace(**changes) if changes else base


DEFAULT = KernelConfig()

__all__ = ["KernelConfig", "DEFAULT", "TILE_N", "DEFAULT_CROSSOVER", "DEFAULT_CROSSOVER_NONGATED",
           "parse_crossover", "crossover_at"]
