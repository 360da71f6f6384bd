"""Provenance for every logged result: where, when and with what code a number was produced."""
from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch

# the commit, the tree hash, host and time: one implementation, which the kernels' calibration records too
from sfl.kernels.provenance import CODE_DIRS, REPO_ROOT, git, measurement_provenance, source_tree_hash


def tree_hash_at(commit: str) -> str | None:
    """source_tree_hash of a commit's tree (git archive into a temp dir), or None when git does not know it."""
    top = git("ls-tree", "--name-only", commit)  # archive only the code dirs that exist at that commit
    dirs = [d for d in CODE_DIRS if top and d in top.split("\n")]
    if not dirs:
        return None
    try:
        tar = subprocess.run(["git", "archive", "--format=tar", commit, *dirs], cwd=REPO_ROOT,
                             capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if tar.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
            tf.extractall(tmp, filter="data")
        return source_tree_hash(Path(tmp))


def log_provenance(path: Path) -> dict[str, Any] | None:
    """The provenance of a result file: a JSONL log's header row (or first row carrying git_commit), or a JSON
    object's `provenance`; None for files without one."""
    rows: list[Any] = []
    text = path.read_text(errors="replace")
    if path.suffix == ".jsonl":
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    elif path.suffix == ".json":
        try:
            rows = [json.loads(text)]
        except json.JSONDecodeError:
            return None
    for r in rows:
        if isinstance(r, dict):
            prov = r.get("provenance") if isinstance(r.get("provenance"), dict) else r
            if prov.get("source_tree_hash") or prov.get("git_commit"):
                return prov
    return None


def verify(paths: list[Path]) -> list[tuple[Path, str]]:
    """(file, verdict) per file: 'verifies' when its source_tree_hash is the tree hash of its git_commit."""
    cache: dict[str, str | None] = {}
    out = []
    for p in paths:
        prov = log_provenance(p)
        if not prov:
            out.append((p, "no provenance"))
            continue
        commit, want = prov.get("git_commit"), prov.get("source_tree_hash")
        if not commit or not want:
            out.append((p, f"incomplete provenance (git_commit {commit!r}, source_tree_hash {want!r})"))
            continue
        if commit not in cache:
            cache[commit] = tree_hash_at(commit)
        got = cache[commit]
        verdict = ("verifies" if got == want else
                   f"commit {commit[:9]} unknown to this clone" if got is None else
                   f"DOES NOT VERIFY: logged {want}, commit {commit[:9]} has {got}")
        out.append((p, verdict))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sfl.experiments.trainer.provenance",
                                 description="verify LOG...: does each log's source_tree_hash equal its commit's?")
    ap.add_argument("cmd", choices=["verify"])
    ap.add_argument("paths", nargs="+", type=Path)
    a = ap.parse_args(argv)
    bad = 0
    for p, verdict in verify(a.paths):
        print(f"{p}: {verdict}")
        bad += verdict != "verifies"
    return 1 if bad else 0


def collect(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a flat dict: git commit + dirty flag, host, GPU, library versions, UTC time.

    The GPU machine receives a copy of the working tree whose .git may be absent or stale; an exported
    $SFL_GIT_COMMIT (and $SFL_GIT_DIRTY) names the commit then (run scripts export it), and a differing local
    HEAD is kept as git_head_local.
    """
    info: dict[str, Any] = {
        **measurement_provenance(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:  # optional: a machine may run the kernel benchmarks without transformers
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if extra:
        info.update(extra)
    return info


if __name__ == "__main__":
    sys.exit(main())
