"""Checkpoints are HF-native: save_pretrained writes `auto_map` + the modelling code, so a fresh process in
another directory loads them with AutoModelForCausalLM(trust_remote_code=True) and generates; lm-eval sees a
causal LM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM  # noqa: E402


def _tiny_saved(tmp: Path, intermediate_size: int = 64) -> tuple[SparseLlamaForCausalLM, Path]:
    cfg = SparseLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = SparseLlamaForCausalLM(cfg).eval()
    out = tmp / "ckpt"
    model.save_pretrained(out)
    return model, out


def _tiny(tmp: Path) -> Path:
    return _tiny_saved(tmp)[1]


def test_saved_config_has_auto_map_and_code(tmp_path):
    out = _tiny(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoConfig"].endswith("configuration_sparse_llama.SparseLlamaConfig")
    assert cfg["auto_map"]["AutoModelForCausalLM"].endswith("modeling_sparse_llama.SparseLlamaForCausalLM")
    for f in ("modeling_sparse_llama.py", "configuration_sparse_llama.py", "sparsity.py"):
        assert (out / f).is_file(), f


def test_lm_eval_sees_a_causal_lm():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[SparseLlamaConfig.model_type] == "SparseLlamaForCausalLM"


def test_fresh_process_elsewhere_loads_and_generates(tmp_path):
    out = _tiny(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = SparseLlamaForCausalLM.from_pretrained(out).eval()(ids).logits[0, -1].argmax().item()
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
            "assert 'sfl.models' not in sys.modules, 'the checkpoint code must load without importing sfl.models'\n"
            "g = m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, do_sample=False)\n"
            "print(type(m).__name__, g.shape[1], g[0, 4].item())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO))  # stands in for `pip install -e .` (tests/test_package.py covers that)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    name, length, first = r.stdout.split()
    assert (name, int(length), int(first)) == ("SparseLlamaForCausalLM", 7, want)


def test_checkpoint_runs_dense_and_reference_without_the_project(tmp_path):
    """A checkpoint's own code (auto_map) loads and runs with only torch and transformers: in a fresh process where
    `sfl` cannot be imported, the dense forward equals the project's, and mlp_impl='reference' runs (the
    reference travels beside the modelling code); 'cuda' says what to install."""
    model, out = _tiny_saved(tmp_path, intermediate_size=256)  # a whole TwELL tile, for mlp_impl='reference'
    assert (out / "twell_reference.py").is_file() and (out / "kernel_config.py").is_file()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids).logits[0, -1].tolist()
    code = ("import json, sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            "try:\n    import sfl\n    sys.exit('sfl is importable: the test needs an environment without it')\n"
            "except ModuleNotFoundError:\n    pass\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
            "with torch.no_grad():\n"
            "    dense = m(torch.tensor([[1, 2, 3, 4]])).logits[0, -1].tolist()\n"
            "    m.set_mlp_impl('reference')\n"
            "    ref = m(torch.tensor([[1, 2, 3, 4]])).logits[0, -1].tolist()\n"
            "try:\n    m.set_mlp_impl('cuda')\n    m(torch.tensor([[1, 2]]))\n    cuda = 'ran'\n"
            "except ValueError as e:\n    cuda = str(e)\n"
            "print(json.dumps([dense, ref, cuda]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-1000:]
    dense, ref, cuda = json.loads(r.stdout.splitlines()[-1])
    torch.testing.assert_close(torch.tensor(dense), torch.tensor(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(ref), torch.tensor(want), rtol=2e-2, atol=2e-3)
    assert "pip install" in cuda


def test_from_pretrained_takes_our_kernel_config(tmp_path):
    """Our kernel_config (a dict or KernelConfig) given to from_pretrained, directly or through the Auto class, sets
    the model's kernels; transformers' own from_pretrained argument of that name (hub kernels) never sees it."""
    from transformers import AutoModelForCausalLM

    from sfl.models.configuration_sparse_llama import KernelConfig

    path = _tiny(tmp_path)
    for load in (SparseLlamaForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        for given in ({"mode": "sparse", "slots": 16}, KernelConfig(mode="sparse", slots=16)):
            model = load(path, kernel_config=given)
            assert model.config.get_kernel_config() == KernelConfig(mode="sparse", slots=16)
            assert all(m.kernel_config.slots == 16 for m in model.sparse_mlps())
