"""SparseLlama model: forward/backward, L1 term, sparsity statistics, mlp_impl paths, HF round trips,
generation and ReLU-fication. CPU only, tiny shapes."""
from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sfl import models  # noqa: E402  (registers the Auto classes)
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM, SparseLlamaMLP  # noqa: E402
from sfl.models.sparsity import l1_penalty, nnz_per_token, update_tokens_since_fire  # noqa: E402

VOCAB = 97


def tiny_config(**kw) -> SparseLlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    base.update(kw)
    return SparseLlamaConfig(**base)


def tiny_model(seed: int = 0, **kw) -> SparseLlamaForCausalLM:
    torch.manual_seed(seed)
    return SparseLlamaForCausalLM(tiny_config(**kw))


def capture_mlp_inputs(model: SparseLlamaForCausalLM) -> tuple[list[torch.Tensor], list]:
    seen: list[torch.Tensor] = []
    hooks = [mlp.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach().clone()))
             for mlp in model.sparse_mlps()]
    return seen, hooks


def manual_h(mlp: SparseLlamaMLP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    if mlp.gated:
        a = torch.relu(x2 @ mlp.gate_proj.weight.T)
        return a, a * (x2 @ mlp.up_proj.weight.T)
    a = torch.relu(x2 @ mlp.up_proj.weight.T)
    return a, a


# ----------------------------------------------------------------------------- forward / backward
@pytest.mark.parametrize("gated", [True, False])
def test_forward_backward_finite_grads(gated: bool) -> None:
    model = tiny_model(gated_mlp=gated, l1_coeff=1e-2)
    assert hasattr(model.model.layers[0].mlp, "gate_proj") == gated
    x = torch.randint(0, VOCAB, (3, 12))
    out = model(input_ids=x, labels=x)
    assert out.logits.shape == (3, 12, VOCAB)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_relu_mlp_matches_formula() -> None:
    for gated in (True, False):
        model = tiny_model(gated_mlp=gated)
        mlp = model.model.layers[0].mlp
        x = torch.randn(2, 5, 32)
        _, h = manual_h(mlp, x)
        want = (h @ mlp.down_proj.weight.T).reshape(2, 5, 32)
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- L1
@pytest.mark.parametrize("gated", [True, False])
def test_l1_matches_hand_computation_and_reductions(gated: bool) -> None:
    coeff = 0.37
    x = torch.randint(0, VOCAB, (2, 9))
    values = {}
    for red in ("mean", "sum"):
        model = tiny_model(seed=1, gated_mlp=gated, l1_coeff=coeff, l1_reduction=red)
        seen, hooks = capture_mlp_inputs(model)
        out = model(input_ids=x, labels=x)
        for h_ in hooks:
            h_.remove()
        per_layer = []
        for mlp, xin in zip(model.sparse_mlps(), seen):
            _, h = manual_h(mlp, xin)
            per_layer.append(h.abs().mean() if red == "mean" else h.abs().sum(-1).mean())
        want = torch.stack(per_layer).mean()
        torch.testing.assert_close(out.l1, want, rtol=1e-5, atol=0)
        torch.testing.assert_close(out.loss, out.ce + coeff * out.l1, rtol=1e-6, atol=0)
        assert model.last_losses["l1_coeff"] == coeff
        torch.testing.assert_close(model.last_losses["l1"], out.l1.detach())
        values[red] = out.l1.item()
    n = 64
    assert values["sum"] == pytest.approx(n * values["mean"], rel=1e-5)


def test_l1_penalty_function_and_coeff_override() -> None:
    h = torch.tensor([[1.0, -2.0, 0.0, 3.0], [0.0, 0.0, 0.5, 0.0]])
    assert l1_penalty(h, "mean").item() == pytest.approx(6.5 / 8)
    assert l1_penalty(h, "sum").item() == pytest.approx(6.5 / 2)
    with pytest.raises(ValueError, match="reduction"):
        l1_penalty(h, "max")
    model = tiny_model(l1_coeff=0.5)
    x = torch.randint(0, VOCAB, (1, 6))
    out = model(input_ids=x, labels=x, l1_coeff=0.0)
    torch.testing.assert_close(out.loss, out.ce)
    assert out.l1 is not None and out.l1 > 0
    # shift_labels (pre-shifted targets) gives the same CE as HF-style labels on the shared positions
    out_l = model(input_ids=x, labels=x)
    out_s = model(input_ids=x[:, :-1], shift_labels=x[:, 1:])
    torch.testing.assert_close(out_l.ce, out_s.ce)
    # no labels: no loss, no L1 bookkeeping
    out_n = model(input_ids=x)
    assert out_n.loss is None and out_n.l1 is None


# ----------------------------------------------------------------------------- statistics
def crafted_mlp(window: int) -> SparseLlamaMLP:
    """Non-gated MLP, K=4, N=8: neuron j fires on +x[j] (j<4) or -x[j-4] (j>=4)."""
    cfg = tiny_config(hidden_size=4, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                      gated_mlp=False, dead_window_tokens=window)
    mlp = SparseLlamaMLP(cfg)
    with torch.no_grad():
        eye = torch.eye(4)
        mlp.up_proj.weight.copy_(torch.cat([eye, -eye]))
        mlp.down_proj.weight.copy_(torch.ones(4, 8))
    mlp.reset_sparsity_stats()
    return mlp


def test_nnz_and_dead_fraction_hand_counts() -> None:
    mlp = crafted_mlp(window=3).train()
    mlp.record_per_token = True  # per-token counts are kept only on request
    block1 = torch.tensor([[1.0, 1.0, 1.0, 1.0],   # neurons 0,1,2,3
                           [1.0, -1.0, 0.0, 0.0],  # neurons 0,5
                           [0.0, 0.0, 0.0, 0.0]])  # none
    mlp(block1)
    assert mlp.last_nnz_per_token.tolist() == [4.0, 2.0, 0.0]
    assert mlp.last_nnz_per_token.dtype == torch.float32 and not mlp.last_nnz_per_token.requires_grad
    # tokens since last firing: n0 1, n1-3 2, n5 1, never-fired n4,n6,n7: 3 -> dead (>= 3)
    assert mlp.tokens_since_fire.tolist() == [1, 2, 2, 2, 3, 1, 3, 3]
    st = mlp.sparsity_stats()
    assert st["nnz_mean"] == pytest.approx(2.0) and st["nnz_max"] == 4.0 and st["dead_frac"] == pytest.approx(3 / 8)
    mlp(torch.tensor([[0.0, 0.0, -2.0, 0.0]]))  # neuron 6 fires
    assert mlp.tokens_since_fire.tolist() == [2, 3, 3, 3, 4, 2, 0, 4]
    st = mlp.sparsity_stats()
    assert st["nnz_mean"] == pytest.approx(7 / 4) and st["nnz_max"] == 4.0 and st["tokens"] == 4
    assert st["dead_frac"] == pytest.approx(5 / 8)
    # eval-mode forwards update nnz but never the dead counters
    mlp.eval()
    mlp(torch.zeros(5, 4))
    assert mlp.tokens_since_fire.tolist() == [2, 3, 3, 3, 4, 2, 0, 4]
    mlp.reset_sparsity_stats(dead_tracker=False)
    assert mlp.sparsity_stats()["tokens"] == 0
    assert mlp.tokens_since_fire.tolist() == [2, 3, 3, 3, 4, 2, 0, 4]


def test_nan_counts_as_active_and_tracker_function() -> None:
    a = torch.tensor([[0.0, float("nan"), 2.0], [0.0, 0.0, 0.0]])
    assert nnz_per_token(a).tolist() == [2.0, 0.0]
    tsf = torch.tensor([5, 0, 7])
    update_tokens_since_fire(tsf, torch.tensor([[True, False, False], [False, False, True], [False, False, False]]))
    assert tsf.tolist() == [2, 3, 1]


def test_model_sparsity_stats_aggregates() -> None:
    model = tiny_model(dead_window_tokens=10).train()
    seen, hooks = capture_mlp_inputs(model)
    x1, x2 = torch.randint(0, VOCAB, (2, 7)), torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        model(input_ids=x1)
        model(input_ids=x2)
    for h_ in hooks:
        h_.remove()
    st = model.sparsity_stats()
    L = len(model.sparse_mlps())
    means, maxes = [], []
    for i, mlp in enumerate(model.sparse_mlps()):
        counts = torch.cat([(manual_h(mlp, seen[i])[0] != 0).sum(-1), (manual_h(mlp, seen[L + i])[0] != 0).sum(-1)])
        means.append(counts.float().mean().item())
        maxes.append(counts.max().item())
    assert st["nnz_mean_per_layer"] == pytest.approx(means)
    assert st["nnz_max_per_layer"] == maxes
    assert st["nnz_mean"] == pytest.approx(sum(means) / L) and st["nnz_max"] == max(maxes)
    assert st["tokens"] == 19
    # 19 tokens seen, window 10: dead iff no firing within the last 10 tokens
    for mlp, frac in zip(model.sparse_mlps(), st["dead_frac_per_layer"]):
        assert frac == pytest.approx((mlp.tokens_since_fire >= 10).float().mean().item())
    assert st["dead_frac"] == pytest.approx(sum(st["dead_frac_per_layer"]) / L)
    after = model.sparsity_stats(reset=True)
    assert after["nnz_mean"] == st["nnz_mean"]
    assert model.sparsity_stats()["tokens"] == 0
    # the tracker is a non-persistent buffer: not in the state_dict
    assert not any("tokens_since_fire" in k for k in model.state_dict())


# ----------------------------------------------------------------------------- mlp_impl paths
def _reference_available() -> bool:
    try:
        ref = importlib.import_module("sfl.kernels.reference")
    except ImportError:
        return False
    return hasattr(ref, "gated_ffn_twell") and hasattr(ref, "nongated_ffn_twell")


@pytest.mark.skipif(not _reference_available(), reason="sfl.kernels.reference.*_ffn_twell not importable yet")
@pytest.mark.parametrize("gated", [True, False])
def test_reference_impl_matches_dense(gated: bool) -> None:
    model = tiny_model(seed=3, gated_mlp=gated, intermediate_size=512,
                       kernel_config={"tile_n": 256, "slots": 32}).eval()
    model.record_nnz_per_token(True)
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        dense = model(input_ids=x, labels=x)
        nnz_dense = [m.last_nnz_per_token.clone() for m in model.sparse_mlps()]
        model.set_mlp_impl("reference")
        ref = model(input_ids=x, labels=x)
        nnz_ref = [m.last_nnz_per_token.clone() for m in model.sparse_mlps()]
    # TwELL stores activation values in bf16 (documented): agreement to bf16 rounding, not bitwise.
    torch.testing.assert_close(ref.logits, dense.logits, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(ref.ce, dense.ce, rtol=1e-3, atol=1e-4)
    for a, b in zip(nnz_ref, nnz_dense):
        assert torch.equal(a, b)


def test_cuda_impl_trains_through_hybrid_op_like_dense(monkeypatch) -> None:
    """mlp_impl='cuda' with grad goes through kernels/train_ffn.py (its exact torch backend on CPU):
    loss, L1 and every gradient equal the dense model's; statistics and dead trackers are kept.
    The KernelConfig forces the sparse path (train_mode; auto picks dense on CPU), with an ELL narrow enough
    that some rows take the dense backup (train_width); the environment is not read."""
    pytest.importorskip("sfl.kernels.train_ffn")
    monkeypatch.setenv("SFL_TRAIN_FORCE_MODE", "dense")   # the old knobs: ignored now
    monkeypatch.setenv("SFL_TRAIN_WIDTH", "200")
    torch.manual_seed(0)
    dense = tiny_model(intermediate_size=256, l1_coeff=1e-2).train()
    sparse = tiny_model(intermediate_size=256, l1_coeff=1e-2, mlp_impl="cuda",
                        kernel_config={"train_mode": "sparse", "train_width": 96}).train()
    sparse.load_state_dict(dense.state_dict())
    dense.record_nnz_per_token(True)
    sparse.record_nnz_per_token(True)
    x = torch.randint(0, VOCAB, (2, 8))
    out_d, out_s = dense(input_ids=x, labels=x), sparse(input_ids=x, labels=x)
    assert {m._train_state.last_path for m in sparse.sparse_mlps()} == {"sparse"}
    assert any(float(m.last_nnz_per_token.max()) > 96 for m in sparse.sparse_mlps())  # backup rows exercised
    out_d.loss.backward()
    out_s.loss.backward()
    torch.testing.assert_close(out_s.loss, out_d.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_s.l1, out_d.l1, rtol=1e-5, atol=1e-7)
    for (name, pd_), (_, ps) in zip(dense.named_parameters(), sparse.named_parameters()):
        torch.testing.assert_close(ps.grad, pd_.grad, rtol=1e-4, atol=1e-6, msg=name)
    for md, ms in zip(dense.sparse_mlps(), sparse.sparse_mlps()):
        assert torch.equal(md.last_nnz_per_token, ms.last_nnz_per_token)
        assert torch.equal(md.tokens_since_fire, ms.tokens_since_fire)


def test_set_mlp_impl_validates() -> None:
    model = tiny_model(intermediate_size=64)
    with pytest.raises(ValueError, match="intermediate_size"):
        model.set_mlp_impl("reference")  # 64 is not a multiple of twell_tile_n=256
    assert model.config.mlp_impl == "dense"
    with pytest.raises(ValueError, match="mlp_impl"):
        model.set_mlp_impl("triton")


@pytest.mark.parametrize("impl", ["dense", "reference"])
def test_compiles_once_fullgraph(impl: str) -> None:
    """torch.compile(fullgraph=True) of the model in eval: one graph (no graph break: fullgraph raises on one), no
    recompile over 20 forwards of one shape, the eager logits, and the statistics buffer still counts every token."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if impl == "reference" and not _reference_available():
        pytest.skip("sfl.kernels.reference not importable")
    torch._dynamo.reset()
    counters.clear()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    model = tiny_model(seed=7, intermediate_size=256).eval()
    model.set_mlp_impl(impl)
    x = torch.randint(0, VOCAB, (2, 8))
    try:
        with torch.no_grad():
            want = model(input_ids=x).logits
            model.reset_sparsity_stats()
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            outs = [compiled(input_ids=x).logits for _ in range(20)]
    finally:
        torch._dynamo.reset()
    assert len(compiles) == 1, f"{len(compiles)} compilations (recompiles or graph breaks)"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    for y in outs:
        assert torch.equal(y, want)
    st = model.sparsity_stats()
    assert st["tokens"] == 20 * x.numel() and 0 < st["nnz_mean"] <= 256


# ----------------------------------------------------------------------------- HF integration
def test_down_proj_neuron_major_for_the_kernels(tmp_path) -> None:
    """mlp_impl="cuda" keeps down_proj.weight neuron-major (kernels/layout.py: nothing transposed per call) at
    construction, after save_pretrained / from_pretrained and after set_mlp_impl; other impls keep nn.Linear's
    row-major layout. The same Parameter objects and values throughout, and the state dict HF's Llama loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sfl.kernels.layout import is_neuron_major

    def layouts(m):
        return [is_neuron_major(mlp.down_proj.weight) for mlp in m.sparse_mlps()]

    model = tiny_model(seed=9, intermediate_size=256, mlp_impl="cuda")
    assert layouts(model) == [True, True]
    assert model.model.layers[0].mlp.down_proj.weight.shape == (32, 256)
    params = [mlp.down_proj.weight for mlp in model.sparse_mlps()]
    values = [p.detach().clone() for p in params]
    model.save_pretrained(tmp_path)
    loaded = SparseLlamaForCausalLM.from_pretrained(tmp_path)
    assert layouts(loaded) == [True, True]
    for mlp, v in zip(loaded.sparse_mlps(), values):
        assert torch.equal(mlp.down_proj.weight, v)
    model.set_mlp_impl("dense")
    assert layouts(model) == [False, False]
    x = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        want = model(input_ids=x).logits
    model.set_mlp_impl("reference")  # the TwELL reference reads W_d by neuron too
    assert layouts(model) == [True, True]
    assert all(mlp.down_proj.weight is p and torch.equal(p, v) for mlp, p, v in zip(model.sparse_mlps(), params,
                                                                                    values))
    model.set_mlp_impl("dense")
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, want)
    assert layouts(tiny_model(seed=9, intermediate_size=256)) == [False, False]  # mlp_impl "dense" by default
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items()
                                         if k in LlamaConfig().to_dict()}))
    hf.load_state_dict(loaded.state_dict(), strict=True)
    for i, mlp in enumerate(loaded.sparse_mlps()):
        assert torch.equal(hf.model.layers[i].mlp.down_proj.weight, mlp.down_proj.weight)


