"""Shared helpers for the figure/table notebooks: read logs, read the published numbers, write outputs.

Every notebook reads only results/ (ours) and results/published/ (the paper's numbers, transcribed with
their source tags) and writes figures/<name>.png (also shown inline in the notebook; seaborn theme THEME) and
paper_tables/<name>.md + .csv. A missing log never
raises: `missing()` writes an explicit "not reproduced yet" entry and a labelled placeholder figure.

Logs are read only through results/MANIFEST.csv (`record_paths`, `record_file`): a file in results/ that the
manifest does not list is never read, so a new run's output cannot silently change a table. Any other results
dir without a manifest is a folder of the user's own runs (`use_results`, `run_all --results DIR`): every log
found there is read, and what is not there is shown as "not in DIR", not as "not reproduced yet".

Outputs regenerate byte for byte: fixed colours per series, bands bootstrapped with BOOT_SEED, and table CSVs
rounded to CSV_DIGITS significant digits (so last-digit floating-point noise never reaches a file).

Directories can be redirected (tests and development use synthetic logs in a temp dir):
  SFL_RESULTS_DIR    our logs                     (default <repo>/results)
  SFL_PUBLISHED_DIR  published CSVs               (default <repo>/results/published)
  SFL_FIGURES_DIR    figure output                (default <repo>/figures)
  SFL_TABLES_DIR     table output                 (default <repo>/paper_tables)
"""
from __future__ import annotations

import csv
import fnmatch
import json
import math
import os
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import matplotlib


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, or run_all's headless nbclient), False in a plain process."""
    ip = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return ip is not None and hasattr(ip, "kernel")


if not in_notebook():
    matplotlib.use("Agg")  # scripts and tests: no display; a kernel keeps its own (inline) backend
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from sfl.experiments.trainer.paired_eval import change_with_interval  # noqa: E402
from sfl.experiments.trainer.runs import config_name, mean_ci95  # noqa: E402

# One look for every figure: seaborn's theme (white grid, a colour-blind-safe palette), set when a notebook
# imports these helpers. Notebooks draw with seaborn's plots where they fit, matplotlib where they do not.
THEME: dict[str, Any] = dict(context="notebook", style="whitegrid", palette="colorblind",
                             rc={"axes.titlesize": "medium", "legend.fontsize": "small"})
sns.set_theme(**THEME)

REPO_ROOT = Path(__file__).resolve().parents[1]

SCALE_NOTE = (
    "Scale: ours are small models (minutes of training on one GPU, or CPU smoke runs, on a ~18M-token (SmolLM2 tokenizer) local "
    "corpus); the paper trained 0.5-2B-parameter models on 10-42B tokens on 8x H100 PCIe. Compare trends, "
    "ratios and sparsity fractions, not absolute values."
)
# Outputs that are not about our small trained models say their own scale (save_table/save_figure `scale=`).
KERNEL_SCALE_NOTE = (
    "Scale: single FFN blocks at the paper's layer shape (K = 2048, N = 5632 unless noted; M tokens per call), bf16, "
    "on one GPU, with synthetic activations set to each activity level; no trained model is involved."
)
PAPER_SHAPE_SCALE_NOTE = (
    "Scale: 'paper-shape' rows are the paper's 0.5-2B layer shapes (hidden 2048, N 5632, 8-38 layers) with random weights "
    "and gates calibrated to the paper's activity, on one GPU, not trained models; rows named after a run are our small "
    "trained models (SmolLM2-135M fine-tunes, K 576, N 1536)."
)
NOT_REPRODUCED = "not reproduced yet"
MISSING_MARK = "**NOT REPRODUCED YET**"
NOT_IN_MARK = "**NOT IN "  # + the run folder + "**": a piece a user's run folder does not hold
BOOT_SEED = 0  # seaborn's bootstrapped bands (several seeds per point): the same band on every run
CSV_DIGITS = 10  # significant digits kept in table CSVs

