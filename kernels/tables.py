"""The dispatch crossover tables a plan runs with, per GPU and FFN shape (measured by kernels/calibrate.py).

KernelConfig.crossover / crossover_nongated ("m:p,...": per M bucket, the largest measured activity at which the
sparse path beats the dense one) were measured on one GPU at one shape. A plan made for a layer of shape (K, N)
(ops.Plan(config, shape=(K, N))) looks for a better table, first found wins:
1. the user's cache: `python -m sfl.kernels.calibrate` on this machine, for this GPU name, driver, torch version,
   kernel sources and exact (K, N): <cache dir>/sfl/dispatch/<key>.json ($XDG_CACHE_HOME, else ~/.cache);
2. the table of record for this GPU name in the repository (kernels/dispatch_tables/<gpu>.json): the entry of this
   (K, N), else the one of the nearest K * N;
3. the built-in tables (kernels/config.py, measured on an H100 80GB HBM3).
Only a field left at its built-in value is replaced: a table the user set is theirs. A plan using a found table
says so once per table file (one line on stderr). GPUs without the kernels (kernels/device.py) keep the config.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .config import DEFAULT_CROSSOVER, DEFAULT_CROSSOVER_NONGATED, KernelConfig, parse_crossover
from .device import kernels_supported
from .loader import source_hash

FORMAT = "sfl-dispatch-table/1"
RECORD_DIR = Path(__file__).resolve().parent / "dispatch_tables"
KINDS = {"gated": ("crossover", DEFAULT_CROSSOVER), "nongated": ("crossover_nongated", DEFAULT_CROSSOVER_NONGATED)}


@dataclass(frozen=True)
class GpuIdentity:
    """What a measured table depends on besides the kernels and the shape."""

    name: str
    capability: tuple[int, int]
    driver: str
    torch: str
    cuda: str | None


def slug(text: str) -> str:
    """A file-name-safe lower-case form: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")


def driver_version() -> str:
    """The NVIDIA driver release (e.g. '570.86.15') from /proc, else the CUDA driver API version torch reports."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", first)
        if found:
            return found.group(1)
    except (OSError, IndexError):
        pass
    return f"cuda-api-{torch._C._cuda_getDriverVersion()}"


@functools.lru_cache(maxsize=None)
def current_gpu(index: int | None = None) -> GpuIdentity | None:
    """The identity of CUDA device `index` (default: the current one); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if index is None else index
    return GpuIdentity(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)),
                       driver_version(), torch.__version__, torch.version.cuda)


@functools.lru_cache(maxsize=1)
def kernels_source() -> str:
    """The kernels' source hash (loader.source_hash), read once per process: every plan of a model asks."""
    return source_hash()


def cache_dir() -> Path:
    """Where calibrated tables are cached: $XDG_CACHE_HOME/sfl/dispatch, else ~/.cache/sfl/dispatch."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sfl" / "dispatch"


def cache_key(gpu: GpuIdentity, kind: str, K: int, N: int, kernels: str) -> str:
    """The cache file's stem: GPU name, driver, torch version, kernel sources (source_hash()), block kind and shape."""
    return slug(f"{gpu.name}_driver-{gpu.driver}_torch-{gpu.torch}_kernels-{kernels}_{kind}-k{K}-n{N}")


def record_path(gpu_name: str, record_dir: Path | None = None) -> Path:
    return Path(record_dir or RECORD_DIR) / f"{slug(gpu_name)}.json"


@dataclass(frozen=True)
class Found:
    crossover: str
    origin: str   # the file it came from


def _entries(path: Path, kind: str) -> list[dict[str, Any]]:
    """The well-formed tables of `kind` in a cache file (one table) or a table of record (a list); an unreadable
    or malformed file is skipped with a warning (never a failed model construction)."""
    if not path.is_file():
        return []
    try:
        with open(path) as f:
            data = json.load(f)
        found = [e for e in data.get("tables", [data]) if e.get("kind") == kind]
        for e in found:
            parse_crossover(e["crossover"])
            if not (isinstance(e["K"], int) and isinstance(e["N"], int)):
                raise ValueError(f"K={e['K']!r}, N={e['N']!r}")
        return found
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        warnings.warn(f"sfl: ignoring the dispatch table {path} ({e}); rerun python -m sfl.kernels.calibrate",
                      RuntimeWarning, stacklevel=2)
        return []


