"""Paired comparison of two checkpoints evaluated on the same requests: bootstrap over documents.

    python -m sfl.experiments.trainer.paired_eval BASE OTHER [--metric acc|acc_norm] [--n-boot 10000] [--seed 0] [--json F]

BASE and OTHER are eval dirs (holding eval.json) or eval*.json files written by experiments/trainer/evaluate.py, which
stores each document's 0/1 score under "per_doc"; either may list several, comma-separated (the seeds of one
configuration): each document's score is then the mean over them. The change is OTHER - BASE. Each bootstrap replicate draws the
document indices of every task with replacement, the same indices for both models, and recomputes each task's
accuracy change and their mean over tasks (the "mean accuracy" of the tables); the 95% interval is the 2.5 / 97.5
percentiles of the replicates. Pairing matters: most documents are answered the same by both models, so the
interval of the change is much narrower than the two accuracies' own standard errors suggest.

Both files must hold the same requests per task (same docs_sha256: same documents, prompts, few-shot context and
targets); eval.json files written before per-document scores were kept raise NoPerDocLog, and the notebooks say
"n/a (no per-document log)" for them. numpy only: no lm-eval import.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .rundir import tmp_name

MEAN = "mean"  # key of the task-mean row
NO_LOG = "n/a (no per-document log)"
NOT_PAIRED = "n/a (not the same requests)"


class NoPerDocLog(ValueError):
    """An eval.json without per-document scores (written before evaluate.py kept them)."""


class NotPaired(ValueError):
    """Two eval.json files that did not score the same requests."""


class BadEvalFile(ValueError):
    """An eval.json that is not a JSON object (torn by a killed writer, or not written by evaluate.py)."""


@dataclass(frozen=True)
class PairedDelta:
    """OTHER - BASE accuracy (fractions, not points) with a bootstrap interval."""

    base: float
    other: float
    delta: float
    lo: float
    hi: float
    n: int  # documents (for the task mean: summed over tasks)

    def points(self) -> str:
        """'-0.37 [-1.21, +0.48]' in accuracy points (x100)."""
        d, lo, hi = (100 * x + 0.0 for x in (self.delta, self.lo, self.hi))  # + 0.0: no "-0.00"
        return f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def paired_bootstrap(base: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray], n_boot: int = 10_000,
                     seed: int = 0, level: float = 0.95) -> dict[str, PairedDelta]:
    """Per-task and task-mean accuracy change OTHER - BASE with a percentile bootstrap interval.

    base/other: task -> per-document scores (0/1, or any per-doc metric), index i = the same document in both.
    Every replicate resamples each task's document indices with replacement (one draw shared by both models) and
    averages the per-task changes into the task-mean change, as the tables' mean accuracy averages tasks."""
    if set(base) != set(other) or not base:
        raise ValueError(f"base and other must hold the same non-empty set of tasks: {sorted(base)} vs {sorted(other)}")
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError("n_boot must be >= 1 and level in (0, 1)")
    rng = np.random.default_rng(seed)
    q = [(1 - level) / 2, (1 + level) / 2]
    out: dict[str, PairedDelta] = {}
    boot_sum = np.zeros(n_boot)
    for task in base:  # a fixed task order: the replicates depend only on (seed, tasks, n)
        a, b = np.asarray(base[task], dtype=float), np.asarray(other[task], dtype=float)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise ValueError(f"{task}: per-document scores must be two equal-length non-empty vectors, "
                             f"got {a.shape} and {b.shape}")
        boot = _resampled_means(b - a, n_boot, rng)
        boot_sum += boot
        lo, hi = np.quantile(boot, q)
        out[task] = PairedDelta(float(a.mean()), float(b.mean()), float((b - a).mean()), float(lo), float(hi),
                                int(a.size))
    k = len(base)
    boot_mean = boot_sum / k
    lo, hi = np.quantile(boot_mean, q)
    out[MEAN] = PairedDelta(float(np.mean([out[t].base for t in base])), float(np.mean([out[t].other for t in base])),
                            float(np.mean([out[t].delta for t in base])), float(lo), float(hi),
                            sum(out[t].n for t in base))
    return out


