"""Greedy decoding with the whole decode step in one CUDA graph: what a model gives per token once the host work of
transformers' generate() loop is gone.

    from sfl.experiments.speed.decode_loop import StaticGreedyDecoder
    decoder = StaticGreedyDecoder(model, batch=8, max_len=192, graph=True)   # graph=False: the same loop, eager
    ids = decoder(prompt_ids, new_tokens=64)                                 # [batch, prompt + 64], greedy

The prompt runs eagerly (prefill) into a transformers StaticCache; every later token is one replay of a graph
holding the model's forward of one token per sequence and the argmax, reading its token and position from two
device buffers that the loop updates in place. The position goes in as `position_ids` (rotary embedding and mask);
the cache itself writes each step at its own running length, which the prefill leaves at the prompt's length, so
the two agree. Any model whose forward takes `past_key_values` and `cache_position`
works: HF's LlamaForCausalLM and SparseLlamaForCausalLM alike (our decode kernels are capturable). Sequences are
decoded in lockstep without padding or stopping at EOS, as a throughput loop does. real_path.py's `graph` part times
it on both sides.
"""
from __future__ import annotations

import torch
from transformers import StaticCache

from sfl.kernels.timing import capture_graph


class StaticGreedyDecoder:
    """Greedy decoding of `batch` sequences of up to `max_len` tokens with a static KV cache; with graph=True each
    decode step after the first call's warm-up is one CUDA graph replay."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, graph: bool = True) -> None:
        if graph and model.device.type != "cuda":
            raise ValueError(f"graph=True needs the model on a CUDA device, not {model.device}; use graph=False")
        self.model, self.batch, self.max_len, self.use_graph = model, batch, max_len, graph
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)     # the step's input token
        self.position = torch.zeros(1, dtype=torch.long, device=model.device)         # its cache position
        self.graph: torch.cuda.CUDAGraph | None = None
        self.next_token: torch.Tensor | None = None  # the graph's output buffer

    def _step(self) -> torch.Tensor:
        logits = self.model(input_ids=self.token, past_key_values=self.cache, position_ids=self.position.view(1, 1),
                            cache_position=self.position, use_cache=True).logits
        return logits[:, -1].argmax(-1)

    def _capture(self) -> None:
        """Capture the decode step on the empty cache, then empty it again: transformers' StaticCache writes each
        update at its own running length (a device counter), not at cache_position, so the capture's warm-up steps
        advance it; the emptied cache restarts it at 0 in place, where the captured graph reads it."""
        self.cache.reset()
        self.token.zero_()
        self.position.zero_()
        self.graph, self.next_token = capture_graph(self._step)
        self.cache.reset()

    def _decode_one(self) -> torch.Tensor:
        if not self.use_graph:
            return self._step()
        self.graph.replay()
        return self.next_token.clone()  # the buffer is overwritten by the next replay

    @torch.inference_mode()
    def __call__(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        b, p = prompt.shape
        if b != self.batch or p + new_tokens > self.max_len:
            raise ValueError(f"prompt {tuple(prompt.shape)} + {new_tokens} new tokens does not fit this decoder "
                             f"(batch {self.batch}, max_len {self.max_len}); make one for that shape")
        if self.use_graph and self.graph is None:
            self._capture()
        self.cache.reset()
        positions = torch.arange(p, device=prompt.device)
        logits = self.model(input_ids=prompt, past_key_values=self.cache, position_ids=positions[None],
                            cache_position=positions, use_cache=True).logits
        tokens = [logits[:, -1].argmax(-1)]
        for i in range(new_tokens - 1):
            self.token.copy_(tokens[-1][:, None])
            self.position.fill_(p + i)
            tokens.append(self._decode_one())
        return torch.cat([prompt, torch.stack(tokens, dim=1)], dim=1)
