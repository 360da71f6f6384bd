"""SparseLlamaForCausalLM(mlp_impl="cuda") compiled, on the GPU: torch.compile(fullgraph=True) compiles once, and
generate() with the static cache (transformers compiles it with CUDA graphs, its supported way) runs as graphs and
decodes greedily like the dense math. Skipped without a GPU."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM  # noqa: E402

DEV = "cuda"
VOCAB = 256


def small_model(impl: str, mode: str = "auto", seed: int = 0) -> SparseLlamaForCausalLM:
    """Two layers, K = 128, N = 512 (shapes the kernels serve), bf16 on the GPU; `mode`: the KernelConfig mode (random
    weights are ~50% active, so "sparse" forces the TwELL path that auto would not take)."""
    from sfl.kernels.config import KernelConfig

    torch.manual_seed(seed)
    cfg = SparseLlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            tie_word_embeddings=True, hidden_act="relu")
    model = SparseLlamaForCausalLM(cfg).eval().to(DEV, torch.bfloat16)
    model.set_mlp_impl(impl)
    model.set_kernel_config(KernelConfig(mode=mode))
    return model


def rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return float((y.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_compiled_cuda_model_fullgraph_once(mode: str) -> None:
    """torch.compile(model, fullgraph=True) with mlp_impl cuda: one graph, no recompile over 20 forwards of one
    shape, logits within bf16 rounding of the dense path's, and the statistics count every token."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = small_model("cuda", mode)
    x = torch.randint(0, VOCAB, (2, 16), device=DEV)
    with torch.no_grad():
        want = small_model("dense")(input_ids=x).logits.float()
        model(input_ids=x)  # the plans' first (eager) calls
        model.reset_sparsity_stats()
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True)
        try:
            outs = [compiled(input_ids=x).logits.float() for _ in range(20)]
        finally:
            torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for y in outs:
        assert rel_err(y, want) < 0.02
    assert model.sparsity_stats()["tokens"] == 20 * x.numel()


@pytest.mark.parametrize("batch,mode", [(1, "sparse"), (3, "sparse"), (1, "auto")])
def test_static_cache_generate_compiled(batch: int, mode: str) -> None:
    """generate(cache_implementation="static"): transformers compiles the decode step (mode reduce-overhead); it runs
    as CUDA graphs (no skip, no error from the op's plan state in the graph pool), three times in a row, every
    greedy token is the argmax of the dense model's logits up to bf16 ties, and no layer's plan holds a copy of W_d
    (the model stores it neuron-major)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = small_model("cuda", mode)
    dense = small_model("dense")
    prompt = torch.randint(1, VOCAB, (batch, 12), device=DEV)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.inference_mode():
            runs = [model.generate(prompt, **kw) for _ in range(3)]
            logits = [dense(input_ids=seq).logits.float() for seq in runs]
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled decode step did not run as a CUDA graph"
    # W_d stored neuron-major (kernels/layout.py): the plans read it as it is and keep no copy of it
    from sfl.kernels.layout import is_neuron_major

    for mlp in model.sparse_mlps():
        assert is_neuron_major(mlp.down_proj.weight) and mlp.plan.info()["down_copy_bytes"] == 0
    for seq, lg in zip(runs, logits):
        assert seq.shape == (batch, 22) and torch.equal(seq[:, :12], prompt)
        step = lg[:, 11:-1]  # the logits that chose each new token
        chosen = step.gather(-1, seq[:, 12:].unsqueeze(-1)).squeeze(-1)
        tol = 0.02 * step.abs().amax(-1)
        assert bool((chosen >= step.amax(-1) - tol).all()), "a greedy token is not the dense model's argmax"


@pytest.mark.parametrize("train_mode", ["sparse", "auto"])
def test_compiled_training_steps_match_eager(train_mode: str) -> None:
    """torch.compile of the model in training with the cuda training op (forward with labels, the loss with its L1
    term, backward): at every step the loss and every gradient are as close to fp32 math (the same weights, dense
    MLP) as eager bf16's, within 2x its error, and after the first two steps nothing new is compiled (the MLPs run
    eagerly between compiled regions; traced, their dispatch history recompiled the model at every step)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from sfl.kernels.config import KernelConfig

    def make(impl: str = "cuda", dtype=torch.bfloat16) -> SparseLlamaForCausalLM:
        torch.manual_seed(5)
        cfg = SparseLlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                tie_word_embeddings=True, hidden_act="relu", l1_coeff=1e-3)
        m = SparseLlamaForCausalLM(cfg).to(DEV, torch.bfloat16).to(dtype).train()  # the same (bf16) weights
        m.set_mlp_impl(impl)
        m.set_kernel_config(KernelConfig(train_mode=train_mode, train_sparse_min_m=0))
        return m

    def step(call, model, x) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        loss = call(input_ids=x, labels=x).loss
        loss.backward()
        return float(loss.detach()), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    x = torch.randint(0, VOCAB, (4, 64), device=DEV)
    ref_loss, ref = step(*(2 * [make("dense", torch.float32)]), x)
    eager, compiled_model = make(), make()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_model)
    graphs_after_warmup = None
    try:
        for i in range(6):
            want_loss, want = step(eager, eager, x)
            got_loss, got = step(compiled, compiled_model, x)
            assert abs(got_loss - ref_loss) <= 2 * abs(want_loss - ref_loss) + 1e-3 * abs(ref_loss), (i, got_loss, want_loss, ref_loss)
            assert got.keys() == want.keys() == ref.keys()
            for name in ref:
                e_got, e_want = rel_err(got[name], ref[name]), rel_err(want[name], ref[name])
                assert e_got <= 2 * e_want + 0.005, (i, name, e_got, e_want)
            if i == 1:
                graphs_after_warmup = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs_after_warmup, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_calibrate_hot_neurons_keeps_the_logits() -> None:
    """models.hot_cold.calibrate_hot_neurons_ on the GPU: rates measured, neurons ordered, a hot count timed per
    layer from the candidates (here every one forced to be tried), the model's logits through the kernels (forced
    sparse, hot/cold where chosen) within bf16 rounding of the dense path's, and the statistics still count every
    token. With hot counts forced on both layers the logits stay as close."""
    from sfl.models.hot_cold import calibrate_hot_neurons_

    model = small_model("cuda", "sparse", seed=3)
    ids = torch.randint(0, VOCAB, (4, 64), device=DEV)
    with torch.no_grad():
        want = small_model("dense", seed=3)(input_ids=ids).logits.float()
        hot = calibrate_hot_neurons_(model, [ids[:2], ids[2:]], ids, candidates=(256,), reps=2)
        assert len(hot) == 2 and all(h in (0, 256) for h in hot) and model.config.hot_neurons == hot
        model.reset_sparsity_stats()
        assert rel_err(model(input_ids=ids).logits, want) < 0.02
        model.order_hot_neurons_([torch.zeros(512)] * 2, [256, 256])   # equal rates: the order stays
        y = model(input_ids=ids).logits
    assert rel_err(y, want) < 0.02
    assert [m.plan.info()["hot_neurons"] for m in model.sparse_mlps()] == [256, 256]
    assert model.sparsity_stats()["tokens"] == 2 * ids.numel()