# The paper's seven tasks (Table 6 column order) and spellings seen in task names.
PAPER_TASKS = ["hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
_TASK_ALIASES = {
    "hellaswag": ("hellaswag", "hs"),
    "commonsense_qa": ("commonsenseqa", "commonsense", "csqa", "cqa"),
    "piqa": ("piqa",),
    "winogrande": ("winogrande", "wg"),
    "arc_easy": ("arceasy", "arce"),
    "arc_challenge": ("arcchallenge", "arcc"),
    "openbookqa": ("openbookqa", "obqa"),
}


# ----------------------------------------------------------------------------- directories
def _dir(env: str, default: Path) -> Path:
    value = os.environ.get(env)
    return Path(value).expanduser().resolve() if value else default


RECORDS_DIR = REPO_ROOT / "results"


def results_dir() -> Path:
    return _dir("SFL_RESULTS_DIR", RECORDS_DIR)


def absent() -> str:
    """What a table says for a value of ours with no log: 'not reproduced yet' for the records, 'not in <folder>'
    for a run folder of the user's (which was never meant to hold every experiment)."""
    return f"not in {results_label()}" if reading_run_folder() else NOT_REPRODUCED


def reading_run_folder() -> bool:
    """True when the results dir is a folder of the user's own runs: not the records, and without a manifest."""
    base = results_dir()
    return base != RECORDS_DIR.resolve() and not (base / MANIFEST_NAME).is_file()


def results_label() -> str:
    """How captions and messages name the results dir: 'results', or the run folder (relative to the repository
    or the working directory where it is under either)."""
    base = results_dir()
    if base == RECORDS_DIR.resolve():
        return "results"
    for root in (REPO_ROOT, Path.cwd()):
        try:
            return str(base.relative_to(root.resolve()))
        except ValueError:
            continue
    return str(base)


def use_results(directory: Path | str, figures: Path | str | None = None, tables: Path | str | None = None) -> Path:
    """Read logs from `directory` (a run folder of yours, e.g. runs/smoke/results; relative paths are taken from the
    repository root) and write figures and tables under it (`figures/`, `paper_tables/`) unless told otherwise.
    The notebooks' RESULTS parameter and `run_all --results` call this. Returns the resolved directory."""
    base = Path(directory).expanduser()
    base = (base if base.is_absolute() else REPO_ROOT / base).resolve()
    if not base.is_dir():
        raise SystemExit(f"{directory}: no such folder; give the folder your runs wrote their logs to "
                         "(e.g. runs/smoke/results after SCALE=smoke bash experiments/l1_sweep/run.sh)")
    os.environ["SFL_RESULTS_DIR"] = str(base)
    os.environ["SFL_FIGURES_DIR"] = str(Path(figures).resolve() if figures else base / "figures")
    os.environ["SFL_TABLES_DIR"] = str(Path(tables).resolve() if tables else base / "paper_tables")
    return base


def published_dir() -> Path:
    return _dir("SFL_PUBLISHED_DIR", REPO_ROOT / "results" / "published")


def figures_dir() -> Path:
    return _dir("SFL_FIGURES_DIR", REPO_ROOT / "figures")


def tables_dir() -> Path:
    return _dir("SFL_TABLES_DIR", REPO_ROOT / "paper_tables")


def rel(path: Path | str) -> str:
    """Path as shown in captions: relative to the results dir (so captions do not leak temp paths)."""
    p = Path(path)
    for base, label in ((results_dir(), results_label()), (REPO_ROOT, "")):
        try:
            r = p.resolve().relative_to(base)
            return f"{label}/{r}" if label else str(r)
        except ValueError:
            continue
    return str(p)


# ----------------------------------------------------------------------------- reading logs
def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A truncated *last* line (a run killed mid-write) is skipped with a warning;
    a bad line anywhere else is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                warnings.warn(f"{path}: skipping truncated last line {i}")
                continue
            raise ValueError(f"{path}:{i}: not valid JSON ({e}); fix or delete that line") from e
    return rows


def cfg_get(config: dict[str, Any] | None, key: str, default: Any = None) -> Any:
    """Look a key up in a (possibly nested) resolved config: top level first, then sub-dicts."""
    if not isinstance(config, dict):
        return default
    if key in config:
        return config[key]
    for v in config.values():
        if isinstance(v, dict):
            found = cfg_get(v, key, _SENTINEL)
            if found is not _SENTINEL:
                return found
    return default


_SENTINEL = object()


@dataclass
class TrainLog:
    """A parsed train_log.jsonl (schema: notebooks/README.md)."""

    path: Path
    header: dict[str, Any]
    steps: pd.DataFrame
    evals: pd.DataFrame
    final: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.parent.name

    @property
    def l1_coeff(self) -> float:
        v = cfg_get(self.config, "l1_coeff")
        if v is None and len(self.steps) and "l1_coeff" in self.steps:
            v = self.steps["l1_coeff"].iloc[-1]
        return float(v) if v is not None else float("nan")

    @property
    def intermediate_size(self) -> int | None:
        # the built model's N (header "model"; with init_from the config's arch keys are not used)
        v = (self.header.get("model") or {}).get("intermediate_size") or cfg_get(self.config, "intermediate_size")
        return int(v) if v is not None else None

    @property
    def gated(self) -> bool:
        return bool(cfg_get(self.config, "gated_mlp", True))

    @property
    def activation(self) -> str:
        for key in ("hidden_act", "activation", "mlp_act", "act_fn"):
            v = cfg_get(self.config, key)
            if isinstance(v, str):
                return v.lower()
        return "relu"

    def last(self, column: str) -> float:
        """Last logged value of a step column (NaN when absent)."""
        if column not in self.steps or self.steps[column].dropna().empty:
            return float("nan")
        return float(self.steps[column].dropna().iloc[-1])

    @property
    def val_ce(self) -> float:
        if self.final and self.final.get("val_ce") is not None:
            return float(self.final["val_ce"])
        if len(self.evals) and "val_ce" in self.evals:
            return float(self.evals["val_ce"].dropna().iloc[-1])
        return float("nan")

    @property
    def val_nnz(self) -> float:
        if len(self.evals) and "val_nnz_mean" in self.evals and not self.evals["val_nnz_mean"].dropna().empty:
            return float(self.evals["val_nnz_mean"].dropna().iloc[-1])
        return self.last("nnz_mean")


def load_train_log(path: Path | str) -> TrainLog:
    """Parse <run>/train_log.jsonl (or the run directory itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "train_log.jsonl"
    rows = read_jsonl(path)
    headers = [r for r in rows if r.get("type") == "header"]
    if not headers:
        raise ValueError(f"{path}: no header line ({{'type': 'header', ...}}); was it written by experiments/trainer/train.py?")
    steps = pd.DataFrame([r for r in rows if r.get("type") == "step"])
    evals = pd.DataFrame([r for r in rows if r.get("type") == "eval"])
    finals = [r for r in rows if r.get("type") == "final"]
    # A resumed run appends a second header and may repeat steps: keep the last record per step.
    for df in (steps, evals):
        if len(df) and "step" in df:
            df.drop_duplicates("step", keep="last", inplace=True)
            df.sort_values("step", inplace=True)
            df.reset_index(drop=True, inplace=True)
    header = headers[-1]
    return TrainLog(path=path, header=header, steps=steps, evals=evals, final=finals[-1] if finals else None,
                    config=header.get("config") or {})


# ----------------------------------------------------------------------------- the manifest
MANIFEST_NAME = "MANIFEST.csv"
MANIFEST_COLUMNS = ["path", "experiment", "what", "used_by", "seed", "status", "pending"]


LOG_SUFFIXES = (".jsonl", ".json", ".csv")


def manifest_rows(results: Path | str | None = None) -> list[dict[str, str]]:
    """Rows of <results>/MANIFEST.csv (schema: results/README.md). Without a manifest: [] for the records dir, and
    for a run folder of the user's one row per log file found in it (every log there is theirs to plot)."""
    base = Path(results or results_dir()).resolve()
    path = base / MANIFEST_NAME
    if not path.is_file():
        if base == RECORDS_DIR.resolve() or not base.is_dir():
            return []
        return [dict.fromkeys(MANIFEST_COLUMNS, "") | {"path": f.relative_to(base).as_posix()}
                for f in sorted(base.rglob("*")) if f.suffix in LOG_SUFFIXES and f.is_file()]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and set(MANIFEST_COLUMNS) - set(rows[0]):
        raise ValueError(f"{path}: columns {sorted(set(MANIFEST_COLUMNS) - set(rows[0]))} missing; see results/README.md")
    return rows


def _path_matches(rel_path: str, pattern: str) -> bool:
    """fnmatch per path segment, so '*' never crosses a '/' ('l1_sweep/*/train_log.jsonl' skips deeper files)."""
    a, b = rel_path.split("/"), pattern.split("/")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def record_paths(pattern: str) -> list[Path]:
    """The logs of record whose manifest path (relative to the results dir) matches `pattern`, sorted.
    A listed file that is missing is an error: the manifest and results/ disagree."""
    base = results_dir()
    out = []
    for row in manifest_rows(base):
        if _path_matches(row["path"], pattern):
            p = base / row["path"]
            if not p.is_file():
                raise FileNotFoundError(f"{MANIFEST_NAME} lists {row['path']} but {p} does not exist; "
                                        "restore the file or remove its row")
            out.append(p)
    return sorted(out)


def record_file(rel_path: str) -> Path | None:
    """One log of record by its exact path relative to the results dir; None when the manifest does not list it."""
    base = results_dir()
    if not any(row["path"] == rel_path for row in manifest_rows(base)):
        return None
    p = base / rel_path
    if not p.is_file():
        raise FileNotFoundError(f"{MANIFEST_NAME} lists {rel_path} but {p} does not exist; restore the file or remove its row")
    return p


def find_runs(experiment: str, filename: str = "train_log.jsonl") -> list[Path]:
    """Run directories results/<experiment>/<run>/ whose `filename` is in the manifest (sorted by name)."""
    return sorted(p.parent for p in record_paths(f"{experiment}/*/{filename}"))


def load_eval(path: Path | str) -> dict[str, Any]:
    """Parse an eval.json written by experiments/trainer/evaluate.py (or the run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "eval.json"
    data = json.loads(path.read_text())
    if not isinstance(data.get("tasks"), dict):
        raise ValueError(f"{path}: no 'tasks' mapping; expected the eval.json schema in notebooks/README.md")
    data["_path"] = str(path)
    return data


def paper_task(name: str) -> str | None:
    """Map one of our task names (e.g. 'arc_easy', 'sfl_arc-e', 'csqa') to the paper's task key."""
    key = re.sub(r"[^a-z]", "", name.lower())
    for task, aliases in _TASK_ALIASES.items():
        if key in aliases or any(a in key for a in aliases if len(a) >= 4):
            return task
    return None


def eval_table(ev: dict[str, Any]) -> pd.DataFrame:
    """Per-task rows: task (ours), paper_task, acc, acc_norm, n. Accuracies in percent."""
    rows = []
    for task, r in ev["tasks"].items():
        acc = r.get("acc")
        accn = r.get("acc_norm")
        rows.append(dict(task=task, paper_task=paper_task(task),
                         acc=None if acc is None else 100 * float(acc),
                         acc_norm=None if accn is None else 100 * float(accn), n=r.get("n")))
    df = pd.DataFrame(rows)
    if len(df):
        order = {t: i for i, t in enumerate(PAPER_TASKS)}
        df["_o"] = df["paper_task"].map(order).fillna(99)
        df = df.sort_values(["_o", "task"]).drop(columns="_o").reset_index(drop=True)
    return df


def mean_acc(ev: dict[str, Any], key: str = "acc") -> float:
    """Mean accuracy (percent) over the tasks present, using `key` ('acc' or 'acc_norm', falling back to acc)."""
    vals = []
    for r in ev["tasks"].values():
        v = r.get(key)
        if v is None:
            v = r.get("acc")
        if v is not None:
            vals.append(100 * float(v))
    return sum(vals) / len(vals) if vals else float("nan")


PAIRED_BOOT = 2000  # bootstrap replicates for the notebooks' intervals (the CLI's default is 10,000)


def change_interval(base: dict[str, Any] | None, other: dict[str, Any] | None, key: str = "acc") -> str:
    """Mean-accuracy change other - base (points) with its 95% paired-bootstrap interval over documents, as
    '-0.37 [-1.21, +0.48]', from the eval.json files' per-document scores; 'n/a (no per-document log)' when either
    file predates them (an interval is never made up for an old log). experiments/trainer/paired_eval.py has the method."""
    return change_with_interval(base, other, metric=key, n_boot=PAIRED_BOOT)


def load_jsonl_dir(directory: Path | str, pattern: str = "*.jsonl") -> pd.DataFrame:
    """All rows of the manifest's JSONL files in a directory of the results dir, nested 'provenance' flattened
    to prov_* columns, plus 'source_file'. Empty DataFrame when nothing is there."""
    directory = Path(directory).resolve()
    try:
        rel_dir = directory.relative_to(results_dir()).as_posix()
    except ValueError as e:
        raise ValueError(f"{directory} is not under the results dir {results_dir()}: logs are read via its manifest") from e
    frames = []
    for f in record_paths(f"{rel_dir}/{pattern}" if rel_dir != "." else pattern):
        rows = []
        for r in read_jsonl(f):
            r = dict(r)
            prov = r.pop("provenance", None)
            if isinstance(prov, dict):
                for k, v in prov.items():
                    r.setdefault(f"prov_{k}", v)
                    if k == "gpu":
                        r.setdefault("gpu", v)
            r["source_file"] = rel(f)
            rows.append(r)
        if rows:
            frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _normalise_training_rows(df: pd.DataFrame) -> pd.DataFrame:
    """experiments/kernel_bench/bench_training.py rows (kind 'fwd_bwd') in the inference rows' terms:
    activity = p, speedup/ours_ms/path = the auto-dispatch measurement, saved memory in MiB."""
    if "kind" not in df or not (df["kind"] == "fwd_bwd").any():
        return df
    df = df.copy()
    t = df["kind"] == "fwd_bwd"
    df.loc[t, "mode"] = "training"
    for dst, src in [("activity", "p"), ("speedup", "speedup_auto"), ("ours_ms", "auto_ms"), ("path", "auto_path")]:
        if src in df:
            if dst not in df:
                df[dst] = None
            df.loc[t, dst] = df.loc[t, src]
    if {"kept_bytes_dense", "kept_bytes_sparse"} <= set(df.columns):
        df.loc[t, "dense_saved_mb"] = df.loc[t, "kept_bytes_dense"] / 2**20
        df.loc[t, "ours_saved_mb"] = df.loc[t, "kept_bytes_sparse"] / 2**20
    if "errors" in df:
        df.loc[t, "rel_err"] = [e["vs_bf16_dense"]["y"] if isinstance(e, dict) else None for e in df.loc[t, "errors"]]
    return df


def load_bench(directory: Path | str | None = None) -> pd.DataFrame:
    """Kernel-bench rows (results/kernel_bench/*.jsonl) with 'mode' defaulting to inference and
    'pattern' normalised to a family: 'heavy' when it mentions heavy rows, else as written."""
    df = load_jsonl_dir(directory or results_dir() / "kernel_bench")
    if df.empty:
        return df
    if "type" in df:  # files may interleave header/summary records; keep the measurement rows
        df = df[df["type"].isna() | df["type"].isin(["bench", "row", "result", "measurement"])]
    df = _normalise_training_rows(df)
    needed = {"M", "activity", "speedup"}
    # Profiles, calibration and other diagnostic rows share the folder; a measurement row has all of these.
    if needed <= set(df.columns):
        df = df.dropna(subset=sorted(needed))
    if not needed <= set(df.columns):
        raise ValueError(f"kernel_bench rows lack columns {sorted(needed - set(df.columns))}; see notebooks/README.md")
    df = df.copy()
    if "mode" not in df:
        df["mode"] = "inference"
    df["mode"] = df["mode"].fillna("inference")
    # experiments/kernel_bench writes kind = "gated" | "nongated" and rel_err_vs_dense_bf16; files may mix formats
    kind = df["kind"] if "kind" in df else pd.Series(["gated"] * len(df), index=df.index)
    from_kind = kind.fillna("gated").astype(str).str.lower().map(lambda k: not k.replace("-", "").startswith("nongated"))
    df["gated"] = [bool(k) if g is None or (isinstance(g, float) and math.isnan(g)) else bool(g)
                   for g, k in zip(df["gated"] if "gated" in df else [None] * len(df), from_kind)]
    if "rel_err_vs_dense_bf16" in df:
        df["rel_err"] = df["rel_err"].fillna(df["rel_err_vs_dense_bf16"]) if "rel_err" in df else df["rel_err_vs_dense_bf16"]
    if "pattern" not in df:
        df["pattern"] = "uniform"
    if "heavy_frac" not in df:
        df["heavy_frac"] = 0.0
    df["heavy_frac"] = pd.to_numeric(df["heavy_frac"], errors="coerce").fillna(0.0)
    df["pattern_family"] = [_pattern_family(p, h) for p, h in zip(df["pattern"].fillna("uniform"), df["heavy_frac"])]
    bad = df["activity"].astype(float) > 1
    if bad.any():
        raise ValueError("kernel_bench 'activity' must be a fraction in [0, 1] (0.005 = 0.5%); "
                         f"found {df.loc[bad, 'activity'].unique()[:5]}")
    return df.reset_index(drop=True)


def run_key(run_dir: Path | str) -> str:
    """A run's id as other logs refer to it: its path relative to the results dir ('l1_sweep/l1_2e-5')."""
    p = Path(run_dir).resolve()
    try:
        return str(p.relative_to(results_dir()))
    except ValueError:
        return p.name


PAPER_DEAD_WINDOW_TOKENS = 2**20  # the paper counts a neuron dead over one training step (~1M tokens)


def dead_window_tokens(log: TrainLog) -> float:
    """The window over which the run counted a neuron dead: the config's dead_window_tokens, else (as
    experiments/trainer/train.py defaults) one step's tokens on one rank = micro_batch_size x seq_len x grad_accum."""
    v = cfg_get(log.config, "dead_window_tokens")
    if v:
        return float(v)
    mbs, seq = cfg_get(log.config, "micro_batch_size"), cfg_get(log.config, "seq_len")
    return float(mbs * seq * (cfg_get(log.config, "grad_accum") or 1)) if mbs and seq else float("nan")


def dead_window_note(logs: Sequence[TrainLog]) -> str:
    """'ours: dead = not active within the last N tokens (Kx shorter than the paper's ~1M-token step)'."""
    w = sorted({dead_window_tokens(lg) for lg in logs if not math.isnan(dead_window_tokens(lg))})
    if not w:
        return "ours: dead-neuron window not logged"
    ratio = PAPER_DEAD_WINDOW_TOKENS / w[0]
    if len(w) == 1 and abs(ratio - 1) < 0.05:
        return f"ours: dead = not active within the last {w[0]:,.0f} tokens, the paper's window (one ~1M-token step)"
    return (f"ours: dead = not active within the last {', '.join(f'{x:,.0f}' for x in w)} tokens, "
            f"{ratio:.0f}x shorter than the paper's ~1M-token step (a shorter window counts more neurons dead)")


def dead_window_comparable(logs: Sequence[TrainLog]) -> bool:
    """True when every run counted dead neurons over the paper's window (within 5%): its dead % is then on the
    paper's scale, up to model size and training length."""
    w = [dead_window_tokens(lg) for lg in logs]
    return bool(w) and all(abs(PAPER_DEAD_WINDOW_TOKENS / x - 1) < 0.05 for x in w if not math.isnan(x))


# ----------------------------------------------------------------------------- seeds
def seed_groups(logs: Sequence[TrainLog]) -> dict[str, list[TrainLog]]:
    """Runs by configuration (the run name without its `_seed<N>` suffix), seed 0 (no suffix) first: the repeats
    a mean and interval are taken over. Order of first appearance."""
    groups: dict[str, list[TrainLog]] = {}
    for lg in logs:
        groups.setdefault(config_name(lg.name), []).append(lg)
    for name, g in groups.items():
        g.sort(key=lambda lg: (lg.name != name, lg.name))
    return groups


def mean_ci(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, half-width of the 95% t-interval, n) over the finite values (experiments/trainer/runs.py mean_ci95)."""
    return mean_ci95(list(values))


def pm(values: Sequence[float], digits: int = 3) -> str:
    """'4.56 ± 0.012 (n=3)' for several seeds, the value alone for one, '—' for none."""
    m, h, n = mean_ci(values)
    if n == 0:
        return "—"
    if abs(m) < 1e-9 * max(1.0, abs(h)):
        m = 0.0  # a mean of changes against that same mean: rounding noise, not a value
    if n >= 2 and h <= 1e-6 * abs(m):
        h = 0.0  # equal values (SiLU's non-zeros = N)
    return fmt(m, digits) if n < 2 else f"{fmt(m, digits)} ± {fmt(h, 2)} (n={n})"


def l1_sum_equivalent(log: TrainLog) -> float:
    """The run's L1 coefficient in the official code's normalisation (sum over neurons, mean over tokens).
    Eq. 2 ('mean' reduction) divides by N as well, so its coefficient is N times weaker: coeff / N."""
    c = log.l1_coeff
    if str(cfg_get(log.config, "l1_reduction", "mean")).lower() == "sum":
        return c
    n = log.intermediate_size
    return c / n if n else float("nan")


def speed_rows() -> pd.DataFrame:
    """results/speed/*.jsonl rows (see notebooks/README.md) with derived percent columns."""
    df = load_jsonl_dir(results_dir() / "speed")
    if df.empty:
        return df
    for col in ("dense_tokens_per_s", "sparse_tokens_per_s", "dense_energy_j_per_token", "sparse_energy_j_per_token",
                "dense_peak_mem_gb", "sparse_peak_mem_gb", "l1_coeff", "paper_scale", "model", "mode"):
        if col not in df:
            df[col] = None
    num = lambda c: pd.to_numeric(df[c], errors="coerce")  # noqa: E731
    df["speedup_pct"] = [pct_change(a, b) for a, b in zip(num("sparse_tokens_per_s"), num("dense_tokens_per_s"))]
    df["energy_delta_pct"] = [pct_change(a, b) for a, b in zip(num("sparse_energy_j_per_token"), num("dense_energy_j_per_token"))]
    df["peak_mem_delta_pct"] = [pct_change(a, b) for a, b in zip(num("sparse_peak_mem_gb"), num("dense_peak_mem_gb"))]
    return df


def latest(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per key combination: the most recent by provenance time when logged, else the last in file order.
    Only the manifest's logs of record reach here, so this picks a listed rerun (e.g. training_h100_r9 over
    training_h100_r4's M = 16384 cells), never an unlisted new file."""
    if df.empty:
        return df
    df = df.copy()
    df["_order"] = range(len(df))
    sort = ["prov_time_utc", "_order"] if "prov_time_utc" in df else ["_order"]
    df = df.sort_values(sort, na_position="first")
    keys = [k for k in keys if k in df]
    return df.groupby(keys, dropna=False, sort=True).tail(1).drop(columns="_order").reset_index(drop=True)


def speed_for(run_dir: Path | str, mode: str = "inference", speed: pd.DataFrame | None = None) -> dict[str, float]:
    """Speed-up / energy / memory percentages of the latest speed row whose model is this run's key."""
    speed = speed_rows() if speed is None else speed
    nan = float("nan")
    empty = dict(speedup_pct=nan, energy_delta_pct=nan, peak_mem_delta_pct=nan)
    if speed.empty:
        return empty
    sel = latest(speed[(speed["model"] == run_key(run_dir)) & (speed["mode"] == mode)], ["model", "mode"])
    if sel.empty:
        return empty
    r = sel.iloc[-1]
    return dict(speedup_pct=r["speedup_pct"], energy_delta_pct=r["energy_delta_pct"],
                peak_mem_delta_pct=r["peak_mem_delta_pct"])


def closest_by_activity(logs: Sequence[TrainLog], target_fraction: float) -> TrainLog | None:
    """The sparse run whose active fraction (nnz / N) is closest, in log space, to `target_fraction`:
    how we pick 'our counterpart' of the paper's recommended L1 (its coefficients are not comparable to ours)."""
    best, best_d = None, float("inf")
    for lg in logs:
        n, nnz = lg.intermediate_size, lg.val_nnz
        if not n or not (nnz > 0) or not (lg.l1_coeff > 0):
            continue
        d = abs(math.log(nnz / n) - math.log(target_fraction))
        if d < best_d:
            best, best_d = lg, d
    return best


def claims_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Standard 'published beside ours' table from dicts with keys claim, published (a pub() row or a
    value), ours, unit, ours_log, note."""
    out = []
    for r in rows:
        p = r.get("published")
        if isinstance(p, dict):
            pv, src, conf = p["value"], p["source"], p["confidence"]
            if isinstance(pv, float) and math.isnan(pv):
                pv = p.get("note", "")
        else:
            pv, src, conf = p, r.get("source", ""), r.get("confidence", "")
        ours = r.get("ours")
        if ours is None or (isinstance(ours, float) and math.isnan(ours)):
            ours = r.get("ours_missing", absent())
        out.append(dict(claim=r["claim"], published=pv, ours=ours, unit=r.get("unit", ""), source=src,
                        confidence=conf, ours_log=r.get("ours_log", ""), note=r.get("note", "")))
    return pd.DataFrame(out)


def _pattern_family(pattern: Any, heavy_frac: float) -> str:
    """'uniform' | 'heavy' (uniform + 1% heavy rows: the issue's adversarial case) | e.g. 'paper+heavy0.1%'."""
    p = str(pattern).lower()
    if "heavy" in p:
        return "heavy"
    if heavy_frac > 0:
        if p == "uniform" and math.isclose(heavy_frac, 0.01):
            return "heavy"
        return f"{p}+heavy{100 * heavy_frac:g}%"
    return p


# ----------------------------------------------------------------------------- published numbers
def published(item: str | Sequence[str] | None = None, **filters: Any) -> pd.DataFrame:
    """Rows of results/published/paper_numbers.csv, optionally filtered by table_or_figure and column values.
    A filter value may be a list (any of)."""
    df = pd.read_csv(published_dir() / "paper_numbers.csv", dtype={"model": str, "setting": str})
    if item is not None:
        items = [item] if isinstance(item, str) else list(item)
        df = df[df["table_or_figure"].isin(items)]
    for col, want in filters.items():
        if col == "l1":
            wants = want if isinstance(want, (list, tuple)) else [want]
            df = df[df["l1"].map(lambda v: any(_same(v, w) for w in wants))]
        elif isinstance(want, (list, tuple)):
            df = df[df[col].isin(want)]
        else:
            df = df[df[col] == want]
    return df.reset_index(drop=True)


def _same(a: Any, b: Any) -> bool:
    if b is None:
        return a is None or (isinstance(a, float) and math.isnan(a))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    except (TypeError, ValueError):
        return False


def pub(item: str, model: str, setting: str, metric: str, l1: float | None = None) -> dict[str, Any]:
    """Exactly one published number as a dict (value, unit, source, confidence, note, ...).
    Raises when zero or several rows match, so a notebook never shows the wrong number silently."""
    kw: dict[str, Any] = dict(model=model, setting=setting, metric=metric)
    if l1 is not None:
        kw["l1"] = l1
    df = published(item, **kw)
    if len(df) != 1:
        raise KeyError(f"published({item!r}, {kw}) matched {len(df)} rows; expected exactly one")
    return df.iloc[0].to_dict()


def reference_kernels() -> pd.DataFrame:
    """The official kernels timed on our H100 (results/published/reference_kernels_h100.csv)."""
    return pd.read_csv(published_dir() / "reference_kernels_h100.csv")


def kernel_targets() -> pd.DataFrame:
    """Speed targets from the kernel issues (results/published/kernel_targets.csv)."""
    return pd.read_csv(published_dir() / "kernel_targets.csv")


# ----------------------------------------------------------------------------- formatting
def fmt(v: Any, digits: int = 3) -> str:
    """Compact number formatting for tables: NaN/None -> '—'."""
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return "yes" if v else "no"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "—"
    if x == 0:
        return "0"
    if abs(x) >= 1000 and float(x).is_integer():
        return f"{int(x)}"
    if abs(x) < 1e-3 or abs(x) >= 1e5:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def pct_change(new: float, base: float) -> float:
    """100 * (new / base - 1); NaN when either is missing or base is 0."""
    try:
        if base == 0 or math.isnan(new) or math.isnan(base):
            return float("nan")
    except TypeError:
        return float("nan")
    return 100.0 * (new / base - 1.0)


def sparse_vs_dense_pct(df: pd.DataFrame, keys: Sequence[str], col: str, sparse: str = "sparse",
                        dense: str = "dense L1=0") -> pd.Series:
    """pct_change of `col`, side `sparse` against side `dense`, per combination of `keys` (rows with a 'side' column,
    as experiments/speed/train_throughput.py writes them)."""
    piv = df.pivot_table(index=list(keys), columns="side", values=col)
    return pd.Series([pct_change(a, b) for a, b in zip(piv[sparse], piv[dense])], index=piv.index)


def to_markdown(df: pd.DataFrame) -> str:
    """GitHub markdown table (no tabulate dependency)."""
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(fmt(v).replace("|", "/").replace("\n", " ") for v in r.tolist()) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- writing outputs
def save_table(name: str, df: pd.DataFrame, caption: str, *, title: str | None = None,
               logs: Iterable[str] = (), extra: str = "", scale: str = SCALE_NOTE) -> Path:
    """Write paper_tables/<name>.md (title, caption + scale note, table, logs used) and <name>.csv."""
    out = tables_dir()
    out.mkdir(parents=True, exist_ok=True)
    rounded(df).to_csv(out / f"{name}.csv", index=False)
    logs = list(logs)
    parts = [f"# {title or name}", "", caption.strip(), "", scale, "", to_markdown(df), ""]
    if extra:
        parts += [extra.strip(), ""]
    if logs:
        parts += ["Logs: " + ", ".join(f"`{x}`" for x in logs), ""]
    parts += ["Published values: `results/published/paper_numbers.csv` (source tag and confidence mark per "
              "number; see results/published/README.md). Generated by `notebooks/` — do not edit by hand.", ""]
    path = out / f"{name}.md"
    path.write_text("\n".join(parts))
    return path


def rounded(df: pd.DataFrame, digits: int = CSV_DIGITS) -> pd.DataFrame:
    """A copy with every float cell (in float and mixed columns) rounded to `digits` significant digits."""
    def one(v: Any) -> Any:
        if isinstance(v, float) and math.isfinite(v) and v != 0:
            return float(f"{v:.{digits}g}")
        return v

    return df.map(one) if len(df) else df.copy()


def save_figure(fig: plt.Figure, name: str, caption: str = "", *, scale: str = SCALE_NOTE) -> Path:
    """Write figures/<name>.png with the caption and scale note as a footer, close the figure, and in a notebook
    show that same PNG inline (once: the closed figure is not drawn again at the end of the cell)."""
    out = figures_dir()
    out.mkdir(parents=True, exist_ok=True)
    footer = (caption.strip() + "\n" if caption else "") + scale
    width = int(fig.get_figwidth() * 17)  # characters per line at 6.5 pt
    # Placed below the axes; bbox_inches="tight" grows the image to include it (no overlap with labels).
    fig.text(0.01, -0.02, _wrap(footer, width), fontsize=6.5, va="top", ha="left", color="0.3")
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    if in_notebook():
        # IPython only inside a notebook: a plain process never loads it (in_notebook reads sys.modules)
        from IPython.display import Image, display

        display(Image(filename=str(path)))
    return path


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.fill(par, width) for par in text.split("\n"))


def missing(name: str, how_to_produce: str, reason: str = "its log is not in results/ yet", *,
            published_rows: pd.DataFrame | None = None, figure: bool = True, table: bool = True,
            title: str | None = None) -> str:
    """Record that `name` is not reproduced yet: a table entry (with the published numbers beside, if given)
    and a labelled placeholder figure. `how_to_produce` is an experiment name ('l1_sweep') or a command.
    For a run folder of the user's the entry says only that the piece is not in that folder.
    Returns the message (also printed)."""
    cmd = how_to_produce if (" " in how_to_produce or "/" in how_to_produce) else f"bash experiments/{how_to_produce}/run.sh"
    if reading_run_folder():
        where = results_label()
        reason = reason.replace("results/", f"{where}/")  # the reasons name the records' layout: name the folder read
        ours, msg, caption = f"not in {where}", f"not in {where} ({reason})", f"{NOT_IN_MARK}{where}** ({reason})."
        headline, detail, colour = f"NOT IN {where}", reason, "0.35"
    else:
        ours, msg, caption = NOT_REPRODUCED, f"{NOT_REPRODUCED} — run `{cmd}` ({reason})", f"{MISSING_MARK} — run `{cmd}` ({reason})."
        headline, detail, colour = "NOT REPRODUCED YET", f"run: {cmd}\n({reason})", "firebrick"
    print(f"[{name}] {msg}")
    if table:
        if published_rows is not None and len(published_rows):
            df = published_rows[["table_or_figure", "model", "setting", "l1", "metric", "value", "unit",
                                 "source", "confidence"]].rename(columns={"value": "published"}).copy()
            df["ours"] = ours
        else:
            df = pd.DataFrame([{"item": name, "published": "see results/published/paper_numbers.csv", "ours": ours}])
        df["status"] = msg
        save_table(name, df, caption, title=title)
    if figure:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.axis("off")
        ax.text(0.5, 0.62, f"{title or name}\n{headline}", ha="center", va="center", fontsize=14,
                weight="bold", color=colour)
        ax.text(0.5, 0.25, _wrap(detail, 80), ha="center", va="center", fontsize=9)
        save_figure(fig, name)
    return msg


def is_missing_table(path: Path | str) -> bool:
    """True when a written paper_tables/*.md is a not-reproduced entry (or, for a run folder, a not-in entry)."""
    text = Path(path).read_text()
    return MISSING_MARK in text or NOT_IN_MARK in text


def write_index() -> Path:
    """paper_tables/INDEX.md: one line per table, reproduced or not (run_all calls this at the end)."""
    out = tables_dir()
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Generated tables", "", "| table | status |", "|---|---|"]
    for md in sorted(out.glob("*.md")):
        if md.name in ("INDEX.md", "README.md"):
            continue
        text = md.read_text()
        status = ("not reproduced yet" if MISSING_MARK in text else f"not in {results_label()}" if NOT_IN_MARK in text
                  else "generated from logs")
        lines.append(f"| [{md.stem}]({md.name}) | {status} |")
    path = out / "INDEX.md"
    path.write_text("\n".join(lines) + "\n")
    return path
