"""Crash-safe training checkpoints: <out_dir>/checkpoints/step_XXXXXXX/{state.pt, dcp/, COMPLETE}.

state.pt holds step, scheduler, RNG, counters and config; dcp/ the model and optimizer, written by every rank
through torch.distributed.checkpoint (experiments/distributed.py).

A checkpoint is written into a hidden temp dir, every file fsynced, the COMPLETE marker written
last, then the dir is renamed into place (os.replace is atomic on POSIX) and latest.json is
swapped atomically. A kill at any moment leaves either the old set or the new one; stray temp dirs
are ignored by `find_latest` and removed by the next save. The newest two are kept.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

_TMP_PREFIX = ".tmp-"
_KEEP = 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a fsynced temp file + os.replace."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}")
    _write_file(tmp, text.encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def ckpt_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _complete(d: Path) -> bool:
    return (d / "COMPLETE").is_file() and (d / "state.pt").is_file()


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoint dirs, oldest first."""
    root = ckpt_root(out_dir)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and _complete(d)]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def find_latest(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (latest.json if it points at one, else a directory scan)."""
    root = ckpt_root(out_dir)
    try:
        name = json.loads((root / "latest.json").read_text())["dir"]
        if _complete(root / name):
            return root / name
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def begin_checkpoint(out_dir: str | Path, step: int) -> Path:
    """A fresh hidden temp dir for checkpoint `step` (leftovers of crashed saves removed first)."""
    root = ckpt_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):  # leftovers of a crashed save
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    tmp = root / f"{_TMP_PREFIX}step_{step:07d}.{os.getpid()}"
    tmp.mkdir()
    return tmp


def write_state(tmp: Path, state: dict[str, Any]) -> None:
    """state.pt (fsynced) into a checkpoint temp dir."""
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def commit_checkpoint(out_dir: str | Path, step: int, tmp: Path) -> Path:
    """Mark a fully written temp dir COMPLETE, move it into place atomically, point latest.json at it and
    keep the newest two; returns its final dir."""
    root = ckpt_root(out_dir)
    for sub in [tmp, *(d for d in tmp.iterdir() if d.is_dir())]:  # DCP writes a subdir
        _fsync_dir(sub)
    _write_file(tmp / "COMPLETE", f"{step}\n".encode())
    _fsync_dir(tmp)
    final = root / f"step_{step:07d}"
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / "latest.json", json.dumps({"dir": final.name, "step": step}))
    for old in list_checkpoints(out_dir)[:-_KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Atomically write `state` as checkpoint `step`; keep the newest two; return its dir."""
    tmp = begin_checkpoint(out_dir, step)
    write_state(tmp, state)
    return commit_checkpoint(out_dir, step, tmp)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", model: bool = True) -> dict[str, Any]:
    """state.pt of a checkpoint dir; with model=True also "model": the full model state dict, read in this
    process from the checkpoint's DCP shards (dcp/, written by experiments/distributed.py) when it has them."""
    # weights_only=False: the state holds numpy / python RNG states (our own files only).
    state = torch.load(Path(path) / "state.pt", map_location=map_location, weights_only=False)
    if model and "model" not in state and (Path(path) / "dcp").is_dir():
        state["model"] = read_dcp_tensors(Path(path) / "dcp", "model.")
    return state


def read_dcp_tensors(dcp_dir: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors stored under `prefix` in a torch.distributed.checkpoint dir, read by this process alone
    (whatever number of ranks wrote it), keys without the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns about no_dist even when asked for it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(out, checkpoint_id=str(dcp_dir), no_dist=True)
    return {k[len(prefix):]: v for k, v in out.items()}