@pytest.mark.parametrize("gated", [True, False])
def test_order_hot_neurons_keeps_the_function(tmp_path, gated: bool) -> None:
    """Hot/cold: order_hot_neurons_ permutes each layer's neurons by falling rate (gate/up rows, down columns, the
    dead-neuron counters) and sets config.hot_neurons, which reaches each layer's KernelConfig. The logits are the
    same (reference and dense impls), down_proj keeps its layout, and save / load keeps the order and the counts.
    neuron_rates counts positive gates per token, as computed by hand."""
    from sfl.kernels.layout import is_neuron_major
    from sfl.models.hot_cold import neuron_rates

    model = tiny_model(seed=11, intermediate_size=512, gated_mlp=gated, mlp_impl="reference").eval()
    x = torch.randint(0, VOCAB, (3, 7))
    seen, hooks = capture_mlp_inputs(model)
    rates = neuron_rates(model, [x[:2], x[2:]])
    for h in hooks:
        h.remove()
    for mlp, r, xin in zip(model.sparse_mlps(), rates, seen[:2]):   # the first batch's two layers ...
        w = (mlp.gate_proj if gated else mlp.up_proj).weight
        xs = torch.cat([xin.reshape(-1, 32), seen[2 + model.sparse_mlps().index(mlp)].reshape(-1, 32)])
        assert torch.allclose(r, ((xs @ w.T) > 0).float().mean(0))   # ... and the second's
    assert any(float(r.max() - r.min()) > 0.2 for r in rates)          # the orders below are not the identity
    model.sparse_mlps()[1].tokens_since_fire.copy_(torch.arange(512))
    with torch.no_grad():
        want = model(input_ids=x).logits
    model.set_mlp_impl("cuda")
    model.order_hot_neurons_(rates, [256, 0])
    assert model.config.hot_neurons == [256, 0]
    assert [m.plan.config.hot_neurons for m in model.sparse_mlps()] == [256, 0]
    assert all(is_neuron_major(m.down_proj.weight) for m in model.sparse_mlps())
    order = torch.sort(rates[1], descending=True, stable=True).indices
    assert torch.equal(model.sparse_mlps()[1].tokens_since_fire, order)
    model.set_mlp_impl("reference")
    new_rates = neuron_rates(model, [x[:2], x[2:]])
    assert all(torch.equal(r[torch.sort(r0, descending=True, stable=True).indices], r1)
               for r0, r1, r in zip(rates, new_rates, rates))
    assert all(bool((r[:-1] >= r[1:]).all()) for r in new_rates)       # falling rates after the reorder
    for impl in ("reference", "dense"):
        model.set_mlp_impl(impl)
        with torch.no_grad():
            assert torch.allclose(model(input_ids=x).logits, want, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hot_neurons"] == [256, 0]
    loaded = SparseLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert [m.plan.config.hot_neurons for m in loaded.sparse_mlps()] == [256, 0]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one rate vector"):
        model.order_hot_neurons_(rates[:1], [0])
    with pytest.raises(ValueError, match="SparseLlamaConfig.hot_neurons"):
        model.order_hot_neurons_(rates, [256, 300])
    assert model.config.hot_neurons == [256, 0]                         # a refused call changes nothing
    with pytest.raises(ValueError, match="permutation"):
        model.sparse_mlps()[0].permute_neurons_(torch.zeros(512, dtype=torch.long))


def test_save_load_round_trip_and_auto_classes(tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny_model(seed=4, gated_mlp=False, l1_coeff=3e-4, l1_reduction="sum").eval()
    model.save_pretrained(tmp_path)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["model_type"] == "sparse_llama" and cfg_json["architectures"] == ["SparseLlamaForCausalLM"]
    assert cfg_json["l1_coeff"] == 3e-4 and cfg_json["gated_mlp"] is False and cfg_json["l1_reduction"] == "sum"
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, SparseLlamaConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, SparseLlamaForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for mlp in loaded.sparse_mlps():
        assert torch.equal(mlp.tokens_since_fire, torch.zeros_like(mlp.tokens_since_fire))
    x = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, loaded(input_ids=x).logits)
    # config overrides at load time are validated like any config
    with pytest.raises(ValueError, match="intermediate_size"):
        AutoModelForCausalLM.from_pretrained(tmp_path, mlp_impl="reference")


def test_generate_greedy_matches_manual_argmax() -> None:
    model = tiny_model(seed=5).eval()
    prompt = torch.randint(1, VOCAB, (1, 5))
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
        seq = prompt
        for _ in range(6):
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert gen.shape == (1, 11)
    assert torch.equal(gen, seq)  # KV-cached generation == full recomputation


# ----------------------------------------------------------------------------- config validation
@pytest.mark.parametrize("kw, field", [
    (dict(l1_coeff=-1e-5), "l1_coeff"),
    (dict(l1_coeff=float("nan")), "l1_coeff"),
    (dict(l1_reduction="max"), "l1_reduction"),
    (dict(mlp_impl="triton"), "mlp_impl"),
    (dict(mlp_impl="cuda", intermediate_size=300), "intermediate_size"),
    (dict(kernel_config={"tile_n": 0}), "kernel_config"),
    (dict(kernel_config={"slots": 512}), "kernel_config"),
    (dict(twell_slots=512), "kernel_config"),                                 # an earlier version's field
    (dict(mlp_impl="cuda", intermediate_size=512, kernel_config={"tile_n": 128}), "kernel_config"),
    (dict(dead_window_tokens=0), "dead_window_tokens"),
    (dict(kernel_config={"mode": "fast"}), "kernel_config"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_act="silu", mlp_impl="reference", intermediate_size=256), "hidden_act"),
    (dict(mlp_impl="reference", intermediate_size=256, mlp_bias=True), "mlp_bias"),
    (dict(intermediate_size=512, hot_neurons=[256]), "hot_neurons"),          # one per layer
    (dict(intermediate_size=512, hot_neurons=[256, 100]), "hot_neurons"),     # whole tiles
    (dict(intermediate_size=512, hot_neurons=[256, 512]), "hot_neurons"),     # below intermediate_size
])
def test_config_validation_names_field(kw, field) -> None:
    with pytest.raises(ValueError, match=f"SparseLlamaConfig.{field}"):
        tiny_config(**kw)


