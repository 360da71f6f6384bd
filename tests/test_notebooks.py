"""The figure/table notebooks execute headless (a) on the real results/ — logs may be missing, and then each
output must say "not reproduced yet" with the command to run — and (b) on small synthetic logs in a temp dir
that follow the schemas in notebooks/README.md, where the tables must carry our values beside the published
ones from results/published/paper_numbers.csv. Both runs go through `python -m sfl.notebooks.run_all` in two
parallel subprocesses (kernel start-up dominates; ~30-40 s each on 2 cores)."""
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

from nb_synthetic import make_synthetic_results, write_manifest  # noqa: E402
from sfl.notebooks import nbutil  # noqa: E402

pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

# Every output each notebook must produce (table names / figure names), with or without logs.
TABLES = ["quickstart_eval", "quickstart_loss_nnz", "fig2_l1_sweep_loss", "fig3_l1_sweep_ce_nnz", "fig9_l1_sweep_nnz_dead",
          "l1_sweep_nnz_per_layer", "table3_relu_silu_sparse", "table1_accuracy", "table6_per_task", "sparsify_eval_paths",
          "table1_speed", "fig4_fig5_speed_vs_l1", "kernel_targets", "kernel_bench_rows", "fig6_10_11_layers",
          "fig7_tokens_positions", "table4_gated_vs_nongated", "table5_dead_neuron_mitigation", "table1_training",
          "fig5_training_vs_activity", "training_memory_breakdown", "sparsify_seeds", "sparsify_seeds_arms",
          "paper_shape_layer_contribution", "paper_scale_training", "paper_scale_scaling"]
FIGURES = ["quickstart_loss_nnz", "fig2_l1_sweep_loss", "fig3_l1_sweep_ce_nnz", "fig9_l1_sweep_nnz_dead", "l1_sweep_nnz_per_layer",
           "sparsity_vs_accuracy", "fig4_inference_speedup_vs_l1", "fig5_training_speedup_vs_l1", "kernel_speedup_vs_activity",
           "kernel_train_speedup_vs_activity", "fig6_layers_sparse", "fig10_layers_dense", "fig11_layers_high_l1",
           "fig7_tokens_positions", "fig8_mitigation_nnz_dead", "fig5_training_vs_activity", "sparsify_seeds",
           "paper_shape_layer_contribution"]
# Which results/ sub-directory feeds each table (to know which tables must be "not reproduced" on the real dir).
SOURCE = {"quickstart_eval": "quickstart/eval.json", "quickstart_loss_nnz": "quickstart/train_log.jsonl",
          "fig2_l1_sweep_loss": "l1_sweep", "fig3_l1_sweep_ce_nnz": "l1_sweep", "fig9_l1_sweep_nnz_dead": "l1_sweep",
          "l1_sweep_nnz_per_layer": "l1_sweep", "table3_relu_silu_sparse": "l1_sweep", "table1_accuracy": "sparsify_smollm2",
          "table6_per_task": "sparsify_smollm2", "sparsify_eval_paths": "sparsify_smollm2", "table1_speed": "speed",
          "fig4_fig5_speed_vs_l1": "speed", "kernel_targets": "kernel_bench", "kernel_bench_rows": "kernel_bench",
          "fig6_10_11_layers": "activation_analysis/per_layer.jsonl", "fig7_tokens_positions": "activation_analysis",
          "table4_gated_vs_nongated": "ablations/gating", "table5_dead_neuron_mitigation": "ablations/dead_neurons",
          "table1_training": "speed/training", "fig5_training_vs_activity": "speed/training",
          "training_memory_breakdown": "speed/training", "sparsify_seeds": "sparsify_smollm2/seeds",
          "sparsify_seeds_arms": "sparsify_smollm2/seeds", "paper_shape_layer_contribution": "speed/layer_times_h200.jsonl",
          "paper_scale_training": "paper_scale", "paper_scale_scaling": "paper_scale"}


# Logs removed from a copy of the synthetic results for the "partial" run: its tables must say "not reproduced yet"
# (with the real results/, which holds every log, that branch of test_real_results_dir never ran).
PARTIAL_REMOVED = ("speed", "ablations/dead_neurons")


