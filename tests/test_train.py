"""experiments/trainer/train.py: JSONL log schema, exact resume, crash-safe checkpoints, config errors.
CPU fp32, a synthetic token memmap in tmp, a tiny model: every run takes a second or two."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sfl.experiments.trainer import train as train_mod  # noqa: E402
from sfl.experiments.trainer.checkpoint import find_latest, list_checkpoints, load_checkpoint  # noqa: E402
from sfl.experiments.trainer.config import ConfigError, l1_coeff_at, load_config, lr_at  # noqa: E402
from sfl.experiments.trainer.data_loader import TokenData  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 61
STEP_KEYS = {"type", "step", "tokens", "loss", "ce", "l1", "l1_coeff", "lr", "grad_norm", "tokens_per_s", "nnz_mean",
             "nnz_max", "dead_frac", "nnz_mean_per_layer", "nnz_max_per_layer", "dead_frac_per_layer"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """uint16 token memmaps + meta.json in the prepared-data layout (two train files)."""
    d = tmp_path_factory.mktemp("data")
    tok = d / "tokens"
    tok.mkdir()
    rng = np.random.default_rng(0)

    def stream(n: int) -> np.ndarray:  # learnable: a periodic sequence with 10% noise
        base = (np.arange(n) * 5) % VOCAB
        return np.where(rng.random(n) < 0.1, rng.integers(0, VOCAB, n), base).astype(np.uint16)

    meta = {"vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "train": [], "val": []}
    for name, n, split in [("train_000.bin", 6000, "train"), ("train_001.bin", 3000, "train"),
                           ("val_000.bin", 2000, "val")]:
        stream(n).tofile(tok / name)
        meta[split].append({"file": name, "tokens": n})
    (tok / "meta.json").write_text(json.dumps(meta))
    return d


def cfg_for(data_dir: Path, out_dir: Path, **over) -> dict:
    sets = {"data_dir": str(data_dir), "out_dir": str(out_dir), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "seq_len": 16, "micro_batch_size": 4, "grad_accum": 2,
            "max_steps": 6, "warmup_steps": 2, "lr": 3e-3, "l1_coeff": 1e-2, "l1_warmup_steps": 3, "log_every": 1,
            "eval_every": 3, "eval_batches": 2, "ckpt_every": 3, "device": "cpu", "progress": False,
            "dead_window_tokens": 64}
    sets.update(over)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- log schema
def test_log_schema_and_final_model(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    final = train_mod.train(cfg_for(data_dir, out))
    lines = read_log(out)
    header = lines[0]
    assert header["type"] == "header"
    assert {"git_commit", "torch", "transformers", "host", "time_utc"} <= set(header["provenance"])
    assert header["config"]["l1_coeff"] == 1e-2 and header["config"]["out_dir"] == str(out)
    assert header["n_params"] > 0
    steps = [x for x in lines if x["type"] == "step"]
    assert [x["step"] for x in steps] == [1, 2, 3, 4, 5, 6]
    for x in steps:
        assert set(x) == STEP_KEYS
        assert len(x["nnz_mean_per_layer"]) == 2 and len(x["dead_frac_per_layer"]) == 2
        assert 0 <= x["nnz_mean"] <= x["nnz_max"] <= 64 and 0 <= x["dead_frac"] <= 1
        assert x["loss"] == pytest.approx(x["ce"] + x["l1_coeff"] * x["l1"], rel=1e-5)
    assert [x["tokens"] for x in steps] == [i * 4 * 2 * 16 for i in range(1, 7)]
    # L1 warm-up: linear ramp over 3 steps; LR: linear warm-up then cosine
    assert [x["l1_coeff"] for x in steps[:4]] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2])
    assert steps[0]["lr"] == pytest.approx(1.5e-3) and steps[1]["lr"] == pytest.approx(3e-3)
    assert steps[-1]["lr"] < steps[2]["lr"]
    evals = [x for x in lines if x["type"] == "eval"]
    assert [x["step"] for x in evals] == [3, 6] and all(x["val_ce"] > 0 and x["val_nnz_mean"] >= 0 for x in evals)
    assert lines[-1] == final and final["type"] == "final" and final["step"] == 6
    assert final["val_ce"] == evals[-1]["val_ce"] and final["wall_s"] > 0
    assert steps[-1]["ce"] < steps[0]["ce"]  # it learns something

    from sfl import models  # noqa: F401
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == "SparseLlamaForCausalLM" and model.config.l1_coeff == 1e-2
    ckpt = load_checkpoint(find_latest(out))
    assert ckpt["step"] == 6
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k


# ----------------------------------------------------------------------------- exact resume
class Killed(Exception):
    pass


def test_logged_l1_coeff_is_the_applied_one(data_dir, tmp_path) -> None:
    """Every step row's l1_coeff is the coefficient in its loss: loss - ce = l1_coeff * l1, at the paper's recipe
    (sum reduction; a coefficient scaled up so the float32 difference resolves it), through the L1 ramp, and with
    rows only every other step."""
    train_mod.train(cfg_for(data_dir, tmp_path / "r", l1_reduction="sum", l1_coeff=1e-3, l1_warmup_start=1,
                            l1_warmup_steps=2, log_every=2, max_steps=8, eval_every=0, ckpt_every=0,
                            save_final=False, ckpt_hf=False))
    steps = [x for x in read_log(tmp_path / "r") if x["type"] == "step"]
    assert [x["step"] for x in steps] == [2, 4, 6, 8]
    assert [x["l1_coeff"] for x in steps] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])  # step 2 is ramp step 1 of 2
    for x in steps:
        assert x["loss"] - x["ce"] == pytest.approx(x["l1_coeff"] * x["l1"], rel=1e-2)


def test_corpus_budget_schedule_lowers_the_loss(data_dir, tmp_path) -> None:
    """paper_scale's short budget (corpus.yaml: steps, warm-up, lr over paper.yaml's optimizer and L1 recipe) on a
    tiny model: the loss falls over the budget's steps (the 0.5B runs behind the choice are in its README)."""
    import yaml

    here = REPO / "experiments" / "paper_scale"
    paper, budget = (yaml.safe_load((here / f).read_text()) for f in ("paper.yaml", "corpus.yaml"))
    recipe = {k: paper[k] for k in ("l1_coeff", "l1_reduction", "betas", "eps", "weight_decay", "grad_clip", "min_lr")}
    recipe.update({k: budget[k] for k in ("max_steps", "warmup_steps", "lr")})
    train_mod.train(cfg_for(data_dir, tmp_path / "b", **recipe, l1_warmup_steps=0, eval_every=0, ckpt_every=0,
                            save_final=False, ckpt_hf=False))
    losses = [x["loss"] for x in read_log(tmp_path / "b") if x["type"] == "step"]
    assert len(losses) == budget["max_steps"]
    quarter = len(losses) // 4
    assert max(losses[budget["warmup_steps"]:]) < losses[0]
    assert np.mean(losses[-quarter:]) < np.mean(losses[:quarter]) - 0.05


