"""Calibrate the sparse/dense dispatch on this GPU.

    python -m sfl.kernels.calibrate                       # the default shapes: 14 s of timing on an H200
    python -m sfl.kernels.calibrate --shape 576,1536      # a model's hidden size K and FFN width N (gated)
    python -m sfl.kernels.calibrate --shape 2048,8192 --kind nongated --budget-s 60

In mode "auto" each FFN layer runs its sparse (TwELL) path when its measured activity is at or below a crossover
that depends on the number of rows M (KernelConfig.crossover, crossover_nongated: "m:p,..."). The built-in tables
were measured on an H100 at the paper's shape; the crossovers move with the GPU, the driver, torch and the shape.
This command measures them here: for each shape and M (1 ... 65536 rows) it times our dense path against the
forced sparse path at rising activity (uniform and skewed per-neuron rates; CUDA events after an L2 flush, warm-up,
medians of the two paths timed in alternation; M <= 64 as CUDA-graph replays, as decode steps run), stops a sweep
after two losses, and takes per M the activity where sparse stops reaching 0.98x of dense (the smaller over the
two profiles, interpolated, rounded down to 0.0001).

It stops measuring when --budget-s (default 150 s, the kernels' build excluded) is spent, shared between the
shapes; M values it did not reach keep the table the plan would have used. It writes:
- a table per (block kind, shape) into the user's cache, $XDG_CACHE_HOME/sfl/dispatch (else ~/.cache/sfl/dispatch),
  keyed by GPU name, driver, torch version, kernel sources and shape. Every plan made afterwards for a layer of that
  shape on this GPU (models, TwELL modules, the functional API) runs with it, and says so in one line on stderr;
- a JSONL log (--log) of every timed point with its provenance (GPU, driver, torch, CUDA, commit, shapes);
- with --record-dir DIR, the tables merged into DIR/<gpu name>.json: the form of the repository's tables of record
  (kernels/dispatch_tables/), which serve every user of that GPU model without a calibration of their own.
A table set by hand in KernelConfig is never replaced. The kernels need an sm_90 (Hopper) GPU; elsewhere the FFNs run
the dense path and there is nothing to calibrate.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import tables
from .config import TILE_N, KernelConfig, crossover_at
from .device import kernels_supported
from .ffn import sparse_gated_ffn, sparse_nongated_ffn
from .loader import KernelUnavailableError
from .provenance import measurement_provenance
from .timing import PairTimer, capture_graph
from .twell import ops

# (block kind, K, N): the paper's models (hidden 2048, gated N 5632; the non-gated block at N 8192) and SmolLM2's
DEFAULT_SHAPES = (("gated", 2048, 5632), ("gated", 576, 1536), ("nongated", 2048, 8192))
DECODE_MAX_M = 64  # KernelConfig.decode_max_m: at or below, the decode paths (timed as CUDA-graph replays)
MS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536)
DECODE_ACTS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.09, 0.12, 0.16, 0.20, 0.25)  # the decode crossovers lie at 1-20%
LARGE_ACTS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03)
PROFILES = ("uniform", "skewed")
THRESHOLD = 0.98  # sparse within 2% of our dense path still beats HF's dense, which runs ~4% behind it
STOP_AFTER_LOSSES = 2


@dataclass
class Point:
    """One timed case: M rows at a target activity; p is the activity measured on the case."""

    M: int
    profile: str
    activity: float
    p: float
    dense_ms: float
    sparse_ms: float
    rel_err: float = float("nan")

    @property
    def speedup(self) -> float:
        return self.dense_ms / self.sparse_ms


Measure = Callable[[str, int, int, int, float, str], Point]  # (kind, K, N, M, target activity, profile) -> Point


def profile_crossover(points: list[Point], threshold: float = THRESHOLD) -> float:
    """The activity where sparse stops reaching `threshold` x dense along one profile's sweep (linear between the
    last win and the first loss). A sweep that loses at its lowest activity says nothing below it: its limit is just
    under that activity (crossover() then keeps only measured wins)."""
    pts = sorted(points, key=lambda q: q.p)
    cross = 0.0
    for i, q in enumerate(pts):
        if q.speedup < threshold:
            if i == 0:
                return max(0.0, q.p - 1e-4)
            w = pts[i - 1]
            return w.p + (q.p - w.p) * (w.speedup - threshold) / (w.speedup - q.speedup)
        cross = q.p
    return cross


def crossover(by_profile: dict[str, list[Point]], threshold: float = THRESHOLD) -> float:
    """One M's table value: the smallest profile crossover, 0 unless sparse won at or below it, rounded down."""
    swept = [pts for pts in by_profile.values() if pts]
    if not swept:
        return 0.0
    cross = min(profile_crossover(pts, threshold) for pts in swept)
    if not any(q.p <= cross and q.speedup >= threshold for pts in swept for q in pts):
        return 0.0
    return math.floor(cross * 1e4) / 1e4


