"""Re-runnable jobs and what a run records :
- every kept checkpoint holds a save_pretrained copy (hf/) that AutoModelForCausalLM opens, with the weights of
  the training state beside it, written atomically with the checkpoint;
- the log header records the world size, the effective kernel configuration and the data fingerprint;
- the quickstart's training step (experiments/run_lib.sh sfl_train_rerunnable, run by
  experiments/quickstart/run.sh) run twice reuses the finished run, resumes an interrupted one, and puts other
  settings in a new directory, never touching finished work.
CPU fp32, a synthetic token memmap, a tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sfl.experiments.trainer import train as train_mod  # noqa: E402
from sfl.experiments.trainer.checkpoint import HF_SUBDIR, find_latest, list_checkpoints, load_checkpoint  # noqa: E402
from sfl.experiments.trainer.weight_hashes import verify_weight_hashes  # noqa: E402
from sfl.experiments.trainer.config import load_config  # noqa: E402
from sfl.experiments.trainer.data_loader import TokenData  # noqa: E402
from sfl.experiments.trainer.runs import pick_run_dir, run_state  # noqa: E402
from sfl.kernels.config import KernelConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 61
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "seq_len": 16, "micro_batch_size": 4, "grad_accum": 1, "max_steps": 6, "warmup_steps": 2, "lr": 3e-3,
        "l1_coeff": 1e-2, "l1_warmup_steps": 3, "log_every": 2, "eval_every": 3, "eval_batches": 2,
        "ckpt_every": 3, "device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """uint16 token memmaps + meta.json in the prepared-data layout (two train shards, one val shard)."""
    d = tmp_path_factory.mktemp("data")
    tok = d / "tokens"
    tok.mkdir()
    rng = np.random.default_rng(0)
    meta = {"vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "tokenizer": "synthetic", "train": [], "val": []}
    for name, n, split in [("train_000.bin", 4000, "train"), ("train_001.bin", 2000, "train"),
                           ("val_000.bin", 1000, "val")]:
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(tok / name)
        meta[split].append({"file": name, "tokens": n})
    (tok / "meta.json").write_text(json.dumps(meta))
    return d


def cfg_for(data_dir: Path, out_dir: Path, **over) -> dict:
    sets = {**TINY, "data_dir": str(data_dir), "out_dir": str(out_dir), **over}
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- item 6: the log header
def test_header_records_world_size_kernel_config_and_data(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=2, ckpt_every=0, eval_every=0, ckpt_hf=False))
    header = read_log(out)[0]
    assert header["type"] == "header"
    assert header["world_size"] == 1
    assert header["kernel_config"] == KernelConfig().to_dict()  # the model's defaults: no override was given
    fp = TokenData(data_dir / "tokens", 16).fingerprint()
    data = header["data"]
    assert data["tokens_dir"] == str(data_dir / "tokens") and data["tokenizer"] == "synthetic"
    assert data["vocab_size"] == VOCAB
    assert [tuple(s) for s in data["train"]] == fp["train"] and [tuple(s) for s in data["val"]] == fp["val"]
    assert [s[:2] for s in data["train"]] == [["train_000.bin", 4000], ["train_001.bin", 2000]]
    assert all(len(s[2]) == 40 for s in data["train"] + data["val"])  # SHA-1 hex digests of the contents


def test_header_kernel_config_is_the_effective_one(data_dir, tmp_path, monkeypatch) -> None:
    """The run's kernel: block is what the header records."""
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=2, ckpt_every=0, eval_every=0, ckpt_hf=False, save_final=False,
                            kernel={"train_width": 96}))
    header = read_log(out)[0]
    assert header["kernel_config"]["train_width"] == 96 != KernelConfig().train_width
    assert header["kernel_config"] == KernelConfig(train_width=96).to_dict()


