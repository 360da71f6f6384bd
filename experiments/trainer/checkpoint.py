"""Crash-safe training checkpoints: <out_dir>/checkpoints/step_XXXXXXX/{state.pt, dcp/, hf/, COMPLETE}.

state.pt holds step, scheduler, RNG, counters and config; dcp/ the model and optimizer, written by every rank
through torch.distributed.checkpoint (experiments/trainer/distributed.py); hf/ (config key ckpt_hf) a save_pretrained
copy of the same weights that `AutoModelForCausalLM.from_pretrained(dir / "hf", trust_remote_code=True)` opens.

A checkpoint is written into a hidden temp dir owned by this process (`.tmp-step_XXXXXXX.<pid>`), every
file fsynced, the COMPLETE marker written last, then the dir is renamed into place (os.replace is atomic on
POSIX) and latest.json is swapped atomically. A kill at any moment leaves either the old set or the new one;
stray temp dirs are ignored by `find_latest` and removed at the next start-up (experiments/trainer/rundir.py, under
the run directory's lock). The newest two are kept. A write that fails (a full disk above all) removes its
temp dir and raises CheckpointWriteError saying so; the previous checkpoint is untouched. A checkpoint
leaves rotation by a rename to a temp name before its removal, so a kill mid-removal leaves a temp entry
(removed at the next start), never a half-deleted `step_*` dir.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoTokenizer

from .rundir import describe_os_error, tmp_name
from .weight_hashes import write_weight_hashes

KEEP = 2


class RunWriteError(OSError):
    """A file of the run (log, checkpoint, final model) could not be written; the message says what is kept
    and what to do."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message alone, without OSError's "[Errno N]" prefix


class CheckpointWriteError(RunWriteError):
    """A checkpoint could not be written (e.g. no space left on device); the previous one is intact."""


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: `exc` itself or one in its chain, or one named in the message of a
    library error that carries no errno (safetensors reports a full disk as `... Os { code: 28, ... }`)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        m = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(e))
        if m:
            code = int(m.group(1) or m.group(2))
            return OSError(code, os.strerror(code))
        if "No space left on device" in str(e):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        e = e.__cause__ or e.__context__
    return None


def kept_checkpoint(out_dir: str | Path, previous: bool = False) -> str:
    """What a failed write leaves to resume from."""
    prev = find_latest(out_dir)
    if prev is not None:
        return f"{'the previous ' if previous else ''}checkpoint {prev.name} is intact, so `--resume` continues from it"
    return f"no {'earlier ' if previous else ''}checkpoint exists, so `--resume` starts the run again"


def write_failure(e: OSError, what: str, out_dir: str | Path) -> RunWriteError:
    """The error for a failed write of `what` in a run dir: the cause in words (a full disk named as such),
    what is kept, what to do."""
    todo = ("free disk space (or move out_dir) and rerun with --resume" if e.errno in (errno.ENOSPC, errno.EDQUOT)
            else "fix the cause and rerun with --resume")
    return RunWriteError(e.errno, f"writing {what} failed: {describe_os_error(e)}; {kept_checkpoint(out_dir)}: {todo}")


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
    tmp = path.with_name(tmp_name(path.name))
    try:
        _write_file(tmp, text.encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


class _RecordingWriter:
    """File wrapper that keeps the OSError of a failed write: torch.save reports a short write as
    "inline_container.cc: unexpected pos", which hides that the disk was full."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, b: bytes) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _disk_error(exc: BaseException, writer: _RecordingWriter | None) -> OSError | None:
    """The OSError behind a failed checkpoint write, if any (the recorded one, or one in the chain)."""
    if writer is not None and writer.error is not None:
        return writer.error
    return os_error_of(exc)


def _save_state(path: Path, state: dict[str, Any]) -> None:
    writer = None
    try:
        with open(path, "wb") as f:
            writer = _RecordingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        cause = _disk_error(e, writer)
        if cause is None:
            raise
        raise cause from e


def begin_checkpoint(out_dir: str | Path, step: int) -> Path:
    """This process's fresh hidden temp dir for checkpoint `step` (`.tmp-step_XXXXXXX.<pid>`; other processes'
    temp entries are left alone: stale ones are removed at start-up, experiments/trainer/rundir.py)."""
    root = ckpt_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / tmp_name(f"step_{step:07d}")
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an earlier failed save of this step
    try:
        tmp.mkdir()
    except OSError as e:
        raise abort_checkpoint(e, out_dir, step, tmp) from e
    return tmp


HF_SUBDIR = "hf"


def write_pretrained(model: torch.nn.Module, dest: Path, tokenizer_dir: Path | None = None) -> None:
    """save_pretrained into dest (config.json with auto_map, model.safetensors, the modelling code), plus the
    tokenizer of `tokenizer_dir` if there is one and the weights' SHA-256 (weights.sha256.json, checked by
    evaluate); every file fsynced. dest must be a fresh path inside a temp
    dir that is renamed into place afterwards (a checkpoint's, or final/'s), so it is never seen half-written."""
    model.save_pretrained(dest)
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(dest)
    write_weight_hashes(dest)
    fsync_tree(dest)


def fsync_tree(root: Path) -> None:
    """fsync every file and dir under root (save_pretrained does not), so a rename after it publishes data
    that survive a power loss."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def write_state(tmp: Path, state: dict[str, Any]) -> None:
    """state.pt (fsynced) into a checkpoint temp dir; a failed write raises the OSError behind it."""
    _save_state(tmp / "state.pt", state)


