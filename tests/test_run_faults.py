"""Faults and bad inputs a demanding user meets, each ending in a resumable state or a one-line error that says
what to do: a sweep started twice, a diverging run, shards changed between start and resume or during a run, a
corrupt tokenizer, a full disk outside the checkpoint writer, a kill during checkpoint rotation, broken configs.
CPU fp32, tiny models on synthetic token files (tests/test_run_safety.py's fixtures)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_run_safety import (REPO, VOCAB, Killed, _overwrite_in_vocab, cfg_for, comparable, data_dir,  # noqa: E402,F401
                             make_data, read_log)

from sfl.experiments.trainer import checkpoint as ckpt_mod  # noqa: E402
from sfl.experiments.trainer import rundir  # noqa: E402
from sfl.experiments.trainer import train as train_mod  # noqa: E402
from sfl.experiments.trainer.checkpoint import find_latest, list_checkpoints, load_checkpoint  # noqa: E402
from sfl.experiments.trainer.data_loader import DataError, TokenData  # noqa: E402


def _all_finite(ckpt: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_checkpoint(ckpt)["model"].values())


def _log_steps(out: Path, kind: str = "step") -> list[int]:
    return [x["step"] for x in read_log(out) if x["type"] == kind]


# ----------------------------------------------------------------------------- one writer per run dir
def _sfl_train(tmp: Path, config: Path) -> subprocess.Popen:
    """experiments/run_lib.sh's sfl_train of one run, as a sweep script calls it; exit 3 if it recorded a failure."""
    script = (f". experiments/env.sh && . experiments/run_lib.sh && sfl_train exp r 1 1 {config} && "
              "[ ${#SFL_FAILED[@]} -eq 0 ] || exit 3")
    env = dict(os.environ, OMP_NUM_THREADS="1", RUNS_ROOT=str(tmp / "runs"), RESULTS_ROOT=str(tmp / "results"))
    return subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # killpg stops its python


def test_sweep_started_twice_keeps_the_live_log(data_dir, tmp_path) -> None:
    """A second start of the same sweep run while the first trains: refused, and the first's log is untouched
    (before: run_lib.sh deleted it before train.py took the lock, and the first run's steps went to a deleted
    file). The run then finishes and its results log holds every step once."""
    config = tmp_path / "c.yaml"
    sets = dict(cfg_for(data_dir, tmp_path / "unused"), max_steps=100000, ckpt_every=0, eval_every=0, log_every=1)
    config.write_text(json.dumps({k: v for k, v in sets.items() if k != "out_dir"}))
    out, log = tmp_path / "runs" / "exp" / "r", tmp_path / "runs" / "exp" / "r" / "train_log.jsonl"
    first = _sfl_train(tmp_path, config)
    try:
        deadline = time.time() + 120
        while (not log.exists() or log.read_text().count('"step"') < 3) and time.time() < deadline:
            time.sleep(0.1)
        ino = log.stat().st_ino
        second = _sfl_train(tmp_path, config)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 3 and "in use by another training process" in err, err
        assert first.poll() is None  # still training: the refusal happened while it held the lock
        n = len(_log_steps(out))
        time.sleep(1.0)
        assert log.stat().st_ino == ino and len(_log_steps(out)) > n  # the live log, still written
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    sets["max_steps"] = 5
    config.write_text(json.dumps({k: v for k, v in sets.items() if k != "out_dir"}))
    rerun = _sfl_train(tmp_path, config)
    assert rerun.wait(timeout=300) == 0, rerun.communicate()
    res = tmp_path / "results" / "exp" / "r"
    assert [x["step"] for x in read_log(res) if x["type"] == "step"] == [1, 2, 3, 4, 5]
    assert not (out / "checkpoints").exists() and not list(out.glob(".tmp-*"))


# ----------------------------------------------------------------------------- never a state it cannot resume
@pytest.mark.parametrize("log_every, ckpt_every", [(10, 2), (1, 2), (3, 1)])
def test_divergence_leaves_only_finite_checkpoints(data_dir, tmp_path, log_every, ckpt_every) -> None:
    """lr=1000: the run stops naming the non-finite value, every kept checkpoint holds finite weights (before: with
    log_every 10 both kept checkpoints held NaN), and a resume from the newest or a named one finishes."""
    out = tmp_path / "run"
    over = dict(lr=1000.0, max_steps=30, log_every=log_every, ckpt_every=ckpt_every, eval_every=0)
    with pytest.raises(RuntimeError, match=r"non-finite .*at step \d+"):
        train_mod.train(cfg_for(data_dir, out, **over))
    kept = list_checkpoints(out)
    assert kept and all(_all_finite(c) for c in kept)
    newest = train_mod.checkpoint_step(kept[-1])
    final = train_mod.train(cfg_for(data_dir, out, **{**over, "max_steps": newest}), resume=True)
    assert final["step"] == newest and np.isfinite(final["val_ce"])
    oldest = train_mod.checkpoint_step(kept[0])
    if oldest < newest:  # --resume-from an older one: the newer ones and final/ go, the log is cut back
        final = train_mod.train(cfg_for(data_dir, out, **{**over, "max_steps": oldest}), resume_from=oldest)
        assert final["step"] == oldest and [c.name for c in list_checkpoints(out)] == [kept[0].name]
        assert max(x.get("step", 0) for x in read_log(out)) == oldest


