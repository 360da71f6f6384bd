"""The real lm-eval CLI on one of our checkpoints, as a user runs it: from a directory outside the repo, offline,
with the task YAMLs written by `python -m sfl.data.lm_tasks write-tasks` and the checkpoint's own modelling code
(auto_map, trust_remote_code); the scores equal experiments/trainer/evaluate.py's on the same data (one YAML writer)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sfl.experiments.trainer.evaluate import main as evaluate_main  # noqa: E402
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM  # noqa: E402

PIQA = [
    {"id": str(i), "question": q, "choices": c, "gold": g}
    for i, (q, c, g) in enumerate([
        ("How do you open a jar?", ["Twist the lid.", "Paint the lid."], 0),
        ("How do you cool tea?", ["Boil it longer.", "Let it stand."], 1),
        ("How to dry a shirt?", ["Hang it in the sun.", "Put it in water."], 0),
        ("How to light a room?", ["Close the curtains.", "Switch on a lamp."], 1),
        ("How to keep bread fresh?", ["Seal it in a bag.", "Leave it open."], 0),
        ("How to stop a door squeaking?", ["Oil the hinge.", "Slam it."], 0),
    ])
]
LIMIT = 4


def _tiny_checkpoint(tmp: Path) -> Path:
    """A tiny sparse_llama checkpoint with its own byte-level BPE tokenizer, saved by save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([json.dumps(r) for r in PIQA], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    cfg = SparseLlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    out = tmp / "ckpt"
    SparseLlamaForCausalLM(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_lm_eval_cli_scores_a_checkpoint_from_another_directory(tmp_path):
    ckpt = _tiny_checkpoint(tmp_path)
    eval_dir = tmp_path / "data" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PIQA))
    work = tmp_path / "elsewhere"  # not the repo: nothing may depend on the working directory
    work.mkdir()
    # PYTHONPATH stands in for `pip install -e .` (tests/test_package.py covers the install): the checkpoint's
    # modelling code imports sfl.kernels lazily for mlp_impl reference/cuda, so transformers asks for `sfl`
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HF_MODULES_CACHE=str(tmp_path / "hf_modules"), TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))

    # 1. the task YAMLs, resolved to this eval dir
    r = subprocess.run([sys.executable, "-m", "sfl.data.lm_tasks", "write-tasks", "--out", "tasks", "--eval-dir",
                        str(eval_dir), "--tasks", "piqa"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    yaml_text = (work / "tasks" / "sfl_piqa.yaml").read_text()
    assert "@SFL_EVAL_DIR@" not in yaml_text and str(eval_dir.resolve() / "piqa.jsonl") in yaml_text
    include = r.stdout.split("--include_path ")[1].split()[0]  # the path it prints for the lm_eval command
    assert Path(include).is_absolute() and Path(include) == (work / "tasks").resolve()
    work = tmp_path / "yet_another"  # the printed command works from any directory
    work.mkdir()

    # 2. the lm-eval CLI: the checkpoint carries its modelling code (auto_map), nothing registers it here
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={ckpt},trust_remote_code=True,dtype=float32", "--include_path", include,
           "--tasks", "sfl_piqa", "--limit", str(LIMIT), "--device", "cpu", "--batch_size", "4",
           "--output_path", "out"]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    found = sorted((work / "out").rglob("results_*.json"))
    assert len(found) == 1, found
    res = json.loads(found[0].read_text())
    piqa = res["results"]["sfl_piqa"]
    assert res["n-samples"]["sfl_piqa"]["effective"] == LIMIT
    for k in ("acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"):
        assert isinstance(piqa[k], float), (k, piqa[k])
    assert 0.0 <= piqa["acc,none"] <= 1.0 and piqa["acc_stderr,none"] >= 0.0
    p = piqa["acc,none"]  # lm-eval's closed-form standard error of a mean of LIMIT 0/1 scores
    assert piqa["acc_stderr,none"] == pytest.approx((p * (1 - p) / (LIMIT - 1)) ** 0.5)

    # 3. experiments/trainer/evaluate.py (same YAML writer, our model class in-process) scores it the same
    assert evaluate_main(["--model", str(ckpt), "--tasks", "piqa", "--limit", str(LIMIT), "--device", "cpu",
                          "--eval-dir", str(eval_dir), "--out", str(tmp_path / "ours")]) == 0
    ours = json.loads((tmp_path / "ours" / "eval.json").read_text())["tasks"]["piqa"]
    assert (ours["acc"], ours["acc_norm"]) == (piqa["acc,none"], piqa["acc_norm,none"])


def test_write_tasks_returns_an_absolute_include_dir(tmp_path, monkeypatch):
    """`prepare` and `write-tasks` print the include dir write_tasks returns: absolute, whatever dest was given as."""
    from sfl.data.lm_tasks import write_tasks

    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PIQA))
    monkeypatch.chdir(tmp_path)
    out = write_tasks(Path("eval"), Path("tasks"), ["piqa"])
    assert out.is_absolute() and out == (tmp_path / "tasks").resolve()
    assert f"{eval_dir.resolve()}/piqa.jsonl" in (out / "sfl_piqa.yaml").read_text()


def test_quickstart_readme_loading_example_runs_without_a_prompt(tmp_path):
    """The Python example of experiments/quickstart/README.md, on a tiny checkpoint, from another directory with no
    terminal: it loads the tokenizer and model and generates without asking to run remote code."""
    text = (REPO / "experiments" / "quickstart" / "README.md").read_text()
    code = text.split("```python\n")[1].split("```")[0]
    assert "runs/quickstart/final" in code and "trust_remote_code=True" not in code
    ckpt = _tiny_checkpoint(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
               PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code.replace("runs/quickstart/final", str(ckpt))], cwd=tmp_path, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[y/N]" not in r.stdout + r.stderr and r.stdout.strip()
