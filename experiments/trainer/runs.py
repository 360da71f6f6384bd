"""Small helpers for the experiment run scripts (experiments/*/run.sh); no training code lives here.

    python -m sfl.experiments.trainer.runs merge BASE.yaml [OVERRIDE.yaml ...] [--set key=value ...] -o OUT.yaml
    python -m sfl.experiments.trainer.runs done RESULT_DIR [--file train_log.jsonl]   # exit 0 iff a 'final' line exists
    python -m sfl.experiments.trainer.runs describe RUN_DIR                           # one-line summary of a finished run
    python -m sfl.experiments.trainer.runs summarize EXP_RESULTS_DIR                  # summary.csv (+ printed table);
                                                      # summary_seeds.csv where a configuration ran with several seeds
    python -m sfl.experiments.trainer.runs pick-dir BASE_DIR CONFIG.yaml [--fresh]    # "new|unfinished|finished <dir>"
    python -m sfl.experiments.trainer.runs finish RUN_DIR RESULT_DIR [--keep-checkpoints]  # under the run's lock: copy the
                                                      # log to RESULT_DIR, then remove the checkpoints

Configs are flat YAML mappings (experiments/trainer/config.py); `merge` applies later files and --set on top of
earlier ones and validates every key against train.py's accepted set, so a typo fails before training starts.
Imports no torch, so each call costs a fraction of a second.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from .config import DEFAULTS, ConfigError, _check_keys, _parse_set, load_config, read_yaml
from .rundir import RunDirError, RunLock, tmp_name

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def merge_configs(paths: list[str], sets: list[str]) -> dict[str, Any]:
    """Flat merge of YAML files then key=value overrides; keys checked against experiments.trainer.config."""
    cfg: dict[str, Any] = {}
    for p in paths:
        loaded = read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of key: value")
        _check_keys(list(loaded), p)
        cfg.update(loaded)
    for item in sets:
        k, v = _parse_set(item)
        _check_keys([k], "--set")
        if isinstance(v, str) and _FLOAT.fullmatch(v):  # YAML 1.1 reads "1e-5" (no dot) as a string
            v = float(v)
        cfg[k] = v
    return cfg


def read_rows(path: Path) -> list[dict[str, Any]]:
    """JSONL rows; a torn last line (killed run) is ignored."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def has_final(result_dir: Path, name: str = "train_log.jsonl") -> bool:
    return any(r.get("type") == "final" for r in read_rows(result_dir / name))


def run_summary(run_dir: Path) -> dict[str, Any] | None:
    """Key numbers of one run directory holding train_log.jsonl (and optionally eval*.json)."""
    rows = read_rows(run_dir / "train_log.jsonl")
    headers = [r for r in rows if r.get("type") == "header"]
    if not headers:
        return None
    cfg = headers[-1].get("config", {})
    model = headers[-1].get("model", {})  # the built model's shape (logs from before it existed: config only)
    steps = [r for r in rows if r.get("type") == "step"]
    evals = [r for r in rows if r.get("type") == "eval"]
    final = next((r for r in reversed(rows) if r.get("type") == "final"), None)
    last = steps[-1] if steps else {}
    out: dict[str, Any] = {
        "run": run_dir.name,
        "config_name": config_name(run_dir.name),
        "seed": cfg.get("seed", 0),
        "activation": cfg.get("activation", "relu"),
        "gated_mlp": model.get("gated_mlp", cfg.get("gated_mlp")),
        "intermediate_size": model.get("intermediate_size", cfg.get("intermediate_size")),
        "l1_coeff": cfg.get("l1_coeff"),
        "l1_reduction": cfg.get("l1_reduction"),
        "l1_warmup_steps": cfg.get("l1_warmup_steps"),
        "steps": last.get("step"),
        "tokens": last.get("tokens"),
        "train_ce": last.get("ce"),
        "val_ce": final.get("val_ce") if final else (evals[-1]["val_ce"] if evals else None),
        "val_nnz_mean": evals[-1].get("val_nnz_mean") if evals else None,
        "nnz_mean": last.get("nnz_mean"),
        "nnz_max": last.get("nnz_max"),
        "dead_frac": last.get("dead_frac"),
        "tokens_per_s": last.get("tokens_per_s"),
        "wall_s": final.get("wall_s") if final else None,
        "finished": final is not None,
    }
    for ev_path in sorted(run_dir.glob("eval*.json")):
        ev = json.loads(ev_path.read_text())
        out[f"{ev_path.stem}_mean_acc"] = ev.get("mean_acc")
        out[f"{ev_path.stem}_nnz"] = ev.get("nnz_per_token_mean")
    return out