def _resampled_means(diff: np.ndarray, n_boot: int, rng: np.random.Generator,
                     max_draws: int = 1 << 22) -> np.ndarray:
    """Mean of `diff` over n_boot resamples of its indices with replacement (chunked to bound memory)."""
    n = diff.size
    rows = max(1, max_draws // n)
    out = np.empty(n_boot)
    for s in range(0, n_boot, rows):
        idx = rng.integers(0, n, size=(min(rows, n_boot - s), n))
        out[s:s + idx.shape[0]] = diff[idx].mean(axis=1)
    return out


# ----------------------------------------------------------------------------------------- eval.json files

def load_eval(path: str | Path) -> dict[str, Any]:
    """An eval.json (or the directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "eval.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no eval.json; pass an eval dir or eval*.json written by "
                                "`python -m sfl.experiments.trainer.evaluate`")
    try:
        ev = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadEvalFile(f"{p} is not valid JSON ({e}); it is torn or not an eval.json: run "
                          "`python -m sfl.experiments.trainer.evaluate` again for it") from None
    if not isinstance(ev, dict) or not isinstance(ev.get("tasks"), dict):
        raise BadEvalFile(f"{p} holds no \"tasks\" object, so it is not an eval.json written by "
                          "`python -m sfl.experiments.trainer.evaluate`; pass the right file or evaluate again")
    ev["_path"] = str(p)
    return ev


def per_doc_scores(ev: Mapping[str, Any], metric: str = "acc") -> dict[str, tuple[np.ndarray, str]]:
    """task -> (0/1 scores by doc_id, docs_sha256) of `metric`; a task without acc_norm (e.g. winogrande) uses
    acc, as the tables' mean over tasks does."""
    per_doc = ev.get("per_doc")
    if not per_doc:
        raise NoPerDocLog(f"{ev.get('_path', 'eval.json')} has no per-document scores (written before "
                          "evaluate.py kept them): re-run the eval, or `--replay` its scores.npz, to get them")
    out = {}
    for task, rec in per_doc.items():
        bits = rec.get(metric) if rec.get(metric) is not None else rec.get("acc")
        if bits is None:
            raise NoPerDocLog(f"{ev.get('_path')}: task {task} has no per-document {metric} or acc")
        out[task] = (np.frombuffer(bits.encode(), dtype=np.uint8) - ord("0"), rec["docs_sha256"])
    return out


def compare(base_ev: Mapping[str, Any], other_ev: Mapping[str, Any], metric: str = "acc", n_boot: int = 10_000,
            seed: int = 0, level: float = 0.95) -> dict[str, PairedDelta]:
    """paired_bootstrap over two eval.json dicts; raises NoPerDocLog / NotPaired with what to do."""
    return compare_seeds([base_ev], [other_ev], metric, n_boot, seed, level)


def compare_seeds(base_evs: list[Mapping[str, Any]], other_evs: list[Mapping[str, Any]], metric: str = "acc",
                  n_boot: int = 10_000, seed: int = 0, level: float = 0.95) -> dict[str, PairedDelta]:
    """compare() of two configurations with one or more seeds each: a document's score is its mean over the seeds
    of its configuration, so the interval is over documents at the seeds run (seed-to-seed spread is not in it:
    report the per-seed accuracies beside it). All evals must have scored the same requests."""
    if not base_evs or not other_evs:
        raise ValueError("each side needs at least one eval")
    evs = [*base_evs, *other_evs]
    scores = [per_doc_scores(ev, metric) for ev in evs]
    for ev, sc in zip(evs[1:], scores[1:]):
        compare_requests(evs[0], scores[0], ev, sc)
    nb = len(base_evs)
    mean = lambda group: {t: np.mean([sc[t][0] for sc in group], axis=0) for t in scores[0]}
    return paired_bootstrap(mean(scores[:nb]), mean(scores[nb:]), n_boot, seed, level)


def compare_requests(ev_a: Mapping[str, Any], a: Mapping[str, tuple[np.ndarray, str]], ev_b: Mapping[str, Any],
                     b: Mapping[str, tuple[np.ndarray, str]]) -> None:
    """Raise NotPaired unless the two evals scored the same tasks and requests."""
    if set(a) != set(b):
        raise NotPaired(f"{ev_a.get('_path')} and {ev_b.get('_path')} hold different tasks ({sorted(a)} vs "
                        f"{sorted(b)}); evaluate both with the same --tasks")
    for t in a:
        if a[t][1] != b[t][1] or a[t][0].size != b[t][0].size:
            raise NotPaired(f"{t}: the two evals scored different requests ({a[t][0].size} vs {b[t][0].size} docs, "
                            "docs_sha256 differs): use the same --limit, --num-fewshot, eval data and task templates")


def change_with_interval(base_ev: Mapping[str, Any] | None, other_ev: Mapping[str, Any] | None,
                         metric: str = "acc", n_boot: int = 10_000) -> str:
    """Task-mean change OTHER - BASE in points with its 95% interval, or NO_LOG when either has no per-doc scores
    (never an interval made up for an old log), or NOT_PAIRED when they scored different requests."""
    if base_ev is None or other_ev is None:
        return NO_LOG
    try:
        return compare(base_ev, other_ev, metric, n_boot)[MEAN].points()
    except NoPerDocLog:
        return NO_LOG
    except NotPaired:
        return NOT_PAIRED


def format_table(res: Mapping[str, PairedDelta], level: float = 0.95) -> str:
    rows = [f"{'task':<16}{'n':>7}{'base':>9}{'other':>9}{'change (points)':>17}   {int(100 * level)}% interval"]
    for t, d in res.items():
        rows.append(f"{t:<16}{d.n:>7}{100 * d.base:>9.2f}{100 * d.other:>9.2f}{100 * d.delta:>+17.2f}   "
                    f"[{100 * d.lo:+.2f}, {100 * d.hi:+.2f}]")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sfl.experiments.trainer.paired_eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="eval dir(s) or eval*.json of the reference (e.g. the dense twin); comma-separated "
                                 "for several seeds")
    ap.add_argument("other", help="eval dir(s) or eval*.json compared against it (change = other - base)")
    ap.add_argument("--metric", default="acc", choices=["acc", "acc_norm"])
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--level", type=float, default=0.95)
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    try:
        base = [load_eval(x) for x in a.base.split(",")]
        other = [load_eval(x) for x in a.other.split(",")]
        res = compare_seeds(base, other, a.metric, a.n_boot, a.seed, a.level)
    except (FileNotFoundError, NoPerDocLog, NotPaired, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = lambda evs: ",".join(ev["_path"] for ev in evs)
    print(f"{a.metric}: {names(other)} - {names(base)} (paired bootstrap over documents, {a.n_boot} "
          f"replicates, seed {a.seed}{'; per-document mean over seeds' if len(base) + len(other) > 2 else ''})")
    print(format_table(res, a.level))
    if a.json:
        dest = Path(a.json)
        tmp = dest.with_name(tmp_name(dest.name))  # temp file + rename: a kill never leaves a torn file
        tmp.write_text(json.dumps({"base": names(base), "other": names(other), "metric": a.metric,
                                   "n_boot": a.n_boot, "seed": a.seed, "level": a.level,
                                   "tasks": {t: asdict(d) for t, d in res.items()}}, indent=1) + "\n")
        os.replace(tmp, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
