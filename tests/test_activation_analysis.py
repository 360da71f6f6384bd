"""experiments/activation_analysis/analyze.py on the CPU: a tiny sparse_llama checkpoint over synthetic held-out
tokens writes the four logs with their fields, counts consistent with the tokens it read, and a rerun of the same
--name replaces its rows instead of adding to them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sfl.experiments.activation_analysis import analyze as aa
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM

VOCAB, SEQ = 61, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(a save_pretrained dir of a 2-layer model with 8 dead gate rows per layer, a prepared-data dir)."""
    root = tmp_path_factory.mktemp("aa")
    torch.manual_seed(0)
    model = SparseLlamaForCausalLM(SparseLlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0,
        l1_coeff=1e-3))
    with torch.no_grad():
        for mlp in model.sparse_mlps():
            mlp.gate_proj.weight[:8] = 0.0   # never fire
    model.save_pretrained(root / "model")
    tok = root / "data" / "tokens"
    tok.mkdir(parents=True)
    meta = {"vocab_size": VOCAB, "eos_id": 0, "dtype": "uint16", "train": [], "val": []}
    rng = np.random.default_rng(0)
    for name, n, split in (("train_000.bin", 2000, "train"), ("val_000.bin", 2000, "val")):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(tok / name)
        meta[split].append({"file": name, "tokens": n})
    (tok / "meta.json").write_text(json.dumps(meta))
    return root / "model", root / "data"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_analyze_writes_the_four_logs_and_replaces_a_rerun(setup, tmp_path):
    model_dir, data_dir = setup
    run = dict(tokens=8 * SEQ, seq_len=SEQ, batch=3, device="cpu", data_dir=str(data_dir), figure="fig6",
               timing=True)
    summary = aa.analyze(model_dir, "tiny", tmp_path, **run)
    n_tok = 8 * SEQ
    assert summary["n_tokens"] == n_tok and summary["l1_coeff"] == 1e-3
    assert summary["timing"] == "no CUDA device: per-layer FFN times need the TwELL kernels on a GPU"
    layers = _rows(tmp_path / "per_layer.jsonl")
    assert list(layers[0])[:8] == ["model", "l1_coeff", "layer", "nnz_mean", "nnz_max", "dead_frac", "dense_ms",
                                   "sparse_ms"]
    assert [r["layer"] for r in layers] == [0, 1] and all(r["figure"] == "fig6" and r["dense_ms"] is None
                                                          for r in layers)
    assert all(8 / 64 <= r["dead_frac"] and 0 < r["nnz_mean"] <= r["nnz_max"] <= 56 for r in layers)
    assert summary["nnz_mean"] == pytest.approx(sum(r["nnz_mean"] for r in layers) / 2)
    positions = _rows(tmp_path / "position.jsonl")
    assert [r["position"] for r in positions] == list(range(SEQ)) and all(r["n"] == 8 for r in positions)
    tokens = _rows(tmp_path / "tokens.jsonl")
    low = [r["nnz_mean"] for r in tokens if r["group"] == "lowest"]
    assert low == sorted(low) and len(low) == len(tokens) // 2
    assert summary["lowest"] == [r["token"] for r in tokens[:len(low)]][:8]
    neurons = _rows(tmp_path / "neurons.jsonl")
    assert all(sum(r["counts"]) == 64 and r["counts"][0] >= 8 and len(r["bin_edges"]) == len(r["counts"])
               for r in neurons)
    first = {name: (tmp_path / name).read_text() for name in ("per_layer.jsonl", "tokens.jsonl", "neurons.jsonl")}
    aa.analyze(model_dir, "tiny", tmp_path, **run)   # same name again: its rows are replaced, not added
    for name, text in first.items():
        again = _rows(tmp_path / name)
        assert len(again) == len(text.splitlines())
        strip = [{k: v for k, v in r.items() if k != "provenance"} for r in again]
        assert strip == [{k: v for k, v in json.loads(line).items() if k != "provenance"} for line in text.splitlines()]