SEED_SUFFIX = re.compile(r"_seed\d+$")


def config_name(run: str) -> str:
    """The configuration a run directory belongs to: its name without a `_seed<N>` suffix (seed 0 has none)."""
    return SEED_SUFFIX.sub("", run)


# Two-sided 95% quantiles of Student's t by degrees of freedom (a table: no scipy in the environment); a df between
# two entries takes the smaller df's value (the wider interval), beyond 30 the normal 1.96.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def mean_ci95(values: list[float]) -> tuple[float, float, int]:
    """(mean, half-width of the 95% t-interval of the mean, n) over the finite values; half-width NaN below n = 2."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), 0
    mean = sum(v) / n
    if n < 2:
        return mean, float("nan"), n
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    df = n - 1
    t = 1.96 if df > 30 else _T975[max(k for k in _T975 if k <= df)]
    return mean, t * sd / math.sqrt(n), n


SEED_METRICS = ("val_ce", "val_nnz_mean", "nnz_max", "dead_frac", "eval_mean_acc", "eval_sparse_mean_acc")


def seed_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration that ran with >= 2 seeds: n, the seeds, and mean / ci95 (half-width) per metric."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["config_name"], []).append(r)
    out = []
    for name, rs in groups.items():
        if len(rs) < 2:
            continue
        row: dict[str, Any] = {"config_name": name, "n_seeds": len(rs), "seeds": " ".join(str(r["seed"]) for r in rs),
                               "l1_coeff": rs[0]["l1_coeff"], "activation": rs[0]["activation"]}
        for m in SEED_METRICS:
            if any(r.get(m) is not None for r in rs):
                row[f"{m}_mean"], row[f"{m}_ci95"], _ = mean_ci95([r.get(m) for r in rs])
        out.append(row)
    return out


# Keys that do not change what a run computes (paths, the progress bar): a re-run may differ in them.
SAME_RUN_IGNORES = ("out_dir", "data_dir", "progress")


def run_state(run_dir: Path) -> tuple[str, dict[str, Any] | None]:
    """What `run_dir` holds: ('new', None) when there is nothing to lose in it (no log header, no checkpoint,
    no final model), else ('finished' | 'unfinished', the resolved config of its log header). Finished = the
    log has a 'final' line and, when the run saves one, the final model exists."""
    rows = read_rows(run_dir / "train_log.jsonl")
    header = next((r for r in rows if r.get("type") == "header"), None)
    has_ckpt = any((run_dir / "checkpoints").glob("step_*/COMPLETE"))
    if header is None and not has_ckpt and not (run_dir / "final").exists():
        return "new", None
    cfg = (header or {}).get("config")
    final = any(r.get("type") == "final" for r in rows)
    if final and cfg is not None and (not cfg.get("save_final", True) or (run_dir / "final" / "config.json").is_file()):
        return "finished", cfg
    return "unfinished", cfg


def same_run(saved: dict[str, Any] | None, cfg: dict[str, Any]) -> bool:
    """True when a run logged with config `saved` is the run that `cfg` (resolved, experiments.trainer.config) asks for:
    equal in every key but SAME_RUN_IGNORES (grad_accum too when global_batch_size sets it). A key the saved
    config lacks (added to train.py after that run) counts as its default."""
    if saved is None:
        return False
    ignore = set(SAME_RUN_IGNORES) | ({"grad_accum"} if cfg.get("global_batch_size") is not None else set())
    a, b = json.loads(json.dumps({**DEFAULTS, **saved})), json.loads(json.dumps(cfg))  # the log's JSON types
    return all(a.get(k) == b.get(k) for k in (a.keys() | b.keys()) - ignore)


def pick_run_dir(base: Path, cfg: dict[str, Any], fresh: bool = False) -> tuple[Path, str]:
    """The run directory a re-runnable job (the quickstart) uses for `cfg`, and its state: `base`, else
    `base-2`, `base-3`, ...: the first that holds this same run (finished: reuse it; unfinished: resume it) or
    nothing ('new'). With fresh=True, the first that holds nothing. A directory holding another run is never
    touched, so a re-run never deletes or overwrites finished work."""
    for i in range(1, 10_000):
        d = base if i == 1 else base.with_name(f"{base.name}-{i}")
        state, saved = run_state(d)
        if state == "new" or (not fresh and same_run(saved, cfg)):
            return d, state
    raise RuntimeError(f"{base}: 10,000 run directories in use; choose another base directory")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def describe(run_dir: Path) -> str:
    s = run_summary(run_dir)
    if s is None:
        return f"{run_dir.name}: no train_log.jsonl header"
    n = s["intermediate_size"]
    act = s["val_nnz_mean"] if s["val_nnz_mean"] is not None else s["nnz_mean"]
    return (f"val_ce {_fmt(s['val_ce'])}  nnz/token {_fmt(act)} of {n}  max {_fmt(s['nnz_max'])}  "
            f"dead {_fmt(100 * s['dead_frac'] if s['dead_frac'] is not None else None)}%  "
            f"wall {_fmt(s['wall_s'])} s")


def _write_csv_atomic(path: Path, cols: list[str], rows: list[dict[str, Any]]) -> None:
    """Write a CSV through a temporary file and a rename: runs finishing at once (parallel workers) each write a
    whole summary, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def summarize(exp_dir: Path) -> Path:
    """Write <exp_dir>/summary.csv, one row per run directory, and print it."""
    rows = [s for d in sorted(p for p in exp_dir.iterdir() if p.is_dir()) if (s := run_summary(d))]
    rows.sort(key=lambda r: (str(r["activation"]), not r["gated_mlp"], float(r["l1_coeff"] or 0), r["run"]))
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    out = exp_dir / "summary.csv"
    _write_csv_atomic(out, cols, rows)
    show = [c for c in ("run", "l1_coeff", "gated_mlp", "steps", "val_ce", "val_nnz_mean", "nnz_max", "dead_frac",
                        "wall_s", "eval_mean_acc", "eval_sparse_mean_acc") if c in cols]
    print("  ".join(f"{c:>14}" for c in show))
    for r in rows:
        print("  ".join(f"{_fmt(r.get(c)):>14}" for c in show))
    seeds = seed_table(rows)
    if seeds:
        scols: list[str] = []
        for r in seeds:
            scols += [k for k in r if k not in scols]
        _write_csv_atomic(exp_dir / "summary_seeds.csv", scols, seeds)
        print("configurations with several seeds (mean +- 95% t-interval half-width):")
        for r in seeds:
            cells = [f"{m} {_fmt(r[m + '_mean'])} +- {_fmt(r[m + '_ci95'])}" for m in SEED_METRICS if m + "_mean" in r]
            print(f"  {r['config_name']} (n={r['n_seeds']}): " + "; ".join(cells))
    return out