def bucket_spec(per_m: dict[int, float]) -> str:
    """KernelConfig's "m:p,..." from values per measured M. Decode sizes: the bucket up to a measured M takes its
    value (the crossover falls with M there); above, the bucket from a measured M (it rises with M there)."""
    parts, prev = [], 0
    for M in sorted(per_m):
        start = prev + 1 if M <= DECODE_MAX_M else M
        parts.append(f"{start}:{per_m[M]:g}")
        prev = M
    return ",".join(parts)


@dataclass
class ShapeResult:
    kind: str
    K: int
    N: int
    per_m: dict[int, float] = field(default_factory=dict)
    unmeasured: list[int] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return bucket_spec(self.per_m)


def calibrate_shape(kind: str, K: int, N: int, measure: Measure, *, deadline: float, fallback: str,
                    ms: tuple[int, ...] = MS, profiles: tuple[str, ...] = PROFILES,
                    clock: Callable[[], float] = time.monotonic, on_point: Callable[[Point], None] = lambda q: None,
                    progress: Callable[[], None] = lambda: None) -> ShapeResult:
    """Sweep every (M, profile) until `deadline` (by `clock`); an M not fully reached takes `fallback`'s value."""
    res = ShapeResult(kind, K, N)
    for M in ms:
        by_profile: dict[str, list[Point]] = {}
        for profile in profiles:
            pts = by_profile[profile] = []
            losses = 0
            for a in DECODE_ACTS if M <= DECODE_MAX_M else LARGE_ACTS:
                if clock() >= deadline:
                    break
                q = measure(kind, K, N, M, a, profile)
                pts.append(q)
                on_point(q)
                losses = losses + 1 if q.speedup < THRESHOLD else 0
                if losses >= STOP_AFTER_LOSSES:
                    break
            progress()
        res.points += [q for pts in by_profile.values() for q in pts]
        if all(by_profile[p] for p in profiles):
            res.per_m[M] = crossover(by_profile)
        else:  # the budget ran out before this M was swept
            res.unmeasured.append(M)
            res.per_m[M] = crossover_at(fallback, M)
    return res


def calibrate(shapes, measure: Measure, *, budget_s: float, fallback: Callable[[str, int, int], str],
              ms: tuple[int, ...] = MS, profiles: tuple[str, ...] = PROFILES,
              clock: Callable[[], float] = time.monotonic, on_point: Callable[[str, int, int, Point], None] = None,
              show_progress: bool = True) -> list[ShapeResult]:
    """Every shape in turn; shape i must finish by start + budget * (i + 1) / len(shapes), so time one shape did not
    use passes to the next."""
    t0, out = clock(), []
    with tqdm(total=len(shapes) * len(ms) * len(profiles), desc="calibrating", unit="sweep",
              disable=not show_progress) as bar:
        for i, (kind, K, N) in enumerate(shapes):
            bar.set_postfix_str(f"{kind} K={K} N={N}")
            out.append(calibrate_shape(
                kind, K, N, measure, deadline=t0 + budget_s * (i + 1) / len(shapes), fallback=fallback(kind, K, N),
                ms=ms, profiles=profiles, clock=clock, progress=lambda: bar.update(1),
                on_point=(lambda q, s=(kind, K, N): on_point(*s, q)) if on_point else lambda q: None))
    return out