def test_resume_is_exact(data_dir, tmp_path, monkeypatch) -> None:
    full_out, cut_out = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full_out))

    # Interrupted run: dies while drawing the batch of step 5 (checkpoint at 3, lines logged to 4).
    real = TokenData.train_batch

    def dying(self, seed, step, rank, n):
        if step == 4:
            raise Killed
        return real(self, seed, step, rank, n)

    monkeypatch.setattr(TokenData, "train_batch", dying)
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, cut_out))
    monkeypatch.setattr(TokenData, "train_batch", real)
    assert [x["step"] for x in read_log(cut_out) if x["type"] == "step"] == [1, 2, 3, 4]
    assert find_latest(cut_out).name == "step_0000003"

    train_mod.train(cfg_for(data_dir, cut_out), resume=True)

    full, cut = read_log(full_out), read_log(cut_out)
    assert [x["type"] for x in cut].count("header") == 1 and [x["type"] for x in cut].count("final") == 1
    assert [x for x in cut if x["type"] == "resume"][0]["step"] == 3
    f_steps = [x for x in full if x["type"] == "step"]
    c_steps = [x for x in cut if x["type"] == "step"]
    assert [x["step"] for x in c_steps] == [1, 2, 3, 4, 5, 6]  # step 4 re-run once, not duplicated
    for a, b in zip(f_steps, c_steps):
        for k in STEP_KEYS - {"tokens_per_s"}:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    assert [x for x in full if x["type"] == "eval"] == [x for x in cut if x["type"] == "eval"]
    pf, pc = load_checkpoint(find_latest(full_out)), load_checkpoint(find_latest(cut_out))
    for k in pf["model"]:
        assert torch.equal(pf["model"][k], pc["model"][k]), k
    for a, b in zip(pf["trackers"], pc["trackers"]):
        assert torch.equal(a, b)


