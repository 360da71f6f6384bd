"""Fault injection: a tiny CPU run is SIGKILLed at random moments (mid-step, mid-checkpoint, mid-eval,
mid-final-save...) and resumed each time; the finished run's JSONL log equals an uninterrupted run's except timing
fields (and the 'resume' event lines), and its final weights are torch.equal to the uninterrupted run's."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_run_safety import REPO, comparable, make_data, read_log  # noqa: E402

from sfl.experiments.trainer.checkpoint import find_latest, load_checkpoint  # noqa: E402

N_KILLS = 3
SETS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "seq_len": 16,
        "micro_batch_size": 4, "grad_accum": 2, "max_steps": 40, "warmup_steps": 2, "l1_coeff": 0.01,
        "dead_reinit_lambda": 0.1, "dead_window_tokens": 64, "log_every": 3, "eval_every": 5, "eval_batches": 2,
        "ckpt_every": 2, "device": "cpu", "progress": "false"}


def _start(data_dir: Path, out: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "sfl.experiments.trainer.train", "--resume", "--set", f"data_dir={data_dir}",
            "--set", f"out_dir={out}"]
    for k, v in SETS.items():
        args += ["--set", f"{k}={v}"]
    # one thread: the same float reduction order in every process
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _log_size(out: Path) -> int:
    try:
        return (out / "train_log.jsonl").stat().st_size
    except FileNotFoundError:
        return 0


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(out / "final" / "model.safetensors")


def test_random_sigkills_then_resume_equal_uninterrupted(tmp_path) -> None:
    data_dir = make_data(tmp_path / "data")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    p = _start(data_dir, ref)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    p.stderr.close()

    rng = random.Random(15)
    kills = 0
    for _ in range(N_KILLS):
        p = _start(data_dir, cut)
        size0, deadline = _log_size(cut), time.time() + 120
        while p.poll() is None and _log_size(cut) <= size0 and time.time() < deadline:
            time.sleep(0.01)  # until this process writes: past its start-up, inside the training
        time.sleep(rng.uniform(0.0, 0.6))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        p.stderr.close()
    assert kills >= 1  # a run too fast to be killed would test nothing
    p = _start(data_dir, cut)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    p.stderr.close()

    got, want = read_log(cut), read_log(ref)
    assert sum(x["type"] == "resume" for x in got) >= 1
    assert comparable(got) == comparable(want)
    a, b = _final_weights(ref), _final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = load_checkpoint(find_latest(ref)), load_checkpoint(find_latest(cut))
    assert ca["step"] == cb["step"] == 40
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    assert not list(cut.glob(".tmp-*")) and not list((cut / "checkpoints").glob(".tmp-*"))
