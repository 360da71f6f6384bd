"""experiments/speed/decode_loop.py: greedy decoding with a static cache, the loop real_path.py times with one CUDA
graph per token. On the CPU, the eager loop gives generate()'s greedy tokens; on a GPU, the graphed loop gives the
eager loop's tokens for HF's Llama and the dense model's argmax for ours through the sparse op."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sfl.experiments.speed import decode_loop
from sfl.experiments.speed.decode_loop import StaticGreedyDecoder
from sfl.kernels.config import KernelConfig
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM

SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def greedy(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("cls,cfg", [(SparseLlamaForCausalLM, SparseLlamaConfig), (LlamaForCausalLM, LlamaConfig)])
def test_eager_loop_gives_generates_tokens(cls, cfg) -> None:
    torch.manual_seed(0)
    model = cls(cfg(**SHAPE, hidden_act="relu")).eval()
    prompt = torch.randint(1, 256, (3, 10))
    decoder = StaticGreedyDecoder(model, batch=3, max_len=32, graph=False)
    want = greedy(model, prompt, 12)
    assert torch.equal(decoder(prompt, 12), want)
    assert torch.equal(decoder(prompt, 12), want)  # the cache is reset between calls
    with pytest.raises(ValueError, match="does not fit this decoder"):
        decoder(prompt, 30)
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        StaticGreedyDecoder(model, batch=3, max_len=32, graph=True)


class _ReplayedCall:
    """A stand-in for a CUDA graph on the CPU: replay() runs the step again into the output buffer."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def _capture_like_cuda(fn):
    """What kernels.timing.capture_graph does to the model's state: two warm-up steps run, the captured one does
    not (its kernels only run at replay)."""
    for _ in range(2):
        out = fn()
    buffer = torch.empty_like(out)
    return _ReplayedCall(fn, buffer), buffer


def test_capture_warm_up_leaves_the_cache_as_it_was(monkeypatch) -> None:
    """transformers' StaticCache writes at its own running length: the capture's warm-up steps must not shift it.
    With max_len exactly prompt + new tokens, a shifted cache writes past its end."""
    monkeypatch.setattr(decode_loop, "capture_graph", _capture_like_cuda)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, hidden_act="relu")).eval()
    prompt = torch.randint(1, 256, (2, 10))
    decoder = StaticGreedyDecoder(model, batch=2, max_len=22, graph=False)
    decoder.use_graph = True  # the graphed loop's order of calls, with the CPU stand-in for the graph
    want = greedy(model, prompt, 12)
    assert torch.equal(decoder(prompt, 12), want) and isinstance(decoder.graph, _ReplayedCall)
    assert torch.equal(decoder(prompt, 12), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sparse", "auto"])
def test_graphed_loop_on_gpu(mode: str) -> None:
    torch.manual_seed(0)
    ours = SparseLlamaForCausalLM(SparseLlamaConfig(**SHAPE, hidden_act="relu")).eval().to("cuda", torch.bfloat16)
    dense = LlamaForCausalLM(LlamaConfig(**SHAPE, hidden_act="relu")).eval().to("cuda", torch.bfloat16)
    prompt = torch.randint(1, 256, (4, 12), device="cuda")
    graphed = StaticGreedyDecoder(dense, batch=4, max_len=40, graph=True)
    eager = StaticGreedyDecoder(dense, batch=4, max_len=40, graph=False)
    assert torch.equal(graphed(prompt, 20), eager(prompt, 20)) and graphed.graph is not None
    for g_layer, e_layer in zip(graphed.cache.layers, eager.cache.layers):  # every key where the eager loop put it
        assert torch.equal(g_layer.keys, e_layer.keys)
    ours.set_mlp_impl("cuda")
    ours.set_kernel_config(KernelConfig(mode=mode))
    seqs = [StaticGreedyDecoder(ours, batch=4, max_len=40, graph=True)(prompt, 20) for _ in range(2)]
    ours.set_mlp_impl("dense")
    with torch.inference_mode():
        logits = ours(input_ids=seqs[0]).logits.float()
    assert torch.equal(seqs[0], seqs[1]) and torch.equal(seqs[0][:, :12], prompt)
    step = logits[:, 11:-1]  # the logits that chose each new token
    chosen = step.gather(-1, seqs[0][:, 12:].unsqueeze(-1)).squeeze(-1)
    assert bool((chosen >= step.amax(-1) - 0.02 * step.amax(-1).abs()).all()), "a token is not the argmax"