def test_resume_refuses_changed_config_and_fresh_run_refuses_existing(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=3, eval_every=0))
    with pytest.raises(ConfigError, match="lr"):
        train_mod.train(cfg_for(data_dir, out, max_steps=3, eval_every=0, lr=1e-2), resume=True)
    with pytest.raises(ConfigError, match="--resume"):
        train_mod.train(cfg_for(data_dir, out, max_steps=3, eval_every=0))
    # --resume on an out_dir without checkpoint (killed before the first one) starts from scratch
    new = tmp_path / "new"
    new.mkdir()
    (new / "train_log.jsonl").write_text('{"type": "header"}\n{"type": "step", "step": 1}\n')
    train_mod.train(cfg_for(data_dir, new, max_steps=1, warmup_steps=1, eval_every=0), resume=True)
    assert [x["type"] for x in read_log(new)] == ["header", "step", "eval", "final"]


# ----------------------------------------------------------------------------- init_from / SiLU
def test_init_from_dense_llama_and_sparse_checkpoint(data_dir, tmp_path) -> None:
    from sfl import models  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=32, hidden_act="silu"))
    dense.save_pretrained(tmp_path / "dense")
    common = dict(max_steps=2, warmup_steps=1, eval_every=0, ckpt_every=0)
    train_mod.train(cfg_for(data_dir, tmp_path / "a", init_from=str(tmp_path / "dense"), **common))
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final")
    assert a.config.hidden_size == 48 and a.config.hidden_act == "relu" and a.config.l1_coeff == 1e-2
    assert read_log(tmp_path / "a")[0]["n_params"] == sum(p.numel() for p in dense.parameters())
    # continue from a SparseLlama checkpoint with other sparsity settings
    train_mod.train(cfg_for(data_dir, tmp_path / "b", init_from=str(tmp_path / "a" / "final"), l1_coeff=0.0,
                            l1_reduction="sum", **common))
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final")
    assert b.config.l1_reduction == "sum" and b.config.l1_coeff == 0.0
    with pytest.raises(ConfigError, match="seq_len"):
        train_mod.train(cfg_for(data_dir, tmp_path / "c", init_from=str(tmp_path / "dense"), seq_len=64, **common))


def test_silu_baseline_trains(data_dir, tmp_path) -> None:
    train_mod.train(cfg_for(data_dir, tmp_path / "s", activation="silu", l1_coeff=0.0, max_steps=2, warmup_steps=1,
                            eval_every=0, ckpt_every=0))
    step = [x for x in read_log(tmp_path / "s") if x["type"] == "step"][-1]
    assert step["nnz_mean"] > 0.9 * 64  # SiLU activations are (almost) never exactly zero