# ------------------------------------------------------------------------------------------------ on the GPU
class CudaMeasure:
    """Times our dense path against the forced sparse path through the op, on synthetic cases of a set activity."""

    def __init__(self, reps: int = 20, reps_large: int = 10, seed: int = 0) -> None:
        self.reps, self.reps_large, self.seed = reps, reps_large, seed
        self.timer = PairTimer()
        self.base = KernelConfig()
        self.ops = ops
        self.shape_state: dict[tuple, tuple] = {}

    def _weights(self, kind: str, K: int, N: int):
        """Per shape: fp32 first weight (gate, or up when non-gated), bf16 up, W_d neuron-major as models store
        it (kernels/layout.py), and one plan per forced mode."""
        key = (kind, K, N)
        if key not in self.shape_state:
            self.shape_state.clear()
            g = torch.Generator(device="cuda").manual_seed(self.seed)
            w1 = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
            wu = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
            wd = (torch.randn(N, K, device="cuda", generator=g) / N ** 0.5).to(torch.bfloat16).t()
            plans = [self.ops.Plan(self.base.replace(mode=m)) for m in ("dense", "sparse")]
            self.shape_state[key] = (w1, wu, wd, plans)
        return self.shape_state[key]

    def _case(self, w1: torch.Tensor, M: int, activity: float, profile: str, seed: int):
        """x with feature 0 constant 1, and the first weight with column 0 a per-neuron shift that makes neuron j
        fire at rate p_j: uniform p_j = activity, skewed p_j lognormal around it (hot and rare neurons) with a
        lognormal per-token scale."""
        N, K = w1.shape
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(M, K, device="cuda", generator=g)
        x[:, 0] = 1.0
        pj = torch.full((N,), activity, device="cuda")
        if profile == "skewed":
            pj = (activity * torch.exp(1.2 * torch.randn(N, device="cuda", generator=g) - 0.72)).clamp(max=0.5)
            pj *= activity / pj.mean()
            x[:, 1:] *= torch.exp(0.2 * torch.randn(M, 1, device="cuda", generator=g))
        w = w1.clone()
        w[:, 0] = -torch.special.ndtri(1.0 - pj.clamp(1e-6, 0.5))
        return x.to(torch.bfloat16), w.to(torch.bfloat16)

    @torch.no_grad()
    def __call__(self, kind: str, K: int, N: int, M: int, activity: float, profile: str) -> Point:
        w1, wu, wd, (plan_d, plan_s) = self._weights(kind, K, N)
        x, w = self._case(w1, M, activity, profile, seed=self.seed + M * 1000 + int(activity * 1e5))

        def call(plan):  # the non-gated block's only input weight is the shifted one
            if kind == "gated":
                return lambda: sparse_gated_ffn(x, w, wu, wd, plan=plan)
            return lambda: sparse_nongated_ffn(x, w, wd, plan=plan)

        dense, sparse = call(plan_d), call(plan_s)
        y_d, y_s = dense().float(), sparse().float()
        err = ((y_s - y_d).norm() / y_d.norm().clamp_min(1e-30)).item()
        p = (F.linear(x, w) > 0).sum().item() / (M * N)
        if M <= DECODE_MAX_M:
            gd, gs = capture_graph(dense)[0], capture_graph(sparse)[0]
            dm, sm = self.timer.time_pair(gd.replay, gs.replay, self.reps)
        else:
            dm, sm = self.timer.time_pair(dense, sparse, self.reps if M < 16384 else self.reps_large)
        return Point(M, profile, activity, p, dm, sm, err)


