"""The notebooks' outputs are reproducible and stay out of the tracked tree unless asked for:
(a) run twice on the logs of record, the notebooks whose figures and tables used to change on every run
    (series colours, draw order, bootstrapped bands, float noise) write the same bytes, equal to the committed files;
(b) `run_all --results DIR` plots a folder of the user's own runs, laid out as `SCALE=smoke bash
    experiments/l1_sweep/run.sh` writes it (runs/smoke/results/l1_sweep/<run>/train_log.jsonl, no manifest), into
    DIR/figures and DIR/paper_tables, says "not in DIR" for what the folder lacks, and leaves `git status` as it was."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from nb_synthetic import train_log  # noqa: E402
from sfl.notebooks.nbutil import NOT_IN_MARK as NOT_IN  # noqa: E402

pytest.importorskip("nbclient")

# The notebooks whose outputs changed from run to run; the rest are covered by the same fixes (seeded bands,
# rounded CSVs) and by test_notebooks.py.
REGENERATED = ["activation_analysis", "ablations"]


def _run_all(args: list[str], figures: Path | None = None, tables: Path | None = None, cwd: Path = REPO) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFL_")}
    env["MPLBACKEND"] = "Agg"
    if figures is not None:
        env.update(SFL_FIGURES_DIR=str(figures), SFL_TABLES_DIR=str(tables))
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, "-m", "sfl.notebooks.run_all", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _outputs(figures: Path, tables: Path) -> dict[str, bytes]:
    files = {f"figures/{p.name}": p.read_bytes() for p in figures.glob("*.png")}
    files |= {f"paper_tables/{p.name}": p.read_bytes() for p in tables.glob("*") if p.name != "INDEX.md"}
    return files


def test_regeneration_is_byte_identical_and_matches_the_committed_files(tmp_path):
    procs = {i: _run_all(["--only", *REGENERATED], tmp_path / str(i) / "figures", tmp_path / str(i) / "tables")
             for i in (1, 2)}
    for p in procs.values():
        log, _ = p.communicate(timeout=400)
        assert p.returncode == 0, log[-3000:]
    first, second = (_outputs(tmp_path / str(i) / "figures", tmp_path / str(i) / "tables") for i in (1, 2))
    assert len(first) >= 10 and set(first) == set(second)
    assert [k for k in first if first[k] != second[k]] == []
    # the committed outputs are what the notebooks write: run_all on a checkout leaves `git status` clean
    assert [k for k in first if (REPO / k).read_bytes() != first[k]] == []


SMOKE_POINTS = [("relu_l1_0", 0.0, 60.0, "relu"), ("relu_l1_1e-3", 1e-3, 20.0, "relu"),
                ("relu_l1_1e-2", 1e-2, 4.0, "relu"), ("relu_l1_1e-1", 1e-1, 0.6, "relu"), ("silu_dense", 0.0, 256.0, "silu")]


def _smoke_sweep_folder(root: Path) -> Path:
    """runs/smoke/results as the smoke sweep leaves it: one train_log.jsonl per point (experiments/l1_sweep/smoke.yaml:
    N = 256, 2 layers, l1_reduction sum), a summary.csv, no manifest, no eval.json (EVAL_LIMIT=0), no speed rows."""
    results = root / "runs" / "smoke" / "results"
    for i, (name, l1, nnz, act) in enumerate(SMOKE_POINTS):
        train_log(results / "l1_sweep" / name / "train_log.jsonl", l1=l1, n=256, layers=2, final_nnz=nnz, act=act,
                  final_ce=6.0 + 0.1 * i, start_nnz=256.0 if act == "silu" else None,
                  extra_cfg={"l1_reduction": "sum", "seq_len": 64, "micro_batch_size": 4})
    (results / "l1_sweep" / "summary.csv").write_text(
        "run,l1_coeff,val_ce\n" + "".join(f"{n},{l1},{6.0 + 0.1 * i}\n" for i, (n, l1, *_) in enumerate(SMOKE_POINTS)))
    return results


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def test_run_all_plots_a_folder_of_own_runs(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    results = _smoke_sweep_folder(tmp_path)
    before = _git_status()
    # a relative --results, from another directory: resolved against the working directory
    p = _run_all(["--only", "l1_sweep", "--results", "runs/smoke/results"], cwd=tmp_path)
    log, _ = p.communicate(timeout=400)
    assert p.returncode == 0, log[-3000:]
    assert _git_status() == before  # nothing tracked written (figures/, paper_tables/ untouched)

    tables, figures = results / "paper_tables", results / "figures"
    for name in ("fig2_l1_sweep_loss", "fig3_l1_sweep_ce_nnz", "fig9_l1_sweep_nnz_dead"):
        assert (figures / f"{name}.png").stat().st_size > 5000, name
    for name in ("fig2_l1_sweep_loss", "fig3_l1_sweep_ce_nnz", "fig9_l1_sweep_nnz_dead", "table3_relu_silu_sparse"):
        text = (tables / f"{name}.md").read_text()
        assert NOT_IN not in text and "not reproduced" not in text.lower(), name  # drawn from the folder's logs
    runs = {r["run"]: r for r in csv.DictReader(open(tables / "l1_sweep_runs.csv"))}
    assert set(runs) == {name for name, *_ in SMOKE_POINTS}
    assert float(runs["relu_l1_1e-1"]["nnz_per_token"]) == pytest.approx(0.6)
    # pieces the folder does not hold (no speed rows, no eval.json) read as missing from it, never as "run ..."
    every = "\n".join(p.read_text() for p in tables.glob("*.md"))
    assert f"not in {results.resolve()}" in every  # outside the repository: named by its full path
    assert "bash experiments/" not in every and "not reproduced" not in every.lower()
