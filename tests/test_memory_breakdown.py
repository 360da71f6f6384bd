"""experiments/speed/memory_breakdown.py on a CPU: saved bytes by owner, dense vs the sparse training op."""
from __future__ import annotations

import torch

from sfl.experiments.speed.memory_breakdown import CATEGORIES, measure
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM


def test_forced_sparse_keeps_less_for_backward_than_dense():
    torch.manual_seed(0)
    model = SparseLlamaForCausalLM(SparseLlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, l1_coeff=1e-3))
    with torch.no_grad():
        for mlp in model.sparse_mlps():
            mlp.gate_proj.weight[4:] = 0.0   # 4 of 512 neurons can fire: ~0.4% activity at most
    ids = torch.randint(0, 64, (2, 65))
    rows = {r["side"]: r for r in measure(model, ids, warmup=0)}
    assert set(rows) == {"dense", "dense L1=0", "sparse auto", "sparse forced"}
    dense, forced = rows["dense"], rows["sparse forced"]
    assert forced["ffn_paths"] == ["sparse", "sparse"] and dense["ffn_paths"] == ["dense", "dense"]
    # the FFN keeps the ELL of ~4 entries per token instead of [tokens, 512] activations
    assert 0 < forced["saved_ffn_bytes"] < dense["saved_ffn_bytes"] / 2
    for cat in ("attention", "norm", "embedding", "lm_head+loss"):   # the rest of the model is the same
        assert forced[f"saved_{cat}_bytes"] == dense[f"saved_{cat}_bytes"], cat
    assert min(dense[f"saved_{c}_bytes"] for c in ("attention", "norm", "lm_head+loss")) > 0
    for r in rows.values():
        assert r["saved_activation_bytes"] == sum(r[f"saved_{c}_bytes"] for c in CATEGORIES if c != "parameters")
