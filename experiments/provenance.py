"""Provenance for every logged result: where, when and with what code a number was produced."""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


_CODE_DIRS = ("sfl", "kernels", "models", "experiments", "data")
_CODE_SUFFIXES = {".py", ".cu", ".cpp", ".h", ".cuh", ".sh", ".yaml"}


def source_tree_hash() -> str:
    """sha256 over the code that produced a number (sfl/, kernels/, models/, experiments/, data/ sources).

    The GPU machine gets a copy of the working tree without .git: this hash still ties a log to the
    exact code, and `python -c "from sfl.experiments.provenance import source_tree_hash as h; print(h())"`
    at a commit checks whether that commit is the code of a log.
    """
    digest = hashlib.sha256()
    for top in _CODE_DIRS:
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if path.suffix in _CODE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def collect(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a flat dict: git commit + dirty flag, host, GPU, library versions, UTC time.

    The GPU machine receives a copy of the working tree whose .git may be absent or stale; an exported
    $SFL_GIT_COMMIT (and $SFL_GIT_DIRTY) names the commit then (run scripts export it), and a differing local
    HEAD is kept as git_head_local.
    """
    import torch

    # An exported SFL_GIT_COMMIT wins: the GPU machine's copy can hold a stale .git (the checkout's base commit,
    # with this session's commits as uncommitted changes), so rev-parse there names the wrong commit.
    local = _git("rev-parse", "HEAD")
    commit = os.environ.get("SFL_GIT_COMMIT") or local or None
    if commit in ("unknown", "HEAD\nunknown"):
        commit = None
    if os.environ.get("SFL_GIT_COMMIT"):
        dirty: Any = os.environ.get("SFL_GIT_DIRTY")
    else:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    info: dict[str, Any] = {
        "git_commit": commit,
        "git_dirty": dirty,
        "source_tree_hash": source_tree_hash(),
        **({"git_head_local": local} if local and local != commit else {}),
        "host": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if extra:
        info.update(extra)
    return info