def abort_checkpoint(e: OSError, out_dir: str | Path, step: int, tmp: Path) -> CheckpointWriteError:
    """Remove the temp dir of a checkpoint whose write failed; the CheckpointWriteError to raise."""
    shutil.rmtree(tmp, ignore_errors=True)
    return _write_error(e, ckpt_root(out_dir) / f"step_{step:07d}", out_dir)


def commit_checkpoint(out_dir: str | Path, step: int, tmp: Path) -> Path:
    """Mark a fully written temp dir COMPLETE, move it into place atomically, point latest.json at it and
    keep the newest two; returns its final dir."""
    root = ckpt_root(out_dir)
    final = root / f"step_{step:07d}"
    try:
        for sub in [tmp, *(d for d in tmp.iterdir() if d.is_dir())]:  # DCP writes a subdir
            _fsync_dir(sub)
        _write_file(tmp / "COMPLETE", f"{step}\n".encode())
        _fsync_dir(tmp)
    except OSError as e:
        raise abort_checkpoint(e, out_dir, step, tmp) from e
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / "latest.json", json.dumps({"dir": final.name, "step": step}))
    for old in list_checkpoints(out_dir)[:-KEEP]:
        remove_dir(old)
    return final


def remove_dir(path: Path) -> None:
    """Delete a checkpoint (or final/) dir: renamed to this process's temp name first (atomic), so a kill during
    the removal leaves a temp entry that the next start removes, not a torn `step_*` dir."""
    doomed = path.with_name(tmp_name(f"{path.name}.removed"))
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_torn_checkpoints(out_dir: str | Path) -> list[Path]:
    """Remove the `step_*` dirs that are not complete checkpoints (a removal killed half-way by an older
    version, which deleted in place); return them. Only under the run lock: a checkpoint is written under a
    temp name and renamed into place complete, so no live writer has an incomplete `step_*` dir."""
    root = ckpt_root(out_dir)
    torn = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and not _complete(d)] \
        if root.is_dir() else []
    for d in torn:
        shutil.rmtree(d, ignore_errors=True)
    return torn


def save_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Atomically write `state` as checkpoint `step`; keep the newest two; return its dir.

    Raises CheckpointWriteError (the previous checkpoint intact, our temp dir removed) when the write fails
    for an OS reason, e.g. ENOSPC."""
    tmp = begin_checkpoint(out_dir, step)
    try:
        write_state(tmp, state)
    except OSError as e:
        raise abort_checkpoint(e, out_dir, step, tmp) from e
    return commit_checkpoint(out_dir, step, tmp)


def _write_error(e: OSError, final: Path, out_dir: str | Path) -> CheckpointWriteError:
    kept = kept_checkpoint(out_dir, previous=True)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(final.parent).free
        what = (f"no space left on device (errno {errno.errorcode[e.errno]}) writing checkpoint {final.name} in "
                f"{final.parent} ({free / 2**20:.0f} MiB free now that its partial copy is removed)")
        todo = "free disk space (or move out_dir) and rerun with --resume"
    else:
        what = f"writing checkpoint {final.name} in {final.parent} failed: {describe_os_error(e)}"
        todo = "fix the cause and rerun with --resume"
    return CheckpointWriteError(e.errno, f"{what}; {kept}: {todo}")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", model: bool = True) -> dict[str, Any]:
    """state.pt of a checkpoint dir; with model=True also "model": the full model state dict, read in this
    process from the checkpoint's DCP shards (dcp/, written by experiments/trainer/distributed.py) when it has them."""
    # weights_only=False: the state holds numpy / python RNG states (our own files only).
    state = torch.load(Path(path) / "state.pt", map_location=map_location, weights_only=False)
    if model and "model" not in state and (Path(path) / "dcp").is_dir():
        state["model"] = read_dcp_tensors(Path(path) / "dcp", "model.")
    return state


def read_dcp_tensors(dcp_dir: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors stored under `prefix` in a torch.distributed.checkpoint dir, read by this process alone
    (whatever number of ranks wrote it), keys without the prefix."""
    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns about no_dist even when asked for it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(out, checkpoint_id=str(dcp_dir), no_dist=True)
    return {k[len(prefix):]: v for k, v in out.items()}