# ----------------------------------------------------------------------------- item 5: checkpoints HF-native
def _load_remote(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


def test_every_kept_checkpoint_opens_with_from_pretrained(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=9))  # checkpoints at 3, 6, 9; the newest two kept
    kept = list_checkpoints(out)
    assert [c.name for c in kept] == ["step_0000006", "step_0000009"]
    for ckpt in kept:
        hf = ckpt / HF_SUBDIR
        cfg = json.loads((hf / "config.json").read_text())
        assert cfg["auto_map"]["AutoModelForCausalLM"].endswith("modeling_sparse_llama.SparseLlamaForCausalLM")
        assert (hf / "modeling_sparse_llama.py").is_file() and (hf / "model.safetensors").is_file()
        assert verify_weight_hashes(hf)  # the SHA-256 of its weights, recorded at save time, holds
        model = _load_remote(hf)
        assert type(model).__name__ == "SparseLlamaForCausalLM"
        state = load_checkpoint(ckpt)["model"]  # the training state's weights (DCP shards)
        got = model.state_dict()
        assert got.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(got[k], v), (ckpt.name, k)
    # the intermediate copy is not the final model: training moved on after step 6
    first = load_checkpoint(kept[0])["model"]
    last = load_checkpoint(kept[1])["model"]
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_failed_hf_copy_leaves_no_half_written_checkpoint(data_dir, tmp_path, monkeypatch) -> None:
    """A save_pretrained copy that fails (here: safetensors' own error after a partial write) aborts that
    checkpoint as a whole: the previous one stays newest and intact, no temp dir remains, and --resume goes
    on from it to the same end as an uninterrupted run."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    real = train_mod.write_pretrained

    def failing(model, dest, tok=None):
        if "step_0000006" in str(dest):
            dest.mkdir(parents=True)
            (dest / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("safetensors: Error while serializing")
        real(model, dest, tok)

    monkeypatch.setattr(train_mod, "write_pretrained", failing)
    from sfl.experiments.trainer.checkpoint import CheckpointWriteError
    with pytest.raises(CheckpointWriteError, match="save_pretrained copy failed.*serializing"):
        train_mod.train(cfg_for(data_dir, out))
    assert find_latest(out).name == "step_0000003"
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == ["step_0000003"]
    monkeypatch.setattr(train_mod, "write_pretrained", real)
    final = train_mod.train(cfg_for(data_dir, out), resume=True)
    want = train_mod.train(cfg_for(data_dir, ref))
    assert final["val_ce"] == want["val_ce"]
    assert torch.equal(_load_remote(find_latest(out) / HF_SUBDIR).model.embed_tokens.weight,
                       _load_remote(find_latest(ref) / HF_SUBDIR).model.embed_tokens.weight)


# ----------------------------------------------------------------------------- item 5: re-runnable job
def test_pick_run_dir_states(data_dir, tmp_path) -> None:
    base = tmp_path / "qs"
    cfg = cfg_for(data_dir, base, max_steps=3, ckpt_hf=False)
    assert pick_run_dir(base, cfg) == (base, "new")
    train_mod.train(cfg)
    assert run_state(base)[0] == "finished"
    assert pick_run_dir(base, cfg) == (base, "finished")
    # paths and the progress bar do not make another run; anything else does
    moved = cfg_for(data_dir.parent / "elsewhere", base, max_steps=3, ckpt_hf=False, progress=True)
    assert pick_run_dir(base, moved) == (base, "finished")
    # a run logged before a config key existed: the key counts as its default (here ckpt_hf's, true)
    from sfl.experiments.trainer.runs import same_run
    saved = {k: v for k, v in run_state(base)[1].items() if k != "ckpt_hf"}
    assert same_run(saved, {**cfg, "ckpt_hf": True}) and not same_run(saved, cfg)
    other = cfg_for(data_dir, base, max_steps=3, ckpt_hf=False, l1_coeff=0.0)
    assert pick_run_dir(base, other) == (tmp_path / "qs-2", "new")
    assert pick_run_dir(base, cfg, fresh=True) == (tmp_path / "qs-2", "new")
    # interrupted: no final line and no final model (killed between the last checkpoint and the end)
    rows = (base / "train_log.jsonl").read_text().splitlines()
    (base / "train_log.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    assert pick_run_dir(base, cfg) == (base, "unfinished")
    # a log torn before its header, with nothing else: nothing to lose, so the directory is reused
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "train_log.jsonl").write_text('{"type": "hea')
    assert pick_run_dir(torn, cfg) == (torn, "new")


def _rerun(base: Path, config: Path, *sets: str, fresh: bool = False) -> tuple[str, str]:
    """The quickstart's training step, as run.sh runs it (its shell function, with this interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SFL_GIT_COMMIT": "test"}
    script = ('set -euo pipefail; . experiments/run_lib.sh; sfl_train_rerunnable "$@"; '
              'echo "RESULT $SFL_RUN_STATE $SFL_RUN_DIR"')
    r = subprocess.run(["bash", "-c", script, "_", str(base), str(config), "1" if fresh else "0", *sets],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    state, run_dir = r.stdout.strip().splitlines()[-1].split(" ", 2)[1:]
    return state, run_dir


def test_quickstart_training_step_twice_in_a_row(data_dir, tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in {**TINY, "data_dir": str(data_dir)}.items()))
    base = tmp_path / "runs" / "quickstart"

    assert _rerun(base, config, "log_every=3") == ("new", str(base))  # run.sh's extra arguments: --set overrides
    assert read_log(base)[0]["config"]["log_every"] == 3
    log = (base / "train_log.jsonl").read_text()
    final_weights = (base / "final" / "model.safetensors").read_bytes()
    ckpts = [(c.name, c.stat().st_mtime_ns) for c in list_checkpoints(base)]

    # the second run in a row: the finished run is reported, not retrained, nothing rewritten
    assert _rerun(base, config, "log_every=3") == ("finished", str(base))
    assert (base / "train_log.jsonl").read_text() == log
    assert (base / "final" / "model.safetensors").read_bytes() == final_weights
    assert [(c.name, c.stat().st_mtime_ns) for c in list_checkpoints(base)] == ckpts

    # (other settings or FRESH=1 train in a new directory: test_pick_run_dir_states; not run here to keep it short)

    # interrupted after its last checkpoint (the final line and model not written yet): resumed, not restarted
    rows = log.splitlines()
    (base / "train_log.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    os.rename(base / "final", tmp_path / "final_before")
    assert _rerun(base, config, "log_every=3") == ("unfinished", str(base))
    lines = read_log(base)
    assert [x["type"] for x in lines].count("final") == 1 and lines[-1]["type"] == "final"
    assert [x["type"] for x in lines].count("resume") == 1
    assert (base / "final" / "model.safetensors").read_bytes() == final_weights
