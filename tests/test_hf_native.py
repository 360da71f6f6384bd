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


def _tiny(tmp: Path) -> Path:
    cfg = SparseLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = SparseLlamaForCausalLM(cfg).eval()
    out = tmp / "ckpt"
    model.save_pretrained(out)
    return out


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
