"""SHA-256 of every weight file of a save_pretrained folder, written beside them and checked before loading.

`write_weight_hashes(dir)` records {file: {"sha256", "bytes"}} of each `*.safetensors` / `*.bin` in
`dir/weights.sha256.json` (experiments/trainer/checkpoint.py calls it for every hf/ and final/ copy it writes, and
experiments/trainer/distributed.py for every checkpoint's dcp/ shards, which a resume checks before loading);
`verify_weight_hashes(dir)` recomputes them and raises WeightIntegrityError on any difference (a flipped
bit, a truncated or missing file, a weight file that was not recorded). experiments/trainer/evaluate.py calls the
verifier before it loads a model, so a damaged file is refused instead of scored.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .rundir import tmp_name

HASH_FILE = "weights.sha256.json"
# save_pretrained's weights, and a torch.distributed.checkpoint folder's shards (__<rank>_<i>.distcp) and index
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp")
WEIGHT_NAMES = (".metadata",)
_CHUNK = 1 << 22


class WeightIntegrityError(ValueError):
    """A weight file differs from the SHA-256 recorded when it was saved."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a save_pretrained or DCP folder (single file or shards), sorted by name."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_NAMES))


def write_weight_hashes(model_dir: Path) -> Path:
    """Record the SHA-256 and size of each weight file in model_dir/weights.sha256.json (temp file + rename)."""
    model_dir = Path(model_dir)
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in weight_files(model_dir)}
    dest = model_dir / HASH_FILE
    tmp = dest.with_name(tmp_name(HASH_FILE))
    tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1) + "\n")
    os.replace(tmp, dest)
    return dest


def verify_weight_hashes(model_dir: Path) -> bool:
    """Check model_dir's weight files against its weights.sha256.json: True when they all match, False when
    the folder has no hash file (nothing to check); raises WeightIntegrityError saying what differs."""
    model_dir = Path(model_dir)
    record = model_dir / HASH_FILE
    if not record.is_file():
        return False
    try:
        files = json.loads(record.read_text())["files"]
        expected = {name: (str(v["sha256"]), int(v["bytes"])) for name, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightIntegrityError(f"{record} is unreadable ({type(e).__name__}: {e}); the weights cannot be "
                                   f"checked: restore the folder from its source") from None
    unlisted = sorted({p.name for p in weight_files(model_dir)} - set(expected))
    if unlisted:
        raise WeightIntegrityError(f"{model_dir}: weight file(s) {', '.join(unlisted)} are not in {HASH_FILE} "
                                   "(added after the save?); remove them or restore the folder")
    for name, (digest, size) in sorted(expected.items()):
        path = model_dir / name
        if not path.is_file():
            raise WeightIntegrityError(f"{path} is missing ({HASH_FILE} lists it); restore the folder")
        if path.stat().st_size != size:
            raise WeightIntegrityError(f"{path} has {path.stat().st_size:,} bytes, {size:,} when saved "
                                       "(truncated or replaced); restore it from an intact copy")
        if sha256_file(path) != digest:
            raise WeightIntegrityError(f"{path} does not match the SHA-256 recorded when it was saved (the file "
                                       "is corrupted); restore it from an intact copy")
    return True
