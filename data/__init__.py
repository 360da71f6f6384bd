"""Offline data for the project: where the prepared files live and a guard that says how to make them.

Light on purpose: training, models and kernels import this package on the GPU machine, which has
neither `datasets` nor `lm-eval`; everything heavy lives in `sfl.data.prepare` and its step modules.
"""
from __future__ import annotations

if __name__ == "data":  # imported by the bare name from a checkout: not this package (sfl/_shadow.py says why)
    from sfl._shadow import defer_to_installed

    defer_to_installed(__name__)

import json
import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT / ".data"
ENV_VAR = "SFL_DATA_DIR"

# The data-prep steps in the order `python -m sfl.data.prepare` runs them.
STEPS: tuple[str, ...] = ("tokenizer", "model", "text", "tokens", "eval")

# The 7 downstream tasks of the paper (short names used in eval.json and on the command line).
EVAL_TASKS: tuple[str, ...] = (
    "hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa",
)


def data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Resolve the data dir: explicit argument, else $SFL_DATA_DIR, else <repo>/.data."""
    if data_dir is not None:
        return Path(data_dir).expanduser().resolve()
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser().resolve() if env else DEFAULT_DATA_DIR


@dataclass(frozen=True)
class DataPaths:
    """Resolved locations inside one prepared data dir (see data/README.md for the layout)."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def model(self) -> Path:
        return self.root / "smollm2-135m"

    @property
    def text(self) -> Path:
        return self.root / "text"

    @property
    def tokens(self) -> Path:
        return self.root / "tokens"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    def eval_file(self, task: str) -> Path:
        return self.eval / f"{task}.jsonl"

    @property
    def lm_tasks(self) -> Path:
        """lm-eval include dir with the task YAMLs resolved to `eval` (rewritten by every prepare run)."""
        return self.root / "lm_tasks"


def paths(data_dir_: str | os.PathLike | None = None) -> DataPaths:
    """Resolved paths of the prepared data dir (nothing is checked; use `require` for that)."""
    return DataPaths(data_dir(data_dir_))


class DataNotPrepared(RuntimeError):
    """A prepared-data step is missing or incomplete; the message says which command makes it."""


def read_manifest(path: Path) -> dict:
    """Parse a manifest.json; a malformed one raises DataNotPrepared naming the file and the fix
    (FileNotFoundError passes through: callers say what a missing one means)."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("steps"), dict):
            raise ValueError("no 'steps' mapping")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise DataNotPrepared(
            f"{path} is not a valid data manifest ({e}): it was cut short or edited. Delete it and rerun "
            f"`python -m sfl.data.prepare --data-dir {Path(path).parent}`: every step is then checked again and "
            "rebuilt where needed (downloads are reused)") from None
    return data


def require(step: str, data_dir_: str | os.PathLike | None = None) -> DataPaths:
    """Return the paths if `step` was prepared (recorded in manifest.json and its files exist).

    Cheap: checks presence and sizes only. Full sha256 verification is what `python -m sfl.data.prepare`
    does on every run.
    """
    if step not in STEPS:
        raise ValueError(f"unknown data step {step!r}; known steps: {', '.join(STEPS)}")
    p = paths(data_dir_)
    hint = (f"run `python -m sfl.data.prepare --only {step}`"
            + (f" --data-dir {p.root}" if p.root != DEFAULT_DATA_DIR else "")
            + f" (data dir {p.root}; set ${ENV_VAR} or --data-dir to use another)")
    try:
        manifest = read_manifest(p.manifest)
    except FileNotFoundError:
        raise DataNotPrepared(f"data step '{step}' is not prepared: no {p.manifest}. To make it, {hint}") from None
    rec = manifest.get("steps", {}).get(step)
    if rec is None:
        raise DataNotPrepared(f"data step '{step}' is not prepared (not in {p.manifest}). To make it, {hint}")
    for rel, info in rec["files"].items():
        f = p.root / rel
        if not f.is_file() or f.stat().st_size != info["bytes"]:
            raise DataNotPrepared(f"data step '{step}' is incomplete: {f} is missing or has the wrong size. "
                                  f"To rebuild it, {hint}")
    return p
