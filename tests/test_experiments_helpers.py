"""experiments/trainer/runs.py (config merge, run summaries) and the speed experiment's activity calibration (CPU)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from sfl.experiments.trainer.config import ConfigError
from sfl.experiments.trainer.runs import config_name, has_final, mean_ci95, merge_configs, run_summary, summarize
from sfl.experiments.speed.bench import (CALIB_TOL, activity, block_order, calibrate_paper_model, paired_ratios,
                                     paper_profile, small_paper_like_model)


def test_merge_later_wins_and_floats_parsed(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("hidden_size: 64\nl1_coeff: 0.5\n")
    (tmp_path / "b.yaml").write_text("hidden_size: 96\n")
    cfg = merge_configs([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")], ["l1_coeff=1e-5", "gated_mlp=false"])
    assert cfg == {"hidden_size": 96, "l1_coeff": 1e-5, "gated_mlp": False}
    assert isinstance(cfg["l1_coeff"], float)


def test_merge_rejects_unknown_key(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("hiden_size: 64\n")
    with pytest.raises(ConfigError, match="hidden_size"):
        merge_configs([str(tmp_path / "a.yaml")], [])


def test_run_summary_and_final(tmp_path: Path) -> None:
    rows = [{"type": "header", "config": {"l1_coeff": 1e-3, "intermediate_size": 256, "gated_mlp": True}},
            {"type": "step", "step": 10, "tokens": 100, "ce": 5.0, "nnz_mean": 12.0, "nnz_max": 40.0, "dead_frac": 0.25},
            {"type": "eval", "step": 10, "val_ce": 5.1, "val_nnz_mean": 11.0}]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "fin')
    assert not has_final(tmp_path)  # a torn last line is not a final line
    s = run_summary(tmp_path)
    assert s["val_nnz_mean"] == 11.0 and s["dead_frac"] == 0.25 and not s["finished"]
    with open(tmp_path / "train_log.jsonl", "a") as f:
        f.write('\n{"type": "final", "step": 10, "val_ce": 5.1, "wall_s": 3.0}\n')
    assert has_final(tmp_path)
    assert run_summary(tmp_path)["wall_s"] == 3.0


def test_mean_ci95() -> None:
    mean, half, n = mean_ci95([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5)  # sd 1, t(0.975, 2) = 4.303
    assert mean_ci95([5.0, None, float("nan")])[::2] == (5.0, 1) and math.isnan(mean_ci95([5.0])[1])
    assert mean_ci95([0.0] * 40)[1] == 0.0 and math.isnan(mean_ci95([])[0])
    _, half7, _ = mean_ci95([0.0, 1.0] * 4)  # df 7: t = 2.365
    assert half7 == pytest.approx(2.365 * (8 / 7 * 0.25) ** 0.5 / 8 ** 0.5)


def test_summarize_groups_seeds(tmp_path: Path) -> None:
    """Run directories <config>_seed<N> are seeds of <config>: summary.csv keeps one row per run, summary_seeds.csv one
    per configuration with >= 2 seeds (mean and 95% interval); a single-seed configuration gets no seeds row."""
    assert config_name("relu_l1_1e-3_seed2") == "relu_l1_1e-3" and config_name("relu_l1_1e-3") == "relu_l1_1e-3"

    def run(name: str, seed: int, l1: float, val_ce: float) -> None:
        d = tmp_path / name
        d.mkdir()
        rows = [{"type": "header", "config": {"l1_coeff": l1, "seed": seed}},
                {"type": "step", "step": 5, "ce": val_ce, "nnz_mean": 3.0},
                {"type": "final", "step": 5, "val_ce": val_ce, "wall_s": 1.0}]
        (d / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run("relu_l1_1e-3", 0, 1e-3, 4.0)
    run("relu_l1_1e-3_seed1", 1, 1e-3, 4.2)
    run("relu_l1_1e-3_seed2", 2, 1e-3, 4.4)
    run("relu_l1_0", 0, 0.0, 4.5)
    summarize(tmp_path)
    with open(tmp_path / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    with open(tmp_path / "summary_seeds.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["config_name"] == "relu_l1_1e-3" and row["n_seeds"] == "3" and row["seeds"] == "0 1 2"
    assert float(row["val_ce_mean"]) == pytest.approx(4.2)
    assert float(row["val_ce_ci95"]) == pytest.approx(4.303 * 0.2 / 3 ** 0.5)


def test_paper_profile_mean_and_shape() -> None:
    p = paper_profile(28, 29.0)
    assert sum(p) / len(p) == pytest.approx(29.0)
    assert p[0] < p[1] < max(p) and p.index(max(p)) < 14  # least active first layers, hump in the first half


def test_calibration_hits_targets_with_heavy_tail_and_dead_neurons() -> None:
    torch.manual_seed(0)
    vocab, n = 500, 512
    model = small_paper_like_model(3, 128, n, 4, vocab, torch.device("cpu"))
    targets = [4.0, 12.0, 8.0]
    g = torch.Generator().manual_seed(0)
    heavy = torch.randperm(vocab, generator=g)[:10]
    calib = torch.randint(0, vocab, (8, 64), generator=g)
    calib[:, ::16] = heavy[torch.randint(0, len(heavy), (8, 4), generator=g)]  # heavy tail present in the mean
    returned = calibrate_paper_model(model, targets, calib, heavy_ids=heavy, dead_frac=0.3)
    got = activity(model, calib)["nnz_mean_per_layer"]  # the model's own forward, all tokens (heavy included)
    for t, v, r in zip(targets, got, returned):
        assert v == pytest.approx(t, rel=CALIB_TOL / 2)  # bisection on exactly these tokens, through the real GEMM
        assert r == pytest.approx(v, rel=1e-6)  # what it reports is what the model does
    # Heavy tokens fire more; dead neurons never fire (on any token).
    fired = torch.zeros(3, n, dtype=torch.bool)

    def record(i: int):
        def hook(mod, inp, out) -> None:  # returns None: the layer output is left unchanged
            x = inp[0].reshape(-1, inp[0].shape[-1])
            fired[i] |= (torch.relu(x @ mod.gate_proj.weight.t()) != 0).any(0)
        return hook

    hooks = [m.register_forward_hook(record(i)) for i, m in enumerate(model.sparse_mlps())]
    model.record_nnz_per_token(True)
    ids = torch.randint(0, vocab, (8, 64), generator=g)
    ids[:, ::8] = heavy[torch.randint(0, len(heavy), (8, 8), generator=g)]
    with torch.no_grad():
        model.model(input_ids=ids)
    for h in hooks:
        h.remove()
    per_tok = torch.stack([m.last_nnz_per_token for m in model.sparse_mlps()]).mean(0)
    is_heavy = torch.isin(ids.reshape(-1), heavy)
    assert per_tok[is_heavy].mean() > 3 * per_tok[~is_heavy].mean()
    never = 1 - fired.float().mean(1)
    assert (never > 0.2).all(), never


def test_calibration_holds_under_autocast() -> None:
    """An fp32 model calibrated under bf16 autocast (how memory_breakdown trains): autocast caches its weight casts,
    so the bias writes must reach the counted GEMM; the model's own autocast forward then shows the targets."""
    torch.manual_seed(0)
    vocab = 500
    model = small_paper_like_model(3, 128, 512, 4, vocab, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    heavy = torch.randperm(vocab, generator=g)[:10]
    calib = torch.randint(0, vocab, (8, 64), generator=g)
    targets = [4.0, 12.0, 8.0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        returned = calibrate_paper_model(model, targets, calib, heavy_ids=heavy)
        got = activity(model, calib)["nnz_mean_per_layer"]
    for t, v, r in zip(targets, got, returned):
        assert v == pytest.approx(t, rel=CALIB_TOL / 2)
        assert r == pytest.approx(v, rel=1e-6)


def test_block_order_interleaves_and_balances() -> None:
    o = block_order(4)
    assert o == [0, 1, 1, 0, 0, 1, 1, 0]
    # equal blocks per side, and equal mean position (a linear drift hits both sides alike)
    pos = {k: [i for i, v in enumerate(o) if v == k] for k in (0, 1)}
    assert len(pos[0]) == len(pos[1]) == 4 and sum(pos[0]) == sum(pos[1])


def test_paired_ratios() -> None:
    res = {"dense": {"s_per_call": 2.0, "block_s_per_call": [2.0, 2.2, 1.8]},
           "sparse": {"s_per_call": 1.0, "block_s_per_call": [1.0, 1.1, 1.2]}}
    r = paired_ratios(res)
    assert r["speedup_sparse_over_dense"] == 2.0
    assert r["speedup_block_pairs_min"] == pytest.approx(1.5) and r["speedup_block_pairs_max"] == pytest.approx(2.0)
    assert paired_ratios({"dense": res["dense"], "sparse": {"note": "not measured"}}) == {}


def test_run_lib_eval_and_score_store_outputs(tmp_path: Path) -> None:
    """sfl_eval / sfl_score (experiments/run_lib.sh) put evaluate.py's outputs under NAME.*, skip done work,
    and record a missing model as a failure. evaluate.py is replaced by a shell stand-in writing its files."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "runs" / "exp" / "r1" / "final").mkdir(parents=True)
    (tmp_path / "runs" / "exp" / "r1" / "final" / "config.json").write_text("{}")
    script = f"""
set -e
cd {repo}
SCALE=gpu RUNS_ROOT={tmp_path}/runs RESULTS_ROOT={tmp_path}/res SFL_GIT_COMMIT=x
. experiments/run_lib.sh
python() {{  # stand-in for `python -m sfl.experiments.trainer.evaluate --model M --out DIR ...`
  local out="" score=""
  while [ $# -gt 0 ]; do case "$1" in --out) out=$2; shift ;; --score) score=$2; shift ;; esac; shift; done
  if [ -n "$score" ]; then echo s > "$out/scores.npz"; echo j > "$out/scores.json"; else echo e > "$out/eval.json"; fi
}}
sfl_eval exp r1 eval_sparse --mlp-impl cuda
sfl_score exp r1 eval req.npz --device cuda
sfl_score exp r1 eval req.npz --device cuda
sfl_eval exp missing eval
echo "failed=${{SFL_FAILED[*]}}"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    res = tmp_path / "res" / "exp" / "r1"
    assert sorted(p.name for p in res.iterdir()) == ["eval.scores.json", "eval.scores.npz", "eval_sparse.json"]
    assert "exists, skipped" in out and "failed=exp/missing:eval" in out


def test_speed_bench_sparse_side_runs_the_layers_plans(monkeypatch) -> None:
    """The speed benchmark's sparse side: use_kernel_config gives every layer a plan with SFL_KERNEL_* (passed in,
    read once by main) and --sparse-mode applied; the swapped-in FFN calls the op with that layer's plan and no
    statistics (checked with a stand-in for the CUDA op)."""
    from sfl.experiments.speed.bench import _sparse_ffn, use_kernel_config
    from sfl.kernels.twell import ops

    model = small_paper_like_model(2, 64, 256, 4, 50, torch.device("cpu"))
    monkeypatch.setenv("SFL_KERNEL_SLOTS", "8")   # not read here: the environment comes from main's snapshot
    cfg = use_kernel_config(model, "sparse", {"SFL_KERNEL_SLOTS": "16", "SFL_KERNEL_SELF_TIMING": "0"})
    assert (cfg.mode, cfg.slots, cfg.self_timing) == ("sparse", 16, False)
    assert all(m.plan.config == cfg for m in model.sparse_mlps())
    assert model.config.get_kernel_config() == cfg   # saved with the model config
    calls = []

    def fake(x, w_gate, w_up, w_down, plan, stats=None):
        calls.append((plan, stats))
        return (torch.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T

    monkeypatch.setattr(ops, "ffn", fake)
    monkeypatch.setattr(ops, "ensure_loaded", lambda: None)
    mlp = model.sparse_mlps()[1]
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(_sparse_ffn(mlp, x), mlp(x), rtol=1e-5, atol=1e-6)
    assert calls == [(mlp.plan, None)]


def test_mlp_inputs_capture_every_layer_in_one_forward() -> None:
    """bench.mlp_inputs (the per-layer timing's inputs) equals the layer-by-layer capture calibration uses."""
    from sfl.experiments.speed.bench import _mlp_input, mlp_inputs

    torch.manual_seed(0)
    model = small_paper_like_model(3, 64, 256, 4, 50, torch.device("cpu"))
    ids = torch.randint(0, 50, (2, 16))
    xs = mlp_inputs(model, ids)
    assert len(xs) == 3 and all(x.shape == (32, 64) for x in xs)
    with torch.no_grad():
        for li, x in enumerate(xs):
            assert torch.equal(x, _mlp_input(model, li, ids, chunk=2))
    assert not any(m._forward_pre_hooks for m in model.sparse_mlps())  # hooks removed


def test_calibration_fits_its_sample_and_a_larger_one_carries_over() -> None:
    """On fresh tokens a calibrated model fires more than on its calibration tokens, less so the larger that sample
    (why paper_init calibrates on 64 sequences and records a held-out activity)."""
    vocab, targets = 2000, [4.0, 8.0, 6.0]
    fresh = torch.randint(0, vocab, (32, 128), generator=torch.Generator().manual_seed(9))

    def excess_on_fresh(n_seqs: int) -> float:
        torch.manual_seed(0)
        model = small_paper_like_model(3, 128, 512, 4, vocab, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        heavy = torch.randperm(vocab, generator=g)[:20]
        calibrate_paper_model(model, targets, torch.randint(0, vocab, (n_seqs, 128), generator=g), heavy_ids=heavy)
        return activity(model, fresh)["nnz_mean"] / (sum(targets) / len(targets)) - 1

    small, large = excess_on_fresh(4), excess_on_fresh(64)
    assert small > 0.03 and abs(large) < small / 2, (small, large)
