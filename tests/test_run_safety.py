"""Runs that cannot lose or corrupt work: the run-directory lock, start-up checks, data verified where
used, exact resume of every logged line, ENOSPC. CPU fp32, tiny models on synthetic token files: seconds each."""
from __future__ import annotations

import builtins
import hashlib
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

from sfl.experiments.trainer import checkpoint as ckpt_mod  # noqa: E402
from sfl.experiments.trainer import preflight  # noqa: E402
from sfl.experiments.trainer import train as train_mod  # noqa: E402
from sfl.experiments.trainer.checkpoint import CheckpointWriteError, find_latest, load_checkpoint, save_checkpoint  # noqa: E402
from sfl.experiments.trainer.config import ConfigError, load_config  # noqa: E402
from sfl.experiments.trainer.data_loader import DataError, TokenData  # noqa: E402
from sfl.experiments.trainer.rundir import RunDirBusy, RunLock  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 61
TIMING = {"tokens_per_s", "wall_s"}
_real_train_batch = TokenData.train_batch  # the only fields that may differ between a resumed and an uninterrupted run


def make_data(root: Path, checksums: bool = True, val_tokens: int = 2000) -> Path:
    """Token shards + meta.json in the prepared layout (with the per-shard sha1 data.prepare records)."""
    tok = root / "tokens"
    tok.mkdir(parents=True)
    rng = np.random.default_rng(0)
    meta = {"vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "train": [], "val": []}
    for name, n, split in [("train_000.bin", 6000, "train"), ("train_001.bin", 3000, "train"),
                           ("val_000.bin", val_tokens, "val")]:
        base = (np.arange(n) * 5) % VOCAB
        arr = np.where(rng.random(n) < 0.1, rng.integers(0, VOCAB, n), base).astype(np.uint16)
        arr.tofile(tok / name)
        entry = {"file": name, "tokens": n}
        if checksums:
            entry["sha1"] = hashlib.sha1((tok / name).read_bytes()).hexdigest()
        meta[split].append(entry)
    (tok / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.fixture()
def data_dir(tmp_path) -> Path:
    return make_data(tmp_path / "data")


def cfg_for(data_dir: Path, out_dir: Path, **over) -> dict:
    sets = {"data_dir": str(data_dir), "out_dir": str(out_dir), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "seq_len": 16, "micro_batch_size": 4, "grad_accum": 1,
            "max_steps": 6, "warmup_steps": 2, "lr": 3e-3, "l1_coeff": 1e-2, "log_every": 1, "eval_every": 3,
            "eval_batches": 2, "ckpt_every": 2, "device": "cpu", "progress": False, "dead_window_tokens": 64}
    sets.update(over)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def read_log(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "train_log.jsonl").read_text().splitlines()]


def comparable(lines: list[dict]) -> list[dict]:
    """A log without what legitimately differs between runs: timing fields, 'resume' event lines, and the
    header's provenance and out_dir."""
    out = []
    for x in lines:
        if x["type"] == "resume":
            continue
        x = {k: v for k, v in x.items() if k not in TIMING}
        if x["type"] == "header":
            x = {**x, "provenance": None, "config": {k: v for k, v in x["config"].items() if k != "out_dir"}}
        out.append(x)
    return out


class Killed(Exception):
    pass


def die_at(monkeypatch, obj, name: str, when=lambda *a, **k: True) -> None:
    """Make obj.name raise Killed (a crash at that point) when `when(*args)` holds."""
    real = getattr(obj, name)

    def dying(*a, **k):
        if when(*a, **k):
            raise Killed
        return real(*a, **k)

    monkeypatch.setattr(obj, name, dying)


# ----------------------------------------------------------------------------- 1. one writer per run dir
def test_lock_refusal_names_a_holder_caught_before_it_wrote_its_pid(tmp_path) -> None:
    """The holder takes the lock, then writes its pid: a second process refused in between waits for the pid
    (the race that once made test_two_processes_on_one_run_dir's refusal read 'a process whose pid is not
    recorded')."""
    import fcntl
    import threading

    from sfl.experiments.trainer.rundir import LOCK_NAME

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing written yet
    late = threading.Timer(0.2, lambda: os.pwrite(fd, json.dumps({"pid": 4242}).encode() + b"\n", 0))
    late.start()
    try:
        with pytest.raises(RunDirBusy, match=r"\(pid 4242\b.*kill 4242"):
            RunLock(out).acquire()
    finally:
        late.join()
        os.close(fd)


def test_lock_refuses_second_writer_naming_the_holder(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from sfl.experiments.trainer.rundir import RunLock; "
                               f"RunLock({str(out)!r}).acquire(); print('locked', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for resume in (False, True):
            with pytest.raises(RunDirBusy, match=rf"pid {holder.pid}\b.*--resume"):
                train_mod.train(cfg_for(data_dir, out), resume=resume)
        assert not (out / "train_log.jsonl").exists()  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
    train_mod.train(cfg_for(data_dir, out, max_steps=2, eval_every=0))  # the lock dies with its holder
    # in one process, train() releases the lock when it returns (a later train() in the same process works)
    assert train_mod.train(cfg_for(data_dir, out, max_steps=2, eval_every=0), resume=True)["step"] == 2


def _cli(data_dir: Path, out: Path, *extra: str) -> list[str]:
    sets = {"data_dir": data_dir, "out_dir": out, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "seq_len": 16, "micro_batch_size": 4, "max_steps": 40, "warmup_steps": 2,
            "ckpt_every": 5, "eval_every": 10, "eval_batches": 1, "device": "cpu", "progress": "false",
            "log_every": 1}
    args = [sys.executable, "-m", "sfl.experiments.trainer.train"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return args + list(extra)


def test_two_processes_on_one_run_dir(data_dir, tmp_path) -> None:
    """Two `--resume` runs started at the same instant on one fresh out_dir (before the lock: both passed the
    checks, one unlinked or swapped the log under the other, lines and the final line were lost). Now exactly one
    trains; the other is refused naming the holder, or, if it got there after the first had finished, finds the
    run finished; the log is whole (every step once, one final line) and the checkpoint loads."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(_cli(data_dir, out, "--resume"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    res = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stderr.close()
    trained = [err for rc, err in res if rc == 0 and "already finished" not in err]
    others = [err for rc, err in res if rc != 0 or "already finished" in err]
    assert len(trained) == 1 and len(others) == 1, res
    assert "in use by another training process (pid" in others[0] or "already finished at step 40" in others[0], res
    lines = read_log(out)
    assert [x["step"] for x in lines if x["type"] == "step"] == list(range(1, 41))
    assert [x["type"] for x in lines].count("header") == 1
    assert [x["type"] for x in lines].count("final") == 1 and lines[-1]["type"] == "final"
    assert load_checkpoint(find_latest(out))["step"] == 40


def test_temp_files_belong_to_their_process(data_dir, tmp_path) -> None:
    # another process's temp dir is not touched by a save (before: every .tmp-* was deleted, and a second
    # process on the run dir died with FileNotFoundError)
    other = tmp_path / "x" / "checkpoints" / ".tmp-step_0000009.1"
    other.mkdir(parents=True)
    save_checkpoint(tmp_path / "x", 3, {"step": 3})
    assert other.is_dir()
    out = tmp_path / "run"
    train_mod.train(cfg_for(data_dir, out, max_steps=2, eval_every=0))
    root = out / "checkpoints"
    # at start-up (under the lock) leftovers of other processes are removed: a 13 MB .tmp-final, a torn
    # checkpoint temp dir, a temp log and latest.json
    leftovers = [out / ".tmp-final.999999", root / ".tmp-step_0000004.999999", out / ".tmp-train_log.jsonl.999999",
                 root / ".tmp-latest.json.999999"]
    leftovers[0].mkdir()
    (leftovers[0] / "model.safetensors").write_bytes(b"x" * 1000)
    leftovers[1].mkdir()
    leftovers[2].write_text("{}\n")
    leftovers[3].write_text("{}")
    train_mod.train(cfg_for(data_dir, out, max_steps=4, eval_every=0), resume=True)
    assert not [p for p in leftovers if p.exists()]


# ----------------------------------------------------------------------------- 2. start-up validation
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_mlp_impl_without_gpu_refused_at_startup(data_dir, tmp_path) -> None:
    out = tmp_path / "run"
    cfg = cfg_for(data_dir, out, mlp_impl="cuda", device="auto", intermediate_size=256)
    with pytest.raises(ConfigError, match="mlp_impl='cuda' needs a CUDA GPU.*auto resolved to cpu"):
        train_mod.train(cfg)
    assert not out.exists()  # nothing trained, nothing written: the out_dir is not 'already holding a run'
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        train_mod.main(["--set", "mlp_impl=cuda", "--set", f"out_dir={out}", "--set", f"data_dir={data_dir}"])


def test_disk_space_checked_before_step_one(data_dir, tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 10_000)
    with pytest.raises(ConfigError, match=r"MiB free.*needs about"):
        train_mod.train(cfg_for(data_dir, out))
    assert find_latest(out) is None and not (out / "train_log.jsonl").exists()


def test_final_checkpoint_saved_before_final_eval(data_dir, tmp_path, monkeypatch) -> None:
    """The final evaluation fails: the training is kept, and --resume evaluates and finishes without
    retraining; the log equals an uninterrupted run's."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full, ckpt_every=4, eval_every=4))
    calls = []
    real = train_mod.evaluate

    def eval_failing_at_end(*args):
        calls.append(1)
        if len(calls) == 2:  # step 4 periodic eval, then the final one at step 6
            raise Killed
        return real(*args)

    monkeypatch.setattr(train_mod, "evaluate", eval_failing_at_end)
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, cut, ckpt_every=4, eval_every=4))
    assert find_latest(cut).name == "step_0000006"
    monkeypatch.setattr(train_mod, "evaluate", real)
    train_mod.train(cfg_for(data_dir, cut, ckpt_every=4, eval_every=4), resume=True)
    assert comparable(read_log(cut)) == comparable(read_log(full))


def test_val_split_too_small_is_a_clear_error(tmp_path) -> None:
    d = make_data(tmp_path / "data", val_tokens=10)
    with pytest.raises(DataError, match=r"val_000\.bin.*not one window.*lower seq_len"):
        train_mod.train(cfg_for(d, tmp_path / "run"))


# ----------------------------------------------------------------------------- 3. data verified where used
def _overwrite_in_vocab(path: Path) -> None:
    n = path.stat().st_size // 2
    np.random.default_rng(1).integers(0, VOCAB, n).astype(np.uint16).tofile(path)


def test_changed_shard_refused_at_start_and_on_resume(tmp_path) -> None:
    d = make_data(tmp_path / "data")
    out = tmp_path / "run"
    train_mod.train(cfg_for(d, out, max_steps=2, eval_every=0))
    _overwrite_in_vocab(d / "tokens" / "train_001.bin")  # same size, in-vocabulary ids: only a checksum sees it
    rebuild = r"python -m sfl\.data\.prepare --only tokens"
    with pytest.raises(DataError, match=rf"train_001\.bin changed since it was prepared.*{rebuild}"):
        train_mod.train(cfg_for(d, out, max_steps=4, eval_every=0), resume=True)
    with pytest.raises(DataError, match=rf"train_001\.bin changed since it was prepared.*{rebuild}"):
        train_mod.train(cfg_for(d, tmp_path / "fresh", max_steps=2, eval_every=0))
    # data prepared before checksums were recorded: the checkpoint's fingerprint still catches the change
    old = make_data(tmp_path / "old", checksums=False)
    out2 = tmp_path / "run2"
    train_mod.train(cfg_for(old, out2, max_steps=2, eval_every=0))
    _overwrite_in_vocab(old / "tokens" / "train_000.bin")
    with pytest.raises(DataError, match=rf"--resume.*train_000\.bin changed since the checkpoint.*{rebuild}"):
        train_mod.train(cfg_for(old, out2, max_steps=4, eval_every=0), resume=True)


@pytest.mark.parametrize("case, pattern", [
    ("meta_json", r"meta\.json is not valid JSON.*python -m sfl\.data\.prepare --only tokens"),
    ("meta_keys", r"meta\.json lacks train.*python -m sfl\.data\.prepare --only tokens"),
    ("truncated", r"train_000\.bin has 11999 bytes but meta\.json records 6000.*truncated.*--only tokens"),
    ("random_bytes", r"train_001\.bin.*token id \d+ >= vocab_size 61.*--only tokens"),
    ("missing", r"val_000\.bin \(listed in meta\.json\) is missing.*--only tokens"),
])
def test_malformed_data_messages(tmp_path, case, pattern) -> None:
    d = make_data(tmp_path / "data", checksums=case != "random_bytes")
    tok = d / "tokens"
    if case == "meta_json":
        (tok / "meta.json").write_text((tok / "meta.json").read_text()[:-7])
    elif case == "meta_keys":
        meta = json.loads((tok / "meta.json").read_text())
        del meta["train"]
        (tok / "meta.json").write_text(json.dumps(meta))
    elif case == "truncated":
        (tok / "train_000.bin").write_bytes((tok / "train_000.bin").read_bytes()[:-1])
    elif case == "random_bytes":
        (tok / "train_001.bin").write_bytes(np.random.default_rng(0).bytes(6000))
    elif case == "missing":
        (tok / "val_000.bin").unlink()
    with pytest.raises(DataError, match=pattern):
        train_mod.train(cfg_for(d, tmp_path / "run", max_steps=2))
    with pytest.raises(SystemExit, match="^error: .*" + pattern):  # the CLI prints it, no traceback
        train_mod.main(["--set", f"data_dir={d}", "--set", f"out_dir={tmp_path / 'run2'}", "--set", "device=cpu"])


def test_batches_are_range_checked(data_dir) -> None:
    data = TokenData(data_dir / "tokens", 16)
    data.train[0] = np.full_like(np.asarray(data.train[0]), VOCAB + 3)  # a shard changed under a running run
    with pytest.raises(DataError, match=r"token id 64 >= vocab_size 61"):
        for step in range(50):
            data.train_batch(0, step, 0, 8)


def test_eval_rows_checked_against_manifest(tmp_path) -> None:
    from sfl import data as data_pkg
    from sfl.data.lm_tasks import EvalDataError, check_eval_files
    from sfl.data.manifest import Manifest

    root = tmp_path / "d"
    ev = root / "eval"
    ev.mkdir(parents=True)
    rows = [{"id": str(i), "question": "q", "choices": ["a", "b"], "gold": 0} for i in range(40)]
    f = ev / "piqa.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    Manifest(root).record("eval", 1, {}, [f], info={"tasks": {"piqa": {"n": 40}}})
    check_eval_files(ev, ["piqa"])
    f.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))  # cut to 10 lines
    with pytest.raises(EvalDataError, match=r"piqa\.jsonl has 10 rows but .*manifest\.json records 40.*--only eval"):
        check_eval_files(ev, ["piqa"])
    from sfl.experiments.trainer.evaluate import main as eval_main
    with pytest.raises(SystemExit, match=r"error: .*piqa\.jsonl has 10 rows"):
        eval_main(["--model", str(tmp_path / "nomodel"), "--tasks", "piqa", "--out", str(tmp_path / "o"),
                   "--eval-dir", str(ev)])
    # a malformed manifest names itself and the fix, in evaluate, data.require and data.prepare
    (root / "manifest.json").write_text('{"format": 1, "steps": {')
    with pytest.raises(data_pkg.DataNotPrepared, match=r"manifest\.json is not a valid data manifest.*Delete it"):
        check_eval_files(ev, ["piqa"])
    with pytest.raises(data_pkg.DataNotPrepared, match=r"manifest\.json is not a valid data manifest"):
        data_pkg.require("eval", root)
    from sfl.data import prepare
    assert prepare.main(["--data-dir", str(root), "--only", "eval"]) == 2