def _has_logs(rel: str, results: Path = REPO / "results") -> bool:
    p = results / rel
    return p.is_file() or (p.is_dir() and any(f.suffix in (".jsonl", ".json") for f in p.rglob("*")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run all notebooks three times in parallel: real results/, synthetic logs, and synthetic logs with some
    removed; outputs in temp dirs."""
    tmp = tmp_path_factory.mktemp("nb")
    synth = make_synthetic_results(tmp / "synthetic_results")
    partial = tmp / "partial_results"
    shutil.copytree(synth, partial)
    for rel in PARTIAL_REMOVED:
        shutil.rmtree(partial / rel)
    write_manifest(partial)  # the removed logs leave the manifest too (a listed missing file is an error)
    procs, dirs = {}, {"real": None, "synthetic": synth, "partial": partial}
    for name, results in dirs.items():
        env = dict(os.environ, SFL_FIGURES_DIR=str(tmp / name / "figures"), SFL_TABLES_DIR=str(tmp / name / "tables"),
                   MPLBACKEND="Agg")
        env.pop("SFL_RESULTS_DIR", None)
        if results is not None:
            env["SFL_RESULTS_DIR"] = str(results)
        procs[name] = subprocess.Popen([sys.executable, "-m", "sfl.notebooks.run_all",
                                        "--keep-executed", str(tmp / name / "executed")], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=300)
        out[name] = dict(rc=p.returncode, log=log, figures=tmp / name / "figures", tables=tmp / name / "tables",
                         results=dirs[name] or REPO / "results", executed=tmp / name / "executed")
    return out


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v: str) -> float:
    return float(v) if v not in ("", None) else float("nan")


def _check_tables_against_logs(r: dict) -> None:
    """A table whose logs exist carries our numbers; one whose logs are missing says "not reproduced yet", names
    the experiment to run and keeps the published numbers beside (e.g. Table 1's 2B +20.5%)."""
    assert r["rc"] == 0, r["log"][-3000:]
    for t in TABLES:
        md = r["tables"] / f"{t}.md"
        assert md.is_file() and (r["tables"] / f"{t}.csv").is_file(), f"{t} not written"
        if not _has_logs(SOURCE[t], r["results"]):
            text = md.read_text()
            assert nbutil.is_missing_table(md) or "not reproduced yet" in text, f"{t}: no not-reproduced entry"
            assert "experiments/" in text, f"{t}: entry does not say which experiment to run"
        else:
            assert not nbutil.is_missing_table(md), f"{t} says not reproduced although its logs exist"
    for f in FIGURES:
        assert (r["figures"] / f"{f}.png").stat().st_size > 5000, f"figure {f} missing or empty"
    rows = _rows(r["tables"] / "table1_speed.csv")
    if not _has_logs("speed", r["results"]):
        hit = [x for x in rows if x["model"] == "2B" and x["metric"] == "fwd_speedup_pct"]
        assert hit and _num(hit[0]["published"]) == 20.5 and hit[0]["ours"] == "not reproduced yet"
    else:
        hit = [x for x in rows if x["scale"] == "2B"]
        assert hit and _num(hit[0]["published fwd speed-up (%)"]) == 20.5
        assert -100 < _num(hit[0]["ours fwd speed-up (%)"]) < 1000  # a number of ours, not a placeholder
    assert (r["tables"] / "INDEX.md").is_file()


def test_real_results_dir(runs):
    _check_tables_against_logs(runs["real"])


def test_partial_results_dir(runs):
    """Some logs missing: both branches of the check run (the removed ones must be reported as not reproduced)."""
    r = runs["partial"]
    assert not _has_logs("speed", r["results"]) and _has_logs("l1_sweep", r["results"])
    _check_tables_against_logs(r)
    assert nbutil.is_missing_table(r["tables"] / "table5_dead_neuron_mitigation.md") or \
        "not reproduced yet" in (r["tables"] / "table5_dead_neuron_mitigation.md").read_text()


def test_synthetic_results_dir(runs):
    r = runs["synthetic"]
    assert r["rc"] == 0, r["log"][-3000:]
    T = r["tables"]
    for t in TABLES:
        assert not nbutil.is_missing_table(T / f"{t}.md"), f"{t} says not reproduced although synthetic logs exist"
    for f in FIGURES:
        assert (r["figures"] / f"{f}.png").stat().st_size > 5000, f"figure {f} missing or empty"

    q = {x["task"]: x for x in _rows(T / "quickstart_eval.csv")}
    assert _num(q["hellaswag"]["ours acc (%)"]) == pytest.approx(26.25)
    assert _num(q["hellaswag"]["published 0.5B dense"]) == 33.7
    assert _num(q["winogrande"]["published 0.5B sparse"]) == 53.8

    t3 = {x["setting"]: x for x in _rows(T / "table3_relu_silu_sparse.csv")}
    sp = t3["sparse ReLU (recommended)"]
    assert _num(sp["published nnz (of 5632)"]) == 29 and _num(sp["ours nnz"]) == pytest.approx(1.31)
    assert _num(sp["ours fwd speed-up (%)"]) == pytest.approx(17.0)  # speed row model l1_sweep/relu_l1_3e-2
    assert _num(t3["dense SiLU"]["published mean acc (%)"]) == 47.1

    f3 = {x["claim"][:30]: x for x in _rows(T / "fig3_l1_sweep_ce_nnz.csv")}
    assert _num(f3["non-zeros per token, dense ReL"]["published"]) == 911
    assert _num(f3["non-zeros per token, dense ReL"]["ours"]) == pytest.approx(41.5)

    t1 = {x["quantity"]: x for x in _rows(T / "table1_accuracy.csv")}
    assert _num(t1["mean acc, sparse (%)"]["published 1.5B"]) == 46.2
    assert _num(t1["accuracy change, sparse - dense (points)"]["ours 135M L1=0.03"]) == pytest.approx(-3.0)
    ci = t1["accuracy change, 95% interval (paired bootstrap over documents)"]
    # L1=0.01: each task's sparse model gets 4 fewer of the same 400 documents right -> -1 point, never above 0
    delta, lo, hi = (float(x) for x in ci["ours 135M L1=0.01"].replace("[", "").replace("]", "").replace(",", "").split())
    assert delta == -1.0 and lo < delta < hi <= 0.0
    assert ci["ours 135M L1=0.03"] == "n/a (no per-document log)"  # an old log: no interval made up
    paths = {(x["run"], x["eval file"]): x for x in _rows(T / "sparsify_eval_paths.csv")}
    assert paths[("l1_1e-2", "eval_sparse")]["95% interval of the change (paired bootstrap)"] == "+0.00 [+0.00, +0.00]"
    assert paths[("l1_3e-2", "eval")]["95% interval of the change (paired bootstrap)"] == "n/a (no per-document log)"
    sweep = {x["run"]: x for x in _rows(T / "l1_sweep_runs.csv")}
    assert _num(sweep["relu_l1_3e-2"]["acc_vs_dense_points"]) == pytest.approx(-2.0)  # sweep index 4: -0.005 x 4
    assert sweep["relu_l1_3e-2"]["acc_vs_dense_95ci"].startswith("-2.00 [")
    assert sweep["relu_l1_1e-2"]["acc_vs_dense_95ci"] == "n/a (no per-document log)"

    ps = _rows(T / "paper_scale_training.csv")
    assert [x["GPUs"] for x in ps] == ["1", "2"]
    for x in ps:  # repeats 1.10x and 1.12x, named _r1/_r2 on one GPU and by log order on two
        assert _num(x["sparse tok/s (%)"]) == pytest.approx(11.0) and x["sparse tok/s 95% interval"].endswith("(n=2)")
        assert _num(x["non-zeros per token"]) == 31.0
    scaling = {x["arm"]: x for x in _rows(T / "paper_scale_scaling.csv")}
    assert _num(scaling["dense_l1_0"]["scaling efficiency (%)"]) == pytest.approx(95.0)
    assert scaling["sparse"]["runs (1 GPU / N)"] == "2 / 2"

    t6 = {x["task"]: x for x in _rows(T / "table6_per_task.csv")}
    assert _num(t6["arc_easy"]["published 1.5B sparse"]) == 74.3
    assert _num(t6["hellaswag"]["ours 135M dense"]) == pytest.approx(36.25)

    s = {x["scale"]: x for x in _rows(T / "table1_speed.csv")}
    assert _num(s["2B"]["published fwd speed-up (%)"]) == 20.5 and _num(s["2B"]["ours fwd speed-up (%)"]) == pytest.approx(24.0)
    # training and memory at the paper shapes are table1_training's (the paper's L1 = 0 baseline), not repeated here
    assert not [c for c in s["2B"] if "train" in c or "mem" in c], list(s["2B"])

    k = _rows(T / "kernel_targets.csv")
    inf05 = [x for x in k if x["mode"] == "inference" and x["M"] == "65536" and x["pattern"] == "uniform" and _num(x["activity (%)"]) == 0.5][0]
    assert _num(inf05["official (our H100)"]) == 1.64 and _num(inf05["ours"]) == pytest.approx(2.345) and inf05["met"] == "yes"
    tr05 = [x for x in k if x["mode"] == "training" and x["metric"] == "speedup" and x["pattern"] == "uniform"
            and _num(x["activity (%)"]) == 0.5][0]
    assert _num(tr05["ours"]) == pytest.approx(1.876) and tr05["met"] == "NO"

    lay = _rows(T / "fig6_10_11_layers.csv")
    pear = [x for x in lay if x["claim"].startswith("fig6: Pearson")][0]
    assert _num(pear["published"]) == -0.996 and -1.0 <= _num(pear["ours"]) < 0

    f7 = {x["claim"]: x for x in _rows(T / "fig7_tokens_positions.csv")}
    assert f7["lowest-activity tokens"]["published"].startswith("doi, nlm") and f7["lowest-activity tokens"]["ours"].startswith("tok0")

    t4 = _rows(T / "table4_gated_vs_nongated.csv")
    ng = [x for x in t4 if x["setting"] == "non-gated sparse" and _num(x["published L1"]) == 2e-5][0]
    assert _num(ng["published fwd speed-up (%)"]) == 11.2 and _num(ng["ours nnz"]) == pytest.approx(2.0)
    t5 = {x["run"]: x for x in _rows(T / "table5_dead_neuron_mitigation.csv")}
    assert _num(t5["reinit"]["published mean acc (%)"]) == 46.6 and _num(t5["reinit"]["ours dead (%)"]) == pytest.approx(3.3)


def _inline_pngs(executed: Path) -> dict[str, list[bytes]]:
    """The PNG images each executed notebook shows in its outputs."""
    import base64

    import nbformat

    shown = {}
    for path in sorted(executed.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        shown[path.stem] = [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
                            for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    return shown


@pytest.mark.parametrize("which", ["real", "synthetic", "partial"])
def test_figures_shown_inline_as_saved(runs, which):
    """Every notebook shows its figures inline, each exactly once and exactly as saved in figures/ (placeholders
    for missing logs included)."""
    import hashlib

    r = runs[which]
    assert r["rc"] == 0, r["log"][-3000:]
    shown = _inline_pngs(r["executed"])
    assert set(shown) == {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}
    assert all(shown.values()), {k: len(v) for k, v in shown.items()}
    digest = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    saved = sorted(digest(p.read_bytes()) for p in r["figures"].glob("*.png"))
    assert sorted(digest(b) for imgs in shown.values() for b in imgs) == saved


def test_nbutil_sets_the_seaborn_theme():
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.reset_orig()
    import importlib

    importlib.reload(nbutil)
    from matplotlib.colors import to_hex

    cycle = [to_hex(c) for c in plt.rcParams["axes.prop_cycle"].by_key()["color"]]
    assert cycle == sns.color_palette(nbutil.THEME["palette"]).as_hex()
    assert plt.rcParams["axes.grid"] and plt.rcParams["axes.facecolor"] == "white"  # whitegrid


def test_published_csv_matches_reference_numbers():
    """Spot checks of the transcription against paper_numbers.md / reference_kernels_h100.md."""
    p = nbutil.published
    assert nbutil.pub("Table 1", "2B", "sparse", "fwd_tok_per_ms", l1=2e-5)["value"] == 106
    assert nbutil.pub("Table 1", "0.5B", "sparse", "train_speedup_pct", l1=2e-5)["value"] == -1.5
    assert nbutil.pub("Table 6", "1B", "sparse", "acc_arc_challenge", l1=2e-5)["value"] == 35.3
    assert nbutil.pub("Table 4", "1.5B", "non-gated sparse", "energy_mj_per_tok", l1=3e-5)["value"] == 4.86
    assert nbutil.pub("Table 5", "1.5B", "sparsity warmup", "nnz_per_token", l1=3e-4)["value"] == 108
    t6 = p("Table 6", metric="mean_acc")
    assert len(t6) == 8
    # Table 6 means re-derived from the per-task columns agree with Table 1 within rounding.
    for _, row in t6.iterrows():
        tasks = p("Table 6", model=row["model"], setting=row["setting"])
        per = tasks[tasks["metric"].str.startswith("acc_")]["value"]
        assert len(per) == 7 and abs(per.mean() - row["value"]) < 0.1
    assert set(p()["confidence"]) <= {"[2]", "[1]", "[1p]", "derived"}
    ref = nbutil.reference_kernels()
    r = ref[(ref["mode"] == "inference") & (ref["M"] == 65536) & (ref["activity"] == 0.005) & (ref["pattern"] == "uniform")]
    assert float(r["speedup"].iloc[0]) == 1.64 and float(r["dense_ms"].iloc[0]) == 7.38
    assert not ref[(ref["pattern"] == "heavy")]["correct"].any()


def test_missing_writes_entry_and_placeholder(tmp_path, monkeypatch):
    monkeypatch.setenv("SFL_FIGURES_DIR", str(tmp_path / "f"))
    monkeypatch.setenv("SFL_TABLES_DIR", str(tmp_path / "t"))
    msg = nbutil.missing("demo", "l1_sweep", "no logs", published_rows=nbutil.published("Table 3"))
    assert "bash experiments/l1_sweep/run.sh" in msg
    md = tmp_path / "t" / "demo.md"
    assert nbutil.is_missing_table(md) and "scale" in md.read_text().lower()
    rows = _rows(tmp_path / "t" / "demo.csv")
    assert {x["ours"] for x in rows} == {"not reproduced yet"} and any(_num(x["published"]) == 2.297 for x in rows)
    assert (tmp_path / "f" / "demo.png").stat().st_size > 5000


def test_bad_jsonl_line_is_an_error(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        nbutil.read_jsonl(f)
    f.write_text('{"a": 1}\n{"a": 2')  # truncated last line: a killed run; skipped with a warning
    with pytest.warns(UserWarning):
        assert nbutil.read_jsonl(f) == [{"a": 1}]