def test_dead_neuron_reinit(data_dir, tmp_path, monkeypatch) -> None:
    """Eq. 6 moves exactly the dead gate rows toward N(0, std^2); live rows and other weights are untouched."""
    from sfl.models.sparsity import reinit_dead_rows

    w = torch.randn(6, 4)
    since = torch.tensor([0, 100, 5, 64, 63, 1000])
    before = w.clone()
    n = reinit_dead_rows(w, since, window=64, lam=0.1, std=0.02, generator=torch.Generator().manual_seed(0))
    dead = since >= 64
    assert n == int(dead.sum()) == 3
    assert torch.equal(w[~dead], before[~dead])
    noise = torch.randn((3, 4), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(w[dead], 0.9 * before[dead] + 0.1 * 0.02 * noise)

    # In a run: gate rows zeroed at build time are dead (relu(0) = 0 never fires); the loop must move them,
    # log how many it moved, and stay exact across a resume.
    real_build = train_mod.build_model

    def build_with_dead_rows(*a, **kw):
        model = real_build(*a, **kw)
        with torch.no_grad():
            for mlp in model.sparse_mlps():
                mlp.gate_proj.weight[:8] = 0.0
        return model

    monkeypatch.setattr(train_mod, "build_model", build_with_dead_rows)
    over = dict(dead_reinit_lambda=0.1, max_steps=6, eval_every=0, ckpt_every=3)
    train_mod.train(cfg_for(data_dir, tmp_path / "full", **over))
    steps = [x for x in read_log(tmp_path / "full") if x["type"] == "step"]
    assert steps[0]["reinit_neurons"] >= 2 * 8  # 2 layers x 8 dead rows moved after step 1
    real = TokenData.train_batch

    def dying(self, seed, step, rank, n):  # killed while drawing step 5's batch; checkpoint at 3
        if step == 4:
            raise Killed
        return real(self, seed, step, rank, n)

    monkeypatch.setattr(TokenData, "train_batch", dying)
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, tmp_path / "cut", **over))
    monkeypatch.setattr(TokenData, "train_batch", real)
    train_mod.train(cfg_for(data_dir, tmp_path / "cut", **over), resume=True)
    a = [x["loss"] for x in read_log(tmp_path / "full") if x["type"] == "step"]
    b = [x["loss"] for x in read_log(tmp_path / "cut") if x["type"] == "step"]
    assert a == b


def test_dead_reinit_config_errors() -> None:
    with pytest.raises(ConfigError, match="dead_reinit_lambda"):
        load_config(None, ["dead_reinit_lambda=1.5"])
    with pytest.raises(ConfigError, match="dead_reinit_std"):
        load_config(None, ["dead_reinit_std=0"])


# ----------------------------------------------------------------------------- crash safety
def test_leftover_tmp_and_incomplete_checkpoints_are_ignored(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=3, eval_every=0, ckpt_every=1))
    root = out / "checkpoints"
    assert [d.name for d in list_checkpoints(out)] == ["step_0000002", "step_0000003"]  # last + previous
    # a crash mid-save leaves a temp dir; a torn dir without COMPLETE; a latest.json pointing at it
    (root / ".tmp-step_0000004.999").mkdir()
    (root / ".tmp-step_0000004.999" / "state.pt").write_bytes(b"garbage")
    (root / "step_0000009").mkdir()
    (root / "step_0000009" / "state.pt").write_bytes(b"torn")
    (root / "latest.json").write_text('{"dir": "step_0000009", "step": 9}')
    assert find_latest(out).name == "step_0000003"
    train_mod.train(cfg_for(data_dir, out, max_steps=5, eval_every=0, ckpt_every=1), resume=True)
    assert find_latest(out).name == "step_0000005"
    assert not list(root.glob(".tmp-*"))
    assert [x["step"] for x in read_log(out) if x["type"] == "step"] == [1, 2, 3, 4, 5]