# ------------------------------------------------------------------------------------------------ command line
def _shape(text: str) -> tuple[int, int]:
    try:
        K, N = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: give K,N (hidden size, FFN width), e.g. 2048,5632"
                                         ) from None
    if K < 8 or K % 8 or N < TILE_N or N % TILE_N:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: the kernels take K a multiple of 8 and N a multiple "
                                         f"of {TILE_N}")
    return K, N


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sfl.kernels.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_shape, action="append", metavar="K,N",
                    help="a block shape to calibrate (repeatable); default: " +
                         ", ".join(f"{k} {K},{N}" for k, K, N in DEFAULT_SHAPES))
    ap.add_argument("--kind", choices=tuple(tables.KINDS), default="gated", help="the block kind of --shape")
    ap.add_argument("--budget-s", type=float, default=150.0, help="measuring time, all shapes (default 150)")
    ap.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    ap.add_argument("--log", type=Path, help="JSONL log of every timed point (default: in the cache directory)")
    ap.add_argument("--record-dir", type=Path, help="also merge the tables into DIR/<gpu>.json (a table of record)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: $XDG_CACHE_HOME/sfl/dispatch")
    ap.add_argument("--no-cache", action="store_true", help="write no cache entry (plans keep their tables)")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error("--budget-s must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    ok, why = kernels_supported()
    if not ok:
        print(f"sfl.kernels.calibrate: {why}: nothing to calibrate (the FFNs take the dense path here)",
              file=sys.stderr)
        return 2
    try:
        t_build = time.monotonic()
        ops.load()   # the JIT build (first run only) is not part of the budget
    except KernelUnavailableError as e:
        print(f"sfl.kernels.calibrate: {e}", file=sys.stderr)
        return 2
    gpu, kernels = tables.current_gpu(), tables.kernels_source()
    cache = args.cache_dir or tables.cache_dir()
    shapes = [(args.kind, K, N) for K, N in args.shape] if args.shape else list(DEFAULT_SHAPES)
    log_path = args.log or cache / f"calibrate-{tables.slug(gpu.name)}-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    prov = {**measurement_provenance(), "gpu_identity": asdict(gpu), "kernels_source": kernels,
            "shapes": shapes, "budget_s": args.budget_s, "profiles": args.profiles, "threshold": THRESHOLD,
            "build_s": round(time.monotonic() - t_build, 1)}
    with open(log_path, "a") as log:
        def on_point(kind: str, K: int, N: int, q: Point) -> None:
            row = {"event": "point", "kind": kind, "K": K, "N": N, **asdict(q), "speedup": q.speedup,
                   "timing": "cuda_graph_replay" if q.M <= DECODE_MAX_M else "eager", "provenance": prov}
            log.write(json.dumps(row) + "\n")
            log.flush()

        def fallback(kind: str, K: int, N: int) -> str:  # what a plan of this shape would use without this run
            found = tables.lookup(gpu, kind, K, N, kernels=kernels, cache=cache)
            return found.crossover if found else tables.KINDS[kind][1]

        t0 = time.monotonic()
        results = calibrate(shapes, CudaMeasure(), budget_s=args.budget_s, fallback=fallback,
                            profiles=tuple(args.profiles), on_point=on_point)
        entries = [_entry(r, gpu, kernels, prov, time.monotonic() - t0) for r in results]
        for e in entries:
            log.write(json.dumps({"event": "table", **e, "provenance": prov}) + "\n")
    _write(entries, gpu, kernels, args, cache, log_path)
    return 0


def _entry(r: ShapeResult, gpu: tables.GpuIdentity, kernels: str, prov: dict, elapsed: float) -> dict:
    return tables.entry(gpu, r.kind, r.K, r.N, r.spec, kernels=kernels, per_m={str(m): v for m, v in r.per_m.items()},
                        unmeasured_m=r.unmeasured, points=len(r.points), threshold=THRESHOLD,
                        git_commit=prov.get("git_commit"), time_utc=prov.get("time_utc"), measured_s=round(elapsed, 1))


def _write(entries: list[dict], gpu: tables.GpuIdentity, kernels: str, args: argparse.Namespace, cache: Path,
           log_path: Path) -> None:
    for e in entries:
        where = "" if args.no_cache else f" -> {tables.write_cache(e, gpu, kernels, cache)}"
        note = f" (not reached in the budget, kept: M = {e['unmeasured_m']})" if e["unmeasured_m"] else ""
        print(f"{e['kind']} K={e['K']} N={e['N']}: {e['crossover']}{note}{where}")
    if args.record_dir:
        print(f"table of record: {tables.write_record(entries, gpu, args.record_dir)}")
    print(f"log: {log_path}")


if __name__ == "__main__":
    sys.exit(main())