# ----------------------------------------------------------------------------- 4. resume exactness
def test_reinit_counter_survives_a_kill(data_dir, tmp_path, monkeypatch) -> None:
    """Step lines carry reinit_neurons summed since the previous line: a checkpoint between two lines must keep the
    running count (before: after a kill in step 2, the resumed step-2 line lost the 16 rows moved in step 1)."""
    real_build = train_mod.build_model

    def build_with_dead_rows(*a, **kw):
        model = real_build(*a, **kw)
        with torch.no_grad():
            for mlp in model.sparse_mlps():
                mlp.gate_proj.weight[:8] = 0.0
        return model

    monkeypatch.setattr(train_mod, "build_model", build_with_dead_rows)
    # the 16 zeroed rows are moved after step 1; the checkpoint of step 1 lies before the line of step 2
    over = dict(dead_reinit_lambda=0.1, log_every=2, ckpt_every=1, eval_every=0)
    train_mod.train(cfg_for(data_dir, tmp_path / "full", **over))
    die_at(monkeypatch, TokenData, "train_batch", when=lambda self, seed, step, rank, n: step == 1)
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, tmp_path / "cut", **over))
    monkeypatch.setattr(TokenData, "train_batch", _real_train_batch)
    train_mod.train(cfg_for(data_dir, tmp_path / "cut", **over), resume=True)
    full, cut = comparable(read_log(tmp_path / "full")), comparable(read_log(tmp_path / "cut"))
    assert [x["reinit_neurons"] for x in full if x["type"] == "step"][0] >= 16
    assert cut == full


