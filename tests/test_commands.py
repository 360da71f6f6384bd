"""The user-facing commands work as written: `train --help` lists every config key with its default, fast (before
torch loads); the paired_eval example compares two committed eval dirs that hold per-document scores; bin/sfl runs
a command in the project's environment from another directory."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sfl.experiments.trainer.config import DEFAULTS  # noqa: E402
from sfl.experiments.trainer.paired_eval import main as paired_eval_main  # noqa: E402

HELP_SECONDS = 10  # ~0.2 s warm; loose for a loaded CI machine (importing torch + transformers first took ~15 s)


def test_train_help_lists_every_config_key_with_its_default_quickly():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "sfl.experiments.trainer.train", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    assert elapsed < HELP_SECONDS, f"--help took {elapsed:.1f} s"
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported  # the reason it is fast, checked directly
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) +(.+?)  ", r.stdout, re.M)}
    assert set(DEFAULTS) <= set(lines), sorted(set(DEFAULTS) - set(lines))
    for key, default in DEFAULTS.items():
        assert yaml.safe_load(lines[key]) == default, (key, lines[key], default)


def test_train_still_parses_its_arguments():
    from sfl.experiments.trainer.config import arg_parser

    a = arg_parser("x").parse_args(["--config", "c.yaml", "--set", "l1_coeff=1", "--set", "seed=2", "--resume"])
    assert (a.config, a.set, a.resume) == ("c.yaml", ["l1_coeff=1", "seed=2"], True)


def test_paired_eval_example_has_per_document_scores(capsys):
    """The example in experiments/quickstart/README.md: two committed eval dirs with per-document scores."""
    text = (REPO / "experiments" / "quickstart" / "README.md").read_text()
    cmd = text.split("python -m sfl.experiments.trainer.paired_eval ")[1].split("#")[0].replace("\\\n", " ").split()
    assert len(cmd) == 2 and all((REPO / d / "eval.json").is_file() for d in cmd), cmd
    assert paired_eval_main([str(REPO / d) for d in cmd] + ["--n-boot", "200"]) == 0
    assert re.search(r"^mean\s+\d+", capsys.readouterr().out, re.M)


def test_bin_sfl_runs_a_command_in_the_project_environment_from_anywhere(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(REPO / "bin" / "sfl"), "python", "-c", "import sfl, sys; print(sfl.__path__[-1])"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip().splitlines()[-1]).resolve() == REPO.resolve()