@pytest.mark.filterwarnings("error::UserWarning")  # a skipped first update is no scheduler misuse to warn of
def test_nonfinite_gradient_skipped_then_training_goes_on(data_dir, tmp_path, monkeypatch) -> None:
    """One step with a finite loss and a NaN gradient norm (before: the update was applied and saved as the
    newest checkpoint, and --resume died again) is skipped with a 'skip' line; the run finishes finite."""
    real, calls = train_mod.clip_grad_norm, []

    def nan_at_step_3(params, clip):
        calls.append(1)
        norm = real(params, clip)
        if len(calls) == 3:
            for p in params:
                p.grad.fill_(float("nan"))
            return torch.tensor(float("nan"))
        return norm

    monkeypatch.setattr(train_mod, "clip_grad_norm", nan_at_step_3)
    out = tmp_path / "run"
    final = train_mod.train(cfg_for(data_dir, out, ckpt_every=3, eval_every=0))
    assert np.isfinite(final["val_ce"]) and all(_all_finite(c) for c in list_checkpoints(out))
    skips = [x for x in read_log(out) if x["type"] == "skip"]
    assert [x["step"] for x in skips] == [3] and np.isnan(skips[0]["grad_norm"]) and np.isfinite(skips[0]["loss"])
    with pytest.raises(SystemExit, match=r"^error: non-finite gradient norm at step 1 .*max_nonfinite_skips=0.*"
                                         r"no checkpoint was written"):
        calls.clear()
        calls.extend([1, 1])  # the next call is the third: step 1 of this run
        train_mod.main(["--set", f"data_dir={data_dir}", "--set", f"out_dir={tmp_path / 'strict'}", "--set",
                        "device=cpu", "--set", "max_nonfinite_skips=0", "--set", "max_steps=2", "--set",
                        "warmup_steps=1", "--set", "progress=false"])


def test_nonfinite_checkpoint_refused_at_resume_then_resume_from_an_earlier_one(data_dir, tmp_path,
                                                                                 monkeypatch) -> None:
    """A checkpoint with NaN weights (as versions that saved without checking wrote them) is refused at resume,
    naming --resume-from; `--resume-from step_2` goes on from the earlier one and finishes like a fresh run."""
    full, out = tmp_path / "full", tmp_path / "run"
    train_mod.train(cfg_for(data_dir, full, eval_every=0))
    with pytest.raises(Killed):
        die_at_step_5(monkeypatch)
        train_mod.train(cfg_for(data_dir, out, eval_every=0))
    monkeypatch.undo()
    real = train_mod.load_model_and_optimizer

    def nan_weights_in_step_4(ckpt_dir, state, model, opt):
        real(ckpt_dir, state, model, opt)
        if ckpt_dir.name == "step_0000004":
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    monkeypatch.setattr(train_mod, "load_model_and_optimizer", nan_weights_in_step_4)
    config = _config(tmp_path, data_dir, out, eval_every=0)
    with pytest.raises(SystemExit, match=r"^error: checkpoint .*step_0000004 holds non-finite weights: resume from "
                                         r"an earlier one with --resume-from STEP \(kept: step_0000002, step_0000004"):
        train_mod.main(["--config", str(config), "--resume"])
    train_mod.main(["--config", str(config), "--resume-from", "step_2"])
    assert comparable(read_log(out)) == comparable(read_log(full))


def test_corrupted_checkpoint_shard_refused_at_resume(data_dir, tmp_path) -> None:
    """A flipped byte in a checkpoint's DCP shard (the weights and AdamW state a resume loads) is caught by the
    SHA-256 recorded at the save, with what to do; the earlier checkpoint still resumes."""
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, eval_every=0, max_steps=4))
    shard = next((out / "checkpoints" / "step_0000004" / "dcp").glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))
    config = _config(tmp_path, data_dir, out, eval_every=0, max_steps=6)
    with pytest.raises(SystemExit, match=r"^error: --resume: .*distcp does not match the SHA-256 .*--resume-from"):
        train_mod.main(["--config", str(config), "--resume"])
    train_mod.main(["--config", str(config), "--resume-from", "step_2"])
    assert _log_steps(out)[-1] == 6