def test_finished_run_resume_is_a_noop(data_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    final = train_mod.train(cfg_for(data_dir, out))
    before = (out / "train_log.jsonl").read_bytes()
    capsys.readouterr()
    assert train_mod.train(cfg_for(data_dir, out), resume=True) == final
    assert "already finished at step 6" in capsys.readouterr().err
    assert (out / "train_log.jsonl").read_bytes() == before
    assert not list(out.glob(".tmp-*"))
    with pytest.raises(ConfigError, match="lr"):  # still a resume: a changed config is refused
        train_mod.train(cfg_for(data_dir, out, lr=1e-2), resume=True)


def test_kill_between_final_eval_and_final_line(data_dir, tmp_path, monkeypatch) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full))
    die_at(monkeypatch, train_mod, "save_final")  # after the final eval line, before the final line
    with pytest.raises(Killed):
        train_mod.train(cfg_for(data_dir, cut))
    assert read_log(cut)[-1]["type"] == "eval"
    monkeypatch.undo()
    train_mod.train(cfg_for(data_dir, cut), resume=True)
    assert comparable(read_log(cut)) == comparable(read_log(full))  # one final eval line, one final line


def test_disk_full_reported_with_old_checkpoint_intact(data_dir, tmp_path, monkeypatch) -> None:
    """A real ENOSPC (writes to /dev/full) while saving step 4: reported as such, no temp dir left, step 2 intact,
    and --resume finishes the run with the log of an uninterrupted one."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    full, cut = tmp_path / "full", tmp_path / "cut"
    train_mod.train(cfg_for(data_dir, full))

    def open_full_disk(path, mode="r", *a, **k):
        if Path(path).name == "state.pt" and "step_0000004" in str(path) and "w" in mode:
            return builtins.open("/dev/full", mode, *a, **k)
        return builtins.open(path, mode, *a, **k)

    monkeypatch.setattr(ckpt_mod, "open", open_full_disk, raising=False)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device \(errno ENOSPC\).*step_0000004.*"
                                                   r"step_0000002 is intact.*--resume"):
        train_mod.train(cfg_for(data_dir, cut))
    assert find_latest(cut).name == "step_0000002"
    assert not list((cut / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    train_mod.train(cfg_for(data_dir, cut), resume=True)
    assert comparable(read_log(cut)) == comparable(read_log(full))
    a, b = load_checkpoint(find_latest(full)), load_checkpoint(find_latest(cut))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_disk_full_in_dcp_shards_reported_with_old_checkpoint_intact(data_dir, tmp_path, monkeypatch) -> None:
    """ENOSPC while torch.distributed.checkpoint writes the model/optimizer shards of step 4 (dcp/): the same
    CheckpointWriteError as for state.pt, no temp dir left, step 2 intact."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    from torch.distributed.checkpoint.filesystem import FileSystem
    real = FileSystem.create_stream

    def full_disk_stream(self, path, mode):
        if "step_0000004" in str(path) and "w" in mode:
            return real(self, "/dev/full", mode)
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_disk_stream)
    cut = tmp_path / "cut"
    with pytest.raises(CheckpointWriteError, match=r"no space left on device \(errno ENOSPC\).*step_0000004.*"
                                                   r"step_0000002 is intact.*--resume"):
        train_mod.train(cfg_for(data_dir, cut))
    assert find_latest(cut).name == "step_0000002"
    assert not list((cut / "checkpoints").glob(".tmp-*"))
