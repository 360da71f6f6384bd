"""lm-eval task YAML templates (data/tasks/) -> a concrete include dir that the lm-eval CLI uses as it is.

lm-eval's `dataset_kwargs.data_files` needs real paths, so the templates carry the placeholder
@SFL_EVAL_DIR@, replaced here by the eval dir of a prepared data dir (or any dir holding
<task>.jsonl files in the uniform {"id","question","choices","gold"} form). `write_tasks` is the one writer:
`python -m sfl.data.prepare` calls it after the eval step (-> <data_dir>/lm_tasks/), experiments/trainer/evaluate.py
calls it for its temp include dir, and by hand:

    python -m sfl.data.lm_tasks write-tasks --out DIR [--eval-dir DIR | --data-dir DIR] [--tasks all]
    lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --include_path DIR --tasks sfl_piqa

No lm-eval import.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import EVAL_TASKS, DataNotPrepared, paths, read_manifest

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


class EvalDataError(ValueError):
    """An eval file that differs from what data.prepare recorded; the message names the file and the fix."""


def check_eval_files(eval_dir: Path, tasks: list[str]) -> None:
    """Check each task file against the `eval` record of the data dir's manifest.json: its size and its row
    count (a file cut to 10 lines would otherwise be scored as n = 10). An eval dir outside a prepared data
    dir (no manifest beside it, e.g. --eval-dir of hand-made files) has nothing to check against."""
    manifest = eval_dir.parent / "manifest.json"
    if eval_dir.name != "eval" or not manifest.is_file():
        return
    rec = read_manifest(manifest)["steps"].get("eval")
    fix = f"rebuild it with `python -m sfl.data.prepare --only eval --data-dir {eval_dir.parent}`"
    if rec is None:
        raise EvalDataError(f"{manifest} has no record of the eval step, so {eval_dir} cannot be trusted; {fix}")
    for t in tasks:
        f = eval_dir / f"{t}.jsonl"
        files = rec.get("files", {}).get(f"eval/{t}.jsonl")
        n_rec = rec.get("info", {}).get("tasks", {}).get(t, {}).get("n")
        with open(f, "rb") as fh:
            rows = sum(1 for line in fh if line.strip())
        if n_rec is not None and rows != n_rec:
            raise EvalDataError(f"{f} has {rows} rows but {manifest} records {n_rec}: the file was cut short or "
                                f"edited after preparation (scores would be over {rows} docs); {fix}")
        if files is not None and f.stat().st_size != files["bytes"]:
            raise EvalDataError(f"{f} has {f.stat().st_size} bytes but {manifest} records {files['bytes']}: the "
                                f"file was edited after preparation; {fix}")


def write_tasks(eval_dir: Path, dest: Path, tasks: list[str] | None = None) -> Path:
    """Write the YAMLs of `tasks` (default: all 7) + the utils.py they reference into dest, with eval_dir's
    absolute path substituted (returns dest, absolute), after checking the task files against the data dir's manifest
    (`check_eval_files`). Files are written whole and renamed, so a reader never sees half a YAML."""
    tasks = list(EVAL_TASKS) if tasks is None else tasks
    eval_dir = Path(eval_dir).resolve()
    missing = [t for t in tasks if not (eval_dir / f"{t}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(
            f"eval data missing in {eval_dir}: {', '.join(t + '.jsonl' for t in missing)}. "
            f"Run `python -m sfl.data.prepare --only eval` (data dir from $SFL_DATA_DIR or --data-dir).")
    check_eval_files(eval_dir, tasks)
    dest = Path(dest).resolve()  # absolute: the `--include_path` printed for it works from any directory
    dest.mkdir(parents=True, exist_ok=True)
    _write_atomic(dest / "utils.py", (TEMPLATE_DIR / "utils.py").read_text())
    for t in tasks:
        _write_atomic(dest / f"{lm_eval_name(t)}.yaml", resolved_yaml(t, eval_dir))
    return dest


def resolved_yaml(task: str, eval_dir: Path) -> str:
    """The template of `task` with the placeholder replaced by eval_dir (absolute) and the header comment
    rewritten to say where the file came from."""
    text = (TEMPLATE_DIR / f"{lm_eval_name(task)}.yaml").read_text()
    if PLACEHOLDER not in text:
        raise RuntimeError(f"template {lm_eval_name(task)}.yaml lacks {PLACEHOLDER}")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("# Template:"))
    head = ("# Written by `python -m sfl.data.lm_tasks write-tasks` (or sfl.data.prepare) from data/tasks/; "
            "rewrite it after moving the data dir.\n")
    return head + body.replace(PLACEHOLDER, Path(eval_dir).resolve().as_posix()) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sfl.data.lm_tasks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-tasks", help="write resolved task YAMLs for `lm_eval --include_path`")
    w.add_argument("--out", required=True, help="include dir to write (created if missing)")
    w.add_argument("--eval-dir", default=None, help="dir with <task>.jsonl (default <data_dir>/eval)")
    w.add_argument("--data-dir", default=None, help="prepared data dir (default $SFL_DATA_DIR or <repo>/.data)")
    w.add_argument("--tasks", default="all", help="'all' or a comma list of short names")
    a = ap.parse_args(argv)

    eval_dir = Path(a.eval_dir) if a.eval_dir else paths(a.data_dir).eval
    try:
        tasks = parse_tasks(a.tasks)
        out = write_tasks(eval_dir, Path(a.out), tasks)
    except (ValueError, FileNotFoundError, DataNotPrepared) as e:  # EvalDataError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(tasks)} task YAMLs to {out} (data: {eval_dir.resolve()}); use them with\n"
          f"  lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True --include_path {out} "
          f"--tasks {','.join(lm_eval_name(t) for t in tasks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