def lookup(gpu: GpuIdentity, kind: str, K: int, N: int, *, kernels: str, cache: Path | None,
           record_dir: Path | None = None) -> Found | None:
    """The table for this GPU, block kind and shape: the user's cache, then the table of record (exact shape, else
    the nearest K * N of that kind); None: the built-in one."""
    if cache is not None:
        path = Path(cache) / f"{cache_key(gpu, kind, K, N, kernels)}.json"
        for e in _entries(path, kind):
            if (e["K"], e["N"]) == (K, N):
                return Found(e["crossover"], str(path))
    path = record_path(gpu.name, record_dir)
    entries = _entries(path, kind)
    if not entries:
        return None
    best = min(entries, key=lambda e: ((e["K"], e["N"]) != (K, N), abs(math.log(e["K"] * e["N"] / (K * N)))))
    return Found(best["crossover"], str(path))


_NOTICED: set[str] = set()


def resolve(config: KernelConfig, K: int, N: int, gpu: GpuIdentity | None, *, kernels: str | None = None,
            cache: Path | None = None, record_dir: Path | None = None) -> KernelConfig:
    """`config` with each crossover table left at its built-in value replaced by the table found for this GPU and
    shape (lookup order: module docstring); one notice per table file."""
    if gpu is None:
        return config
    changes: dict[str, str] = {}
    for kind, (field, builtin) in KINDS.items():
        if getattr(config, field) != builtin:
            continue
        found = lookup(gpu, kind, K, N, kernels=kernels or kernels_source(), cache=cache, record_dir=record_dir)
        if found is None:
            continue
        changes[field] = found.crossover
        if found.origin not in _NOTICED:
            _NOTICED.add(found.origin)
            print(f"sfl: dispatch tables for {gpu.name} from {found.origin}", file=sys.stderr)
    return config.replace(**changes) if changes else config


def for_current_gpu(config: KernelConfig, K: int, N: int) -> KernelConfig:
    """resolve() for the current CUDA device, with the user's cache; the config as it is on GPUs without the kernels
    and without CUDA."""
    if not kernels_supported()[0]:
        return config
    return resolve(config, K, N, current_gpu(), cache=cache_dir())


def entry(gpu: GpuIdentity, kind: str, K: int, N: int, crossover: str, **provenance: Any) -> dict[str, Any]:
    """A table as stored in the cache and in a table of record (one per block kind and shape)."""
    parse_crossover(crossover)
    return {"format": FORMAT, "kind": kind, "K": K, "N": N, "crossover": crossover, "gpu": asdict(gpu),
            **provenance}


def write_cache(e: dict[str, Any], gpu: GpuIdentity, kernels: str, cache: Path) -> Path:
    path = Path(cache) / f"{cache_key(gpu, e['kind'], e['K'], e['N'], kernels)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(e, indent=1) + "\n")
    return path


def write_record(entries: list[dict[str, Any]], gpu: GpuIdentity, record_dir: Path) -> Path:
    """Merge `entries` into the table of record for this GPU name (an entry of the same kind and shape is
    replaced)."""
    path = record_path(gpu.name, record_dir)
    old = json.loads(path.read_text()).get("tables", []) if path.is_file() else []
    new_keys = {(e["kind"], e["K"], e["N"]) for e in entries}
    tables = [e for e in old if (e.get("kind"), e.get("K"), e.get("N")) not in new_keys] + entries
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "gpu": gpu.name, "tables": tables}, indent=1) + "\n")
    return path


__all__ = ["GpuIdentity", "Found", "lookup", "resolve", "for_current_gpu", "current_gpu", "cache_dir", "cache_key",
           "record_path", "entry", "write_cache", "write_record", "slug", "RECORD_DIR"]