def die_at_step_5(monkeypatch) -> None:
    real = TokenData.train_batch

    def dying(self, seed, step, rank, n):
        if step == 4:  # the batch of step 5
            raise Killed
        return real(self, seed, step, rank, n)

    monkeypatch.setattr(TokenData, "train_batch", dying)


# ----------------------------------------------------------------------------- data verified where used
def _rewrite_with_meta(d: Path, name: str) -> None:
    """Change a shard and record its new checksum in meta.json, as a re-run of data.prepare would."""
    tok = d / "tokens"
    _overwrite_in_vocab(tok / name)
    meta = json.loads((tok / "meta.json").read_text())
    for e in meta["train"] + meta["val"]:
        if e["file"] == name:
            e["sha1"] = hashlib.sha1((tok / name).read_bytes()).hexdigest()
    (tok / "meta.json").write_text(json.dumps(meta))


def test_val_shard_changed_before_resume_is_refused(tmp_path) -> None:
    d = make_data(tmp_path / "data")
    out = tmp_path / "run"
    train_mod.train(cfg_for(d, out, max_steps=2, eval_every=0))
    _rewrite_with_meta(d, "val_000.bin")  # consistent meta.json: only the checkpoint's fingerprint sees it
    with pytest.raises(DataError, match=r"val shard .*val_000\.bin changed since the checkpoint.*mix two val sets"):
        train_mod.train(cfg_for(d, out, max_steps=4, eval_every=0), resume=True)


def test_train_shard_rewritten_during_the_run_stops_it(tmp_path, monkeypatch) -> None:
    """A shard rewritten in place while the run reads it (before: the losses changed and nothing was raised):
    stopped at the next log line, and no checkpoint is written from batches read after the change."""
    d = make_data(tmp_path / "data")
    real = TokenData.train_batch

    def rewrite_at_step_3(self, seed, step, rank, n):
        if step == 3:
            time.sleep(0.01)  # a later mtime than the verified one on coarse-clock filesystems
            _overwrite_in_vocab(d / "tokens" / "train_001.bin")
        return real(self, seed, step, rank, n)

    monkeypatch.setattr(TokenData, "train_batch", rewrite_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"train_001\.bin was rewritten in place.*during the run \(seen at step 4\)"
                                        r".*continues from checkpoint step_0000002"):
        train_mod.train(cfg_for(d, out, log_every=2, ckpt_every=2, eval_every=0))
    assert find_latest(out).name == "step_0000002"


def _tokenizer_dir(path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t0").save_pretrained(str(path))


def test_corrupt_tokenizer_refused_before_training(tmp_path) -> None:
    d = make_data(tmp_path / "data")
    _tokenizer_dir(d / "tokenizer")
    tj = d / "tokenizer" / "tokenizer.json"
    tj.write_text(tj.read_text()[:50])
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^error: the tokenizer in .*tokenizer does not load.*--only tokenizer"):
        train_mod.main(["--set", f"data_dir={d}", "--set", f"out_dir={out}", "--set", "device=cpu"])
    assert not (out / "train_log.jsonl").exists()  # refused before anything was written


# ----------------------------------------------------------------------------- full disk, kills, bad inputs
class _FullAfter:
    """A log file whose writes fail with ENOSPC after `n` lines."""

    def __init__(self, f, n: int) -> None:
        self.f, self.n = f, n

    def write(self, text: str) -> int:
        if self.n <= 0:
            self.f.write(text[:5])  # a torn line, as a real full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.n -= 1
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_disk_full_writing_the_log_then_resume(data_dir, tmp_path, monkeypatch) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full))

    def open_filling(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        return _FullAfter(f, 5) if Path(path).name == "train_log.jsonl" else f

    monkeypatch.setattr(train_mod, "open", open_filling, raising=False)
    with pytest.raises(SystemExit, match=r"^error: writing the training log .*no space left on device \(errno "
                                         r"ENOSPC\).*checkpoint step_0000002 is intact.*free disk space"):
        train_mod.main(["--config", str(_config(tmp_path, data_dir, cut))])
    monkeypatch.undo()
    train_mod.train(cfg_for(data_dir, cut), resume=True)
    assert comparable(read_log(cut)) == comparable(read_log(full))


def _config(tmp_path: Path, data_dir: Path, out: Path, **over) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg_for(data_dir, out, **over)))
    return path


SAFETENSORS_ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'