def test_sigkill_never_corrupts_checkpoint(data_dir, tmp_path) -> None:
    """Kill a real training process at an arbitrary moment; the newest checkpoint still loads and
    the run resumes to completion."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "sfl.experiments.trainer.train", "--set", f"data_dir={data_dir}", "--set", f"out_dir={out}",
            "--set", "hidden_size=32", "--set", "intermediate_size=64", "--set", "num_hidden_layers=2",
            "--set", "num_attention_heads=2", "--set", "seq_len=16", "--set", "micro_batch_size=4",
            "--set", "max_steps=400", "--set", "warmup_steps=2", "--set", "ckpt_every=1", "--set", "eval_every=0",
            "--set", "eval_batches=1", "--set", "device=cpu", "--set", "progress=false", "--set", "log_every=1"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(list_checkpoints(out)) < 2:
            time.sleep(0.05)
        time.sleep(0.3)  # somewhere inside later steps / saves
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = find_latest(out)
    assert latest is not None
    state = load_checkpoint(latest)
    assert state["step"] >= 1
    done = train_mod.train(cfg_for(data_dir, out, max_steps=state["step"] + 2, warmup_steps=2, ckpt_every=1,
                                   eval_every=0, eval_batches=1, grad_accum=1, l1_coeff=0.0, l1_warmup_steps=0,
                                   dead_window_tokens=None, lr=1e-3),
                           resume=True)
    assert done["step"] == state["step"] + 2
    steps = [x["step"] for x in read_log(out) if x["type"] == "step"]
    assert steps == list(range(1, done["step"] + 1))


# ----------------------------------------------------------------------------- data + schedules
def test_sampler_is_deterministic_and_in_range(data_dir) -> None:
    data = TokenData(data_dir / "tokens", 16)
    a, b = data.train_batch(1, 7, 0, 32), data.train_batch(1, 7, 0, 32)
    assert torch.equal(a, b) and a.shape == (32, 17)
    assert not torch.equal(a, data.train_batch(1, 8, 0, 32))
    assert not torch.equal(a, data.train_batch(1, 7, 1, 32))
    assert int(a.max()) < VOCAB
    v = data.val_windows(4)
    assert torch.equal(v[1, :1], v[0, -1:])  # consecutive windows share one boundary token
    with pytest.raises(ValueError, match="eval_batches"):
        data.val_windows(10_000)


def test_schedules() -> None:
    cfg = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "max_steps": 14, "l1_coeff": 2.0, "l1_warmup_start": 2,
           "l1_warmup_steps": 4}
    assert [lr_at(cfg, s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(cfg, 9) == pytest.approx(0.55) and lr_at(cfg, 14) == pytest.approx(0.1)
    assert [l1_coeff_at(cfg, s) for s in range(7)] == pytest.approx([0, 0, 0.5, 1.0, 1.5, 2.0, 2.0])


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("override, key", [
    ("l1_coeff=-1e-5", "l1_coeff"),
    ("mlp_impl=sparse", "mlp_impl"),
    ("mlp_impl=cuda", "mlp_impl"),
    ("mlp_impl=reference", "intermediate_size"),   # 512 is fine, 500 is not: see below
    ("lr_warmup=10", "lr_warmup"),
    ("betas=[0.9]", "betas"),
    ("seq_len=0", "seq_len"),
    ("precision=fp16", "precision"),
])
def test_bad_config_names_key(override, key) -> None:
    sets = [override] + (["intermediate_size=500"] if key == "intermediate_size" else []) \
        + (["device=cpu"] if override == "mlp_impl=cuda" else [])
    with pytest.raises(ConfigError, match=key):
        load_config(None, sets)


def test_yaml_numbers_and_activation(tmp_path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("l1_coeff: 2e-5\nlr: 1e-3\nbetas: [0.9, 95e-2]\nactivation: silu\n")
    cfg = load_config(good)  # YAML 1.1 reads 2e-5 as a string; float keys accept it
    assert cfg["l1_coeff"] == 2e-5 and cfg["lr"] == 1e-3 and cfg["betas"] == [0.9, 0.95]
    with pytest.raises(ConfigError, match="l1_coeff"):
        load_config(None, ["l1_coeff=abc"])
    with pytest.raises(ConfigError, match="activation"):
        load_config(None, ["activation=gelu"])
    with pytest.raises(ConfigError, match="activation"):
        load_config(None, ["activation=silu", "mlp_impl=reference", "intermediate_size=512"])


def test_unknown_yaml_key_and_cli_exit(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 64\nl1_coef: 1e-5\n")
    with pytest.raises(ConfigError, match="l1_coef.*did you mean 'l1_coeff'"):
        load_config(bad)
    with pytest.raises(SystemExit, match="l1_coeff"):
        train_mod.main(["--set", "l1_coeff=-1"])


def test_provenance_prefers_exported_commit(monkeypatch):
    """On the GPU machine the copied tree may carry a stale .git: an exported SFL_GIT_COMMIT names the commit, and
    the local HEAD (when it differs) is kept beside it."""
    from sfl.experiments.trainer import provenance
    from sfl.kernels import provenance as measured

    monkeypatch.setattr(measured, "git", lambda *a: "a" * 40 if a[0] == "rev-parse" else "")
    monkeypatch.setenv("SFL_GIT_COMMIT", "b" * 40)
    monkeypatch.setenv("SFL_GIT_DIRTY", "false")
    info = provenance.collect()
    assert info["git_commit"] == "b" * 40 and info["git_dirty"] == "false" and info["git_head_local"] == "a" * 40
    monkeypatch.delenv("SFL_GIT_COMMIT")
    info = provenance.collect()
    assert info["git_commit"] == "a" * 40 and info["git_dirty"] is False and "git_head_local" not in info


def test_build_model_takes_the_kernel_block(tmp_path, monkeypatch) -> None:
    """The YAML kernel: block is the model's KernelConfig (and its saved config); the environment is not read."""
    monkeypatch.setenv("SFL_KERNEL_TRAIN_WIDTH", "64")   # benchmark sweeps only: the trainer ignores it
    plain = train_mod.build_model(cfg_for(tmp_path, tmp_path / "run"), VOCAB, 0, 64)
    assert plain.config.kernel_config is None and plain.config.get_kernel_config().train_width == 128
    cfg = cfg_for(tmp_path, tmp_path / "run", kernel={"train_width": 96, "train_mode": "sparse"})
    model = train_mod.build_model(cfg, VOCAB, 0, 64)
    kc = model.config.get_kernel_config()
    assert (kc.train_width, kc.train_mode) == (96, "sparse") and model.config.kernel_config["train_width"] == 96
    assert all(m.plan.config == kc for m in model.sparse_mlps())
    model.save_pretrained(tmp_path / "saved")  # init_from a sparse checkpoint takes the block too
    again = train_mod.build_model({**cfg, "init_from": str(tmp_path / "saved")}, VOCAB, 0, 64)
    assert again.config.get_kernel_config() == kc and all(m.plan.config == kc for m in again.sparse_mlps())
    with pytest.raises(ConfigError, match=r"kernel=.*KernelConfig\.train_mode"):
        load_config(sets=["kernel={train_mode: fast}"])


def test_a_throwaway_run_writes_no_checkpoint(data_dir, tmp_path, monkeypatch) -> None:
    """ckpt_last=false with ckpt_every=0 (throughput runs): no checkpoint is written and none is asked disk space
    for; the default checkpoints the last step."""
    from sfl.experiments.trainer import preflight

    asked = []
    monkeypatch.setattr(preflight, "free_bytes", lambda p: asked.append(p) or 0)  # a full disk
    with pytest.raises(ConfigError, match="MiB free"):
        train_mod.train(cfg_for(data_dir, tmp_path / "kept", max_steps=2, ckpt_every=0, save_final=False,
                                ckpt_hf=False))
    train_mod.train(cfg_for(data_dir, tmp_path / "thrown", max_steps=2, ckpt_every=0, ckpt_last=False,
                            save_final=False, ckpt_hf=False))
    assert list_checkpoints(tmp_path / "thrown") == [] and read_log(tmp_path / "thrown")[-1]["type"] == "final"
    assert preflight.planned_checkpoints({"max_steps": 10, "ckpt_every": 3, "ckpt_last": True}) == 4
