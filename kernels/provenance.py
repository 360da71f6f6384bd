"""Where, when and from which code a measurement was made: the commit, whether the tree was dirty, a hash of the
code itself, the host and the UTC time. The kernels' calibration and every experiment log record it (the
experiments add library versions and the run's details: experiments/trainer/provenance.py, which also verifies a
log's hash against its commit)."""
from __future__ import annotations

import datetime
import hashlib
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]  # the folder holding kernels/, models/, experiments/, ...
CODE_DIRS = ("sfl", "kernels", "models", "experiments", "data")
CODE_SUFFIXES = {".py", ".cu", ".cpp", ".h", ".cuh", ".sh", ".yaml"}


def git(*args: str) -> str | None:
    """git's answer in this checkout, or None (no git, not a checkout, an error)."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_tree_hash(root: Path = REPO_ROOT) -> str:
    """sha256 over the code that produced a number (sfl/, kernels/, models/, experiments/, data/ sources).

    The GPU machine gets a copy of the working tree without .git: this hash still ties a log to the exact code;
    `python -m sfl.experiments.trainer.provenance verify LOG...` checks a log's hash against its commit.
    """
    digest = hashlib.sha256()
    for top in CODE_DIRS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in CODE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def measurement_provenance() -> dict[str, Any]:
    """git_commit, git_dirty, source_tree_hash, git_head_local (when it differs), host, time_utc.

    An exported $SFL_GIT_COMMIT (and $SFL_GIT_DIRTY) names the commit: a machine given a copy of the tree can hold
    a stale .git (the checkout's base commit, with the local commits as uncommitted changes), so rev-parse there
    names the wrong one. Its local HEAD, when it differs, is kept as git_head_local.
    """
    local = git("rev-parse", "HEAD")
    exported = os.environ.get("SFL_GIT_COMMIT")
    commit = exported or local or None
    if commit in ("unknown", "HEAD\nunknown"):
        commit = None
    if exported:
        dirty: Any = os.environ.get("SFL_GIT_DIRTY")
    else:
        status = git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    return {"git_commit": commit, "git_dirty": dirty, "source_tree_hash": source_tree_hash(),
            **({"git_head_local": local} if local and local != commit else {}),
            "host": socket.gethostname(),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