@pytest.mark.parametrize("where", ["final", "hf"])
def test_disk_full_in_save_pretrained_named_as_such(data_dir, tmp_path, monkeypatch, where) -> None:
    """safetensors reports ENOSPC as its own error without an errno (before: a raw SafetensorError traceback for
    final/, '[Errno None]' for a checkpoint's hf/ copy): named 'no space left on device', and --resume finishes."""
    from safetensors import SafetensorError
    real = train_mod.write_pretrained

    def filling(model, dest, tok=None):
        if (where == "final" and dest.name.startswith(".tmp-final")) or (where == "hf" and "step_0000004" in str(dest)):
            raise SafetensorError(SAFETENSORS_ENOSPC)
        real(model, dest, tok)

    monkeypatch.setattr(train_mod, "write_pretrained", filling)
    out = tmp_path / "run"
    kept = "step_0000006" if where == "final" else "step_0000002"
    with pytest.raises(SystemExit, match=rf"^error: .*no space left on device \(errno ENOSPC\).*{kept} is intact"):
        train_mod.main(["--config", str(_config(tmp_path, data_dir, out))])
    monkeypatch.undo()
    train_mod.train(cfg_for(data_dir, out), resume=True)
    assert (out / "final" / "model.safetensors").is_file() and read_log(out)[-1]["type"] == "final"


def test_kill_during_checkpoint_rotation_leaves_nothing_torn(data_dir, tmp_path, monkeypatch) -> None:
    """A kill half-way through removing the oldest checkpoint (before: a step_* dir without COMPLETE stayed
    forever); the next start removes what is left, and the run finishes as an uninterrupted one."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full, ckpt_every=1, eval_every=0))
    real = shutil.rmtree

    def killed_mid_removal(path, *a, **k):
        path = Path(path)
        if (path / "COMPLETE").is_file() and "step_0000001" in path.name:
            (path / "COMPLETE").unlink()
            raise Killed
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", killed_mid_removal)
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, cut, ckpt_every=1, eval_every=0))
    monkeypatch.undo()
    root = cut / "checkpoints"
    assert not [p for p in root.glob("step_*") if not (p / "COMPLETE").is_file()]  # no torn checkpoint
    (root / "step_0000000").mkdir()  # a torn dir an older version left behind
    train_mod.train(cfg_for(data_dir, cut, ckpt_every=1, eval_every=0), resume=True)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000005", "step_0000006"]
    assert comparable(read_log(cut)) == comparable(read_log(full))


def _meta_without_file(d: Path) -> None:
    meta = json.loads((d / "tokens" / "meta.json").read_text())
    del meta["val"][0]["file"]
    (d / "tokens" / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case, pattern", [
    ("missing_config", r"config file .*nope\.yaml' not found"),
    ("malformed_yaml", r"config file .*bad\.yaml' is not valid YAML \(.* at line \d+, column \d+\): fix that line"),
    ("tokens_subdir", r"tokens_subdir=5 is invalid: must be a non-empty path string"),
    ("seed", r"seed=1099511627776 is invalid: must be < 2\*\*32"),
    ("head_dim", r"head_dim = hidden_size / num_attention_heads = 3, which RoPE needs even"),
    ("out_dir_file", r"out_dir=.* is a file, not a directory: choose another out_dir"),
    ("lock_dir", r"\.lock is a directory.*rmdir"),
    ("read_only", r"cannot create the lock file .*Read-only file system \(errno EROFS\); choose a writable out_dir"),
    ("meta_no_file", r"meta\.json: every val entry must be an object with a \"file\" name.*--only tokens"),
])
def test_bad_inputs_are_one_line_errors(data_dir, tmp_path, monkeypatch, case, pattern) -> None:
    out = tmp_path / "run"
    args = ["--set", f"data_dir={data_dir}", "--set", f"out_dir={out}", "--set", "device=cpu"]
    if case == "missing_config":
        args += ["--config", str(tmp_path / "nope.yaml")]
    elif case == "malformed_yaml":
        (tmp_path / "bad.yaml").write_text("lr: 1e-3\nseq_len: [16\n")
        args += ["--config", str(tmp_path / "bad.yaml")]
    elif case in ("tokens_subdir", "seed"):
        args += ["--set", f"{case}={5 if case == 'tokens_subdir' else 2 ** 40}"]
    elif case == "head_dim":
        args += ["--set", "hidden_size=6", "--set", "num_attention_heads=2"]
    elif case == "out_dir_file":
        out.write_text("")
    elif case == "lock_dir":
        (out / ".lock").mkdir(parents=True)
    elif case == "read_only":
        def read_only(path, *a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        monkeypatch.setattr(rundir.os, "open", read_only)
    elif case == "meta_no_file":
        _meta_without_file(data_dir)
    with pytest.raises(SystemExit, match="^error: .*" + pattern):
        train_mod.main(args)
    if case in ("seed", "head_dim", "tokens_subdir"):
        assert not out.exists()  # refused before the lock, nothing written
