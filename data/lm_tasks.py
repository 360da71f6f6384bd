"""lm-eval task YAML templates (data/tasks/) -> a concrete include dir.

lm-eval's `dataset_kwargs.data_files` needs real paths, so the templates carry the placeholder
@SFL_EVAL_DIR@, replaced here by the eval dir of a prepared data dir (or any dir holding
<task>.jsonl files in the uniform {"id","question","choices","gold"} form). No lm-eval import.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from . import EVAL_TASKS

TEMPLATE_DIR = Path(__file__).resolve().parent / "tasks"
PLACEHOLDER = "@SFL_EVAL_DIR@"
PREFIX = "sfl_"

# Split each task reads (also written in the YAML comment and data/README.md).
TASK_SPLITS = {"hellaswag": "validation", "commonsense_qa": "validation", "piqa": "validation",
               "winogrande": "validation", "arc_easy": "test", "arc_challenge": "test", "openbookqa": "test"}


def lm_eval_name(task: str) -> str:
    return PREFIX + task


def parse_tasks(spec: str) -> list[str]:
    """'all' or a comma list of short names (with or without the sfl_ prefix)."""
    if spec.strip() == "all":
        return list(EVAL_TASKS)
    out = []
    for t in spec.split(","):
        t = t.strip()
        t = t[len(PREFIX):] if t.startswith(PREFIX) else t
        if t not in EVAL_TASKS:
            raise ValueError(f"unknown task {t!r}; choose 'all' or from {', '.join(EVAL_TASKS)}")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("no tasks given")
    return out


def materialize(eval_dir: Path, dest: Path, tasks: list[str]) -> Path:
    """Write the YAMLs of `tasks` (+ utils.py they reference) into dest with eval_dir substituted."""
    eval_dir = Path(eval_dir).resolve()
    missing = [t for t in tasks if not (eval_dir / f"{t}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(
            f"eval data missing in {eval_dir}: {', '.join(t + '.jsonl' for t in missing)}. "
            f"Run `python -m sfl.data.prepare --only eval` (data dir from $SFL_DATA_DIR or --data-dir).")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(TEMPLATE_DIR / "utils.py", dest / "utils.py")
    for t in tasks:
        text = (TEMPLATE_DIR / f"{lm_eval_name(t)}.yaml").read_text()
        if PLACEHOLDER not in text:
            raise RuntimeError(f"template {lm_eval_name(t)}.yaml lacks {PLACEHOLDER}")
        (dest / f"{lm_eval_name(t)}.yaml").write_text(text.replace(PLACEHOLDER, eval_dir.as_posix()))
    return dest