def compare_paths(exp_dir: Path) -> list[str]:
    """One line per run holding eval.json and eval_sparse.json: dense vs sparse-path mean accuracy and the
    largest per-task change (the two must agree up to bf16)."""
    lines = []
    for d in sorted(p for p in exp_dir.iterdir() if (p / "eval.json").is_file() and (p / "eval_sparse.json").is_file()):
        a, b = (json.loads((d / f).read_text()) for f in ("eval.json", "eval_sparse.json"))
        diffs = {t: b["tasks"][t]["acc"] - a["tasks"][t]["acc"] for t in a["tasks"] if t in b["tasks"]}
        worst = max(diffs.items(), key=lambda kv: abs(kv[1]))
        lines.append(f"{d.name}: mean acc dense {100 * a['mean_acc']:.2f} vs sparse {100 * b['mean_acc']:.2f} "
                     f"(largest per-task change {worst[0]} {100 * worst[1]:+.2f} points); "
                     f"nnz/token {a['nnz_per_token_mean']:.1f}")
    return lines


def finish_run(run_dir: Path, result_dir: Path, keep_checkpoints: bool) -> None:
    """A finished run's log copied (atomically) into result_dir, then its checkpoints removed unless kept: under
    the run's lock, so a training process that holds the directory is never touched (RunDirBusy instead)."""
    with RunLock(run_dir):
        result_dir.mkdir(parents=True, exist_ok=True)
        dest = result_dir / "train_log.jsonl"
        tmp = dest.with_name(tmp_name(dest.name))
        shutil.copyfile(run_dir / "train_log.jsonl", tmp)
        os.replace(tmp, dest)
        ckpts = run_dir / "checkpoints"
        if not keep_checkpoints and ckpts.is_dir():
            doomed = ckpts.with_name(tmp_name("checkpoints.removed"))  # a kill mid-removal leaves a temp entry
            os.replace(ckpts, doomed)
            shutil.rmtree(doomed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("yamls", nargs="+")
    m.add_argument("--set", action="append", default=[])
    m.add_argument("-o", "--out", required=True)
    d = sub.add_parser("done")
    d.add_argument("result_dir")
    d.add_argument("--file", default="train_log.jsonl")
    s = sub.add_parser("describe")
    s.add_argument("run_dir")
    z = sub.add_parser("summarize")
    z.add_argument("exp_dir")
    c = sub.add_parser("compare-paths")
    c.add_argument("exp_dir")
    k = sub.add_parser("pick-dir", help="print '<state> <dir>': where a re-run of CONFIG trains (pick_run_dir)")
    k.add_argument("base_dir")
    k.add_argument("config")
    k.add_argument("--fresh", action="store_true", help="a directory holding no run, never an earlier one")
    f = sub.add_parser("finish", help="under the run's lock: copy its log to RESULT_DIR, remove its checkpoints")
    f.add_argument("run_dir")
    f.add_argument("result_dir")
    f.add_argument("--keep-checkpoints", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "merge":
        try:
            cfg = merge_configs(a.yamls, a.set)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(tmp_name(out.name))  # a running training process may be reading it
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.replace(tmp, out)
        return 0
    if a.cmd == "done":
        return 0 if has_final(Path(a.result_dir), a.file) else 1
    if a.cmd == "describe":
        print(describe(Path(a.run_dir)))
        return 0
    if a.cmd == "summarize":
        p = Path(a.exp_dir)
        if not p.is_dir():
            print(f"error: {p} does not exist (no runs yet)", file=sys.stderr)
            return 1
        print(f"wrote {summarize(p)}")
        return 0
    if a.cmd == "pick-dir":
        try:
            cfg = load_config(a.config, [f"out_dir={a.base_dir}"])
        except (ConfigError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        d, state = pick_run_dir(Path(a.base_dir), cfg, a.fresh)
        print(state, d)  # state first: the dir may hold spaces (`read -r state dir`)
        return 0
    if a.cmd == "finish":
        try:
            finish_run(Path(a.run_dir), Path(a.result_dir), a.keep_checkpoints)
        except (RunDirError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.cmd == "compare-paths":
        print("\n".join(compare_paths(Path(a.exp_dir))))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