def test_silu_baseline_matches_hf_llama() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(seed=8, hidden_act="silu").eval()
    hf_cfg = LlamaConfig(**{k: v for k, v in model.config.to_dict().items()
                            if k not in ("model_type", "architectures")})
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(model.state_dict())
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, hf(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_uninstrumented_dense_baseline_trains_like_hf_llama() -> None:
    """track_sparsity_stats=False with L1 = 0: HF LlamaForCausalLM's loss and gradients (ReLU), and no statistics
    at all (no counts, no dead-neuron tracker, no L1 value): the paper's dense training baseline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(seed=9, track_sparsity_stats=False).train()
    hf_cfg = LlamaConfig(**{k: v for k, v in model.config.to_dict().items()
                            if k not in ("model_type", "architectures")})
    hf = LlamaForCausalLM(hf_cfg).train()
    hf.load_state_dict(model.state_dict())
    x = torch.randint(0, VOCAB, (2, 9))
    out = model(input_ids=x, labels=x, l1_coeff=0.0)
    ref = hf(input_ids=x, labels=x)
    assert out.l1 is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    g, gh = model.model.layers[0].mlp.gate_proj.weight.grad, hf.model.layers[0].mlp.gate_proj.weight.grad
    torch.testing.assert_close(g, gh, rtol=1e-5, atol=1e-7)
    for mlp in model.sparse_mlps():
        assert int(mlp.nnz_stats.sum()) == 0 and int(mlp.tokens_since_fire.sum()) == 0


@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_cuda_impl_passes_the_kernel_mode_to_the_kernels(monkeypatch, mode) -> None:
    """config.kernel_config's mode reaches the op through the layer's plan (checked with a stand-in for the CUDA op,
    so it runs on CPU): each layer calls ops.ffn once with its own plan, whose KernelConfig carries the mode, and
    with its statistics buffer."""
    from sfl.kernels.twell import ops

    seen = []

    def fake(x, w_gate, w_up, w_down, plan, stats=None):
        seen.append((plan, stats))
        return (torch.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T

    monkeypatch.setattr(ops, "ffn", fake)
    monkeypatch.setattr(ops, "ensure_loaded", lambda: None)
    model = tiny_model(seed=4, mlp_impl="cuda", intermediate_size=512,
                       kernel_config={"mode": mode}).eval()
    x = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        got = model(input_ids=x).logits
        model.set_mlp_impl("dense")
        want = model(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mlps = model.sparse_mlps()
    assert len(seen) == len(mlps)
    assert [p for p, _ in seen] == [m.plan for m in mlps] and len({p.id for p, _ in seen}) == len(mlps)
    assert {p.config.mode for p, _ in seen} == {mode}
    assert all(st is m.nnz_stats for (_, st), m in zip(seen, mlps))


def test_config_accepts_tileable_sparse_impl() -> None:
    cfg = tiny_config(mlp_impl="reference", intermediate_size=512, kernel_config={"tile_n": 128, "slots": 16})
    assert cfg.mlp_impl == "reference"
    assert SparseLlamaConfig.from_dict(cfg.to_dict()).get_kernel_config().tile_n == 128
    old = tiny_config(mlp_impl="reference", intermediate_size=512, twell_tile_n=128, twell_slots=16,
                      twell_mode="sparse")
    assert (old.get_kernel_config().tile_n, old.get_kernel_config().slots, old.get_kernel_config().mode) == \
        (128, 16, "sparse") and not hasattr(old, "twell_slots")   # an earlier version's config.json reads the same


def test_reference_impl_reads_the_kernel_config(monkeypatch) -> None:
    """mlp_impl='reference' runs with the KernelConfig's tile_n and slots (the fields the CUDA kernels read)."""
    from sfl.models import mlp_impls

    seen = []
    real = mlp_impls.gated_ffn_twell
    monkeypatch.setattr(mlp_impls, "gated_ffn_twell",
                        lambda *a, **kw: seen.append((kw["tile_n"], kw["slots"])) or real(*a, **kw))
    model = tiny_model(seed=5, mlp_impl="reference", intermediate_size=512, kernel_config={"tile_n": 128, "slots": 8})
    with torch.no_grad():
        model.eval()(input_ids=torch.randint(0, VOCAB, (1, 5)))
    assert seen and set(seen) == {(128, 8)}


# ----------------------------------------------------------------------------- ReLU-fication
def _tiny_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<unk>"] = VOCAB - 1
    tok = Tokenizer(tmodels.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def test_convert_relufies_dense_llama(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sfl.models.convert import main as convert_main

    torch.manual_seed(6)
    dense_cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                            hidden_act="silu")
    dense = LlamaForCausalLM(dense_cfg).eval()
    src, out = tmp_path / "dense", tmp_path / "sparse"
    dense.save_pretrained(src)
    _tiny_tokenizer(src)
    convert_main(["--src", str(src), "--out", str(out), "--l1-coeff", "2e-5"])

    sparse = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(sparse, SparseLlamaForCausalLM)
    assert sparse.config.hidden_act == "relu" and sparse.config.l1_coeff == 2e-5 and sparse.config.gated_mlp
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w5") == 5
    for name, p in dense.state_dict().items():
        assert torch.equal(sparse.state_dict()[name], p), name

    # Independent reference: HF's own Llama with a ReLU activation and the same weights.
    relu_cfg = LlamaConfig(**{**dense_cfg.to_dict(), "hidden_act": "relu"})
    relu_llama = LlamaForCausalLM(relu_cfg).eval()
    relu_llama.load_state_dict(dense.state_dict())
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        got = sparse(input_ids=x).logits
        torch.testing.assert_close(got, relu_llama(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, dense(input_ids=x).logits, atol=1e-4)  # SiLU -> ReLU changed it
        # and one MLP by hand: down(relu(gate x) * up x)
        mlp, ref = sparse.model.layers[0].mlp, dense.model.layers[0].mlp
        h = torch.randn(3, 32)
        want = (torch.relu(h @ ref.gate_proj.weight.T) * (h @ ref.up_proj.weight.T)) @ ref.down_proj.weight.T
        torch.testing.assert_close(mlp(h), want, rtol=1e-5, atol=1e-6)


def test_convert_rejects_non_llama(tmp_path) -> None:
    from sfl.models.convert import convert

    with pytest.raises(FileNotFoundError, match="config.json"):
        convert(tmp_path / "missing", tmp_path / "out")
