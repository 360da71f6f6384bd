"""manifest.json: per-step record of outputs (sha256 + size), step version and params.

A step counts as done only if its record exists, its version and params equal the current ones and
every recorded file still has the recorded sha256. Records are written after the outputs, and the
old record is dropped before a rebuild starts, so an interrupted step is never mistaken for a done one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from . import read_manifest


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def canonical(obj: Any) -> str:
    """Stable JSON text (sorted keys) used to compare params and to digest records."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_dir(tmp_dir: Path, final: Path) -> None:
    """Move a fully written temp dir into place (old contents removed first)."""
    os.chmod(tmp_dir, 0o755)  # mkdtemp makes 0700 dirs
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp_dir, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final)


class Manifest:
    """Read/modify/write <data_dir>/manifest.json (each change is written atomically)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / "manifest.json"
        if self.path.is_file():
            self.data = read_manifest(self.path)  # malformed JSON: an error naming the file and the fix
        else:
            self.data = {"format": 1, "steps": {}}

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")

    def get(self, step: str) -> dict | None:
        return self.data["steps"].get(step)

    def drop(self, step: str) -> None:
        if self.data["steps"].pop(step, None) is not None:
            self.save()

    def record(self, step: str, version: int, params: dict, files: Iterable[Path], info: dict | None = None,
               seconds: float | None = None) -> dict:
        """Checksum `files` (absolute, inside root) and store the step record."""
        entries = {}
        for f in sorted(set(Path(x) for x in files)):
            entries[f.relative_to(self.root).as_posix()] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        rec = {"version": version, "params": json.loads(canonical(params)), "files": entries,
               "info": info or {}, "seconds": seconds, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.data["steps"][step] = rec
        self.save()
        return rec

    def check(self, step: str, version: int, params: dict) -> tuple[bool, str]:
        """(valid, reason). Verifies version, params and the sha256 of every recorded file."""
        rec = self.get(step)
        if rec is None:
            return False, "not built yet"
        if rec["version"] != version:
            return False, f"step version changed ({rec['version']} -> {version})"
        if canonical(rec["params"]) != canonical(params):
            return False, "params changed"
        if not rec["files"]:
            return False, "record lists no files"
        for rel, info in rec["files"].items():
            f = self.root / rel
            if not f.is_file():
                return False, f"missing file {rel}"
            if f.stat().st_size != info["bytes"]:
                return False, f"size mismatch for {rel}"
            if sha256_file(f) != info["sha256"]:
                return False, f"checksum mismatch for {rel}"
        return True, "ok"

    def digest(self, step: str) -> str | None:
        """Digest of a step's recorded outputs; downstream steps put it in their params so that a
        rebuilt upstream step makes them stale."""
        rec = self.get(step)
        if rec is None:
            return None
        return hashlib.sha256(canonical(rec["files"]).encode()).hexdigest()[:16]
