"""SparseLlamaForCausalLM: transformers' Llama with the MLP swapped for a ReLU (+L1) sparse MLP.

Only the MLP and the causal-LM head's loss differ from LlamaForCausalLM; attention, norms, RoPE,
caching and generation are inherited, so from_pretrained / generate / lm-eval's HFLM work as for
any Llama once `import sfl.models` has registered the classes with the Auto factories.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM, LlamaModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .configuration_sparse_llama import KernelConfig, SparseLlamaConfig
from .mlp_impls import in_backward, mlp_function
from .sparsity import dead_fraction, l1_penalty, update_tokens_since_fire

try:  # the installed project's kernels: optional, a checkpoint's copy of this file runs dense and reference without
    from sfl.kernels.layout import set_down_layout_
    from sfl.kernels.twell.ops import Plan
except ModuleNotFoundError as e:
    if e.name != "sfl":
        raise
    set_down_layout_ = Plan = None


class L1Terms:
    """One forward's request for the MLPs' L1 terms: the mode ("grad" or "value") and the terms, appended by every
    layer's MLP in order. SparseLlamaForCausalLM passes it down as the keyword sfl_l1 (HF's LlamaModel hands its
    **kwargs to every decoder layer), so the terms travel with the call instead of living in module attributes."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.terms: list[torch.Tensor] = []


class SparseLlamaMLP(nn.Module):
    """ReLU MLP (gated or not) with the L1 term of Eq. 2 and sparsity statistics.

    Statistics stay on the device: the buffer nnz_stats (int64 [3]: non-zeros summed over tokens, the largest
    per-token count, tokens) accumulates every forward (on the CUDA path inside the op's own kernels) and is read
    only by sparsity_stats(); config.track_sparsity_stats=False turns it off. Nothing else runs per call.
        last_nnz_per_token: float32 [M] per-token counts of the last forward, kept only while record_per_token is
            True (analysis tools set it; the CUDA inference path does not produce per-token counts).
    forward(x) is y, as HF's LlamaMLP; forward(x, l1_terms) also appends this layer's L1 term to the forward's
    collector (L1Terms); forward_l1(x, l1_mode) returns (y, L1 term or None) without module hooks.
    tokens_since_fire (int64 [N], non-persistent buffer): per-neuron distance to its last firing,
    advanced only by training-mode forwards (see models.sparsity.update_tokens_since_fire).
    """

    def __init__(self, config: SparseLlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gated = bool(config.gated_mlp)
        if self.gated:
            self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.layout_down_proj()
        self.register_buffer(
            "tokens_since_fire", torch.zeros(self.intermediate_size, dtype=torch.int64), persistent=False
        )
        self.register_buffer("nnz_stats", torch.zeros(3, dtype=torch.int64), persistent=False)
        self.last_nnz_per_token: torch.Tensor | None = None
        self.record_per_token = False
        self._train_state = None  # mlp_impl="cuda" training: the layer's measured-activity history
        self._cast_cache = None   # mlp_impl="cuda" inference: the weights cast to the autocast dtype
        self.refresh_plan()

    def refresh_plan(self) -> None:
        """(Re)take this layer's KernelConfig from config.get_kernel_config() and make its kernel plan (a new plan
        starts a new dispatch history; its crossover tables are this GPU's measured ones where there are,
        kernels/tables.py; no plan without the project's kernels). Called at construction and by
        SparseLlamaForCausalLM.set_kernel_config; never per call, so a compiled model sees a constant."""
        self.kernel_config = self.config.get_kernel_config(self.layer_idx)
        shape = (self.hidden_size, self.intermediate_size)
        self.plan = Plan(self.kernel_config, shape=shape) if Plan is not None else None

    def layout_down_proj(self) -> None:
        """down_proj.weight neuron-major for the TwELL paths (mlp_impl "cuda" and its "reference"), which read W_d by
        neuron (the kernels then copy nothing per call: kernels/layout.py), nn.Linear's row-major for "dense" (HF's
        exact ops).
        The same Parameter and values; the model calls it at construction, after from_pretrained and in
        set_mlp_impl (a checkpoint loader that replaces the parameters leaves them row-major: still exact, the
        ops copy)."""
        if set_down_layout_ is None:  # without the project's kernels only dense and reference run: nn.Linear's layout
            return
        set_down_layout_(self.down_proj, neuron_major=self.config.mlp_impl != "dense")

    @torch.no_grad()
    def permute_neurons_(self, order: torch.Tensor) -> None:
        """Reorder the intermediate neurons: neuron i becomes order[i] (rows of gate_proj / up_proj and their
        biases, columns of down_proj, the dead-neuron counters). The layer computes the same function; each weight
        keeps its memory layout (copy_ writes in place)."""
        n = self.intermediate_size
        order = torch.as_tensor(order, device=self.up_proj.weight.device, dtype=torch.long)
        if order.shape != (n,) or not torch.equal(torch.sort(order).values, torch.arange(n, device=order.device)):
            raise ValueError(f"order must be a permutation of range({n}), got shape {tuple(order.shape)}")
        for lin in ((self.gate_proj,) if self.gated else ()) + (self.up_proj,):
            lin.weight.copy_(lin.weight[order])
            if lin.bias is not None:
                lin.bias.copy_(lin.bias[order])
        self.down_proj.weight.copy_(self.down_proj.weight[:, order])
        if self.tokens_since_fire.device.type != "meta":
            self.tokens_since_fire.copy_(self.tokens_since_fire[order.to(self.tokens_since_fire.device)])
        self._cast_cache = None

    # ----------------------------------------------------------------------------- statistics
    @torch.no_grad()
    def reset_sparsity_stats(self, dead_tracker: bool = True) -> None:
        """Clear the accumulated nnz statistics (and, by default, the dead-neuron counters)."""
        if self.nnz_stats.device.type != "meta":
            self.nnz_stats.zero_()
        if dead_tracker and self.tokens_since_fire.device.type != "meta":
            self.tokens_since_fire.zero_()

    @torch.no_grad()
    def record(self, nnz: torch.Tensor, active: torch.Tensor | None) -> None:
        if self.record_per_token:
            self.last_nnz_per_token = nnz.detach().float()
        if self.training and in_backward():  # activation-checkpoint recompute: this batch was already counted
            return
        if self.config.track_sparsity_stats and nnz.numel() > 0:
            n = nnz.detach().to(torch.int64)
            st = self.nnz_stats
            st[0] += n.sum()
            st[1] = torch.maximum(st[1], n.max())
            st[2] += n.numel()
        if self.training and active is not None:
            update_tokens_since_fire(self.tokens_since_fire, active)

    @torch.no_grad()
    def sparsity_stats(self) -> dict[str, float]:
        """nnz_mean / nnz_max per token over forwards since the last reset (NaN if none), the
        dead fraction for config.dead_window_tokens, and the number of tokens seen."""
        total, mx, tokens = (int(v) for v in self.nnz_stats.tolist())
        nnz_mean = total / tokens if tokens else float("nan")
        nnz_max = float(mx) if tokens else float("nan")
        dead = float(dead_fraction(self.tokens_since_fire, self.config.dead_window_tokens))
        return {"nnz_mean": nnz_mean, "nnz_max": nnz_max, "dead_frac": dead, "tokens": tokens}

    # ----------------------------------------------------------------------------- forward
    def weights(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        return (self.gate_proj.weight if self.gated else None, self.up_proj.weight, self.down_proj.weight)

    def act(self, t: torch.Tensor) -> torch.Tensor:
        # ReLU for the sparse model; SiLU only for the dense baseline (config allows it with mlp_impl dense).
        return F.relu(t) if self.config.hidden_act == "relu" else F.silu(t)

    def activation(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, h): a = relu(gate) (or relu(up)) decides activity; h feeds down_proj."""
        if self.gated:
            a = self.act(F.linear(x2, self.gate_proj.weight, self.gate_proj.bias))
            return a, a * F.linear(x2, self.up_proj.weight, self.up_proj.bias)
        a = self.act(F.linear(x2, self.up_proj.weight, self.up_proj.bias))
        return a, a

    def l1_term(self, h: torch.Tensor, l1_mode: str | None) -> torch.Tensor | None:
        """The L1 term of h: differentiable ("grad"), a detached value for the log ("value"), or None."""
        if l1_mode is None:
            return None
        if l1_mode == "grad":
            return l1_penalty(h, self.config.l1_reduction)
        with torch.no_grad():
            return l1_penalty(h, self.config.l1_reduction)

    def needs_grad(self, x: torch.Tensor) -> bool:
        """Whether autograd needs this call differentiable (the inference kernels have no backward)."""
        return self.training or x.requires_grad or any(w is not None and w.requires_grad for w in self.weights())

    def forward(self, x: torch.Tensor, l1_terms: L1Terms | None = None) -> torch.Tensor:
        """y; with l1_terms (the decoder layer passes the forward's collector) this layer's L1 term is appended
        to it. Called through the module, so forward hooks see x and y as with HF's LlamaMLP."""
        y, l1 = self.forward_l1(x, l1_terms.mode if l1_terms is not None else None)
        if l1 is not None and not in_backward():  # an activation-checkpoint recompute adds nothing
            l1_terms.terms.append(l1)
        return y

    def forward_l1(self, x: torch.Tensor, l1_mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, L1 term): l1_mode "grad" (differentiable), "value" (for the log) or None (not computed). The
        computation is config.mlp_impl's entry in models/mlp_impls.py."""
        return mlp_function(self.config.mlp_impl)(self, x, l1_mode)

    def extra_repr(self) -> str:
        return f"gated={self.gated}, impl={self.config.mlp_impl}, act={self.config.hidden_act}"


class SparseLlamaDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose MLP is a SparseLlamaMLP, which also receives the forward's L1Terms (sfl_l1)."""

    def __init__(self, config: SparseLlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.mlp = SparseLlamaMLP(config, layer_idx)

    def forward(self, hidden_states: torch.Tensor, *args: Any, sfl_l1: L1Terms | None = None,
                **kwargs: Any) -> torch.Tensor:
        # HF's pre-norm residual block (LlamaDecoderLayer.forward); the MLP also gets the forward's L1 collector
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states), *args, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), sfl_l1)


class SparseLlamaPreTrainedModel(LlamaPreTrainedModel):
    config: SparseLlamaConfig
    config_class = SparseLlamaConfig
    _no_split_modules = ["SparseLlamaDecoderLayer"]
    _can_record_outputs = {"hidden_states": SparseLlamaDecoderLayer, "attentions": LlamaAttention}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, SparseLlamaMLP):
            module.reset_sparsity_stats()


class SparseLlamaModel(SparseLlamaPreTrainedModel, LlamaModel):
    """LlamaModel built from SparseLlamaDecoderLayers (forward inherited unchanged)."""

    def __init__(self, config: SparseLlamaConfig) -> None:
        config.check_sparsity_fields()  # fields may have been set after construction (from_pretrained kwargs)
        LlamaPreTrainedModel.__init__(self, config)  # skip LlamaModel.__init__: it builds LlamaMLPs
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [SparseLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


@dataclass
class SparseCausalLMOutputWithPast(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the two loss parts: loss = ce + l1_coeff * l1."""

    ce: torch.FloatTensor | None = None
    l1: torch.FloatTensor | None = None


class SparseLlamaForCausalLM(SparseLlamaPreTrainedModel, LlamaForCausalLM):
    """Causal LM with loss = CE + l1_coeff * mean_over_layers(L1 of h).

    forward(..., labels=...) follows the HF convention (labels aligned with input_ids, shifted
    inside); pass shift_labels=... instead for already-shifted targets. l1_coeff=... overrides
    config.l1_coeff for this call (the trainer's warm-up uses it). The parts are on the output
    (.ce, .l1) and in self.last_losses (detached).
    """

    def __init__(self, config: SparseLlamaConfig) -> None:
        config.check_sparsity_fields()
        LlamaPreTrainedModel.__init__(self, config)  # skip LlamaForCausalLM.__init__ (LlamaModel)
        self.model = SparseLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.last_losses: dict[str, Any] = {}
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "SparseLlamaForCausalLM":
        # transformers' from_pretrained takes a `kernel_config` of its own (hub kernels): ours, a dict or our
        # KernelConfig, must not reach it, so it is applied once the model is loaded.
        ours = kwargs.get("kernel_config")
        ours = kwargs.pop("kernel_config") if isinstance(ours, (dict, KernelConfig)) else None
        model = super().from_pretrained(*args, **kwargs)
        if ours is not None and isinstance(model, SparseLlamaForCausalLM):
            model.set_kernel_config(ours)
        # Non-persistent buffers are materialised uninitialised by the loader: start counters at 0.
        if isinstance(model, SparseLlamaForCausalLM):
            model.reset_sparsity_stats()
            for mlp in model.sparse_mlps():  # the loader put checkpoint tensors (row-major) in place
                mlp.layout_down_proj()
        return model

    # ----------------------------------------------------------------------------- helpers
    def sparse_mlps(self) -> list[SparseLlamaMLP]:
        return [layer.mlp for layer in self.model.layers]

    def set_mlp_impl(self, impl: str) -> None:
        """Switch every layer between 'dense', 'reference' and 'cuda' (validated), each down_proj.weight to the
        layout that impl reads (layout_down_proj)."""
        old = self.config.mlp_impl
        self.config.mlp_impl = impl
        try:
            self.config.check_sparsity_fields()
        except ValueError:
            self.config.mlp_impl = old
            raise
        for mlp in self.sparse_mlps():
            mlp.layout_down_proj()

    def set_kernel_config(self, kernel_config: KernelConfig | dict) -> None:
        """Run the sparse paths with this KernelConfig (or dict of its fields): stored in config.kernel_config
        (saved with the model) and given to every layer as a new plan (fresh dispatch histories)."""
        cfg = kernel_config if isinstance(kernel_config, KernelConfig) else KernelConfig.from_dict(kernel_config)
        self.config.kernel_config = cfg.to_dict()
        for mlp in self.sparse_mlps():
            mlp.refresh_plan()

    @torch.no_grad()
    def order_hot_neurons_(self, rates: Sequence[torch.Tensor], hot: Sequence[int]) -> None:
        """Hot/cold: put each layer's neurons in order of falling firing rate (rates[i]: [intermediate_size], e.g.
        from models.hot_cold.neuron_rates) and compute its first hot[i] of them as dense GEMMs in the CUDA kernels'
        sparse calls (config.hot_neurons, saved; KernelConfig.hot_neurons; 0 = all through TwELL). The model's
        function is unchanged: the weights are permuted in place, and saved in the new order. New plans (fresh
        dispatch histories)."""
        mlps = self.sparse_mlps()
        if len(rates) != len(mlps) or len(hot) != len(mlps):
            raise ValueError(f"need one rate vector and one hot count per layer ({len(mlps)}), got {len(rates)} "
                             f"and {len(hot)}")
        old = self.config.hot_neurons
        self.config.hot_neurons = [int(h) for h in hot]
        try:
            self.config.check_sparsity_fields()
        except ValueError:
            self.config.hot_neurons = old
            raise
        for mlp, r in zip(mlps, rates):
            # stable: equal rates keep their order, so ordering an ordered model changes nothing
            mlp.permute_neurons_(torch.sort(torch.as_tensor(r).float().cpu(), descending=True, stable=True).indices)
            mlp.refresh_plan()

    def record_nnz_per_token(self, on: bool = True) -> None:
        """Keep each layer's per-token non-zero counts of the last forward in mlp.last_nnz_per_token (analysis
        tools; off by default: the CUDA inference path produces totals only)."""
        for mlp in self.sparse_mlps():
            mlp.record_per_token = on
            if not on:
                mlp.last_nnz_per_token = None

    def reset_sparsity_stats(self, dead_tracker: bool = True) -> None:
        for mlp in self.sparse_mlps():
            mlp.reset_sparsity_stats(dead_tracker)

    def sparsity_stats(self, reset: bool = False) -> dict[str, Any]:
        """Per-layer lists and aggregates over forwards since the last reset:
        nnz_mean (mean over layers of mean nnz/token), nnz_max (max over layers of max nnz/token),
        dead_frac (mean over layers of the dead-neuron fraction), *_per_layer lists, tokens."""
        per = [mlp.sparsity_stats() for mlp in self.sparse_mlps()]
        out: dict[str, Any] = {
            "nnz_mean_per_layer": [p["nnz_mean"] for p in per],
            "nnz_max_per_layer": [p["nnz_max"] for p in per],
            "dead_frac_per_layer": [p["dead_frac"] for p in per],
            "tokens": per[0]["tokens"] if per else 0,
        }
        n = max(len(per), 1)
        out["nnz_mean"] = sum(out["nnz_mean_per_layer"]) / n
        out["nnz_max"] = max(out["nnz_max_per_layer"], default=float("nan"))
        out["dead_frac"] = sum(out["dead_frac_per_layer"]) / n
        if reset:
            self.reset_sparsity_stats(dead_tracker=False)
        return out

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        l1_coeff: float | None = None,
        **kwargs: Any,
    ) -> SparseCausalLMOutputWithPast:
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is not None:
            shift_labels = shift_labels.contiguous()  # HF's loss .view()s it; slices of a window are strided
        want_loss = labels is not None or shift_labels is not None
        coeff = float(self.config.l1_coeff if l1_coeff is None else l1_coeff)
        if not coeff >= 0:
            raise ValueError(f"l1_coeff must be >= 0, got {coeff}")
        mode = ("grad" if coeff > 0 and torch.is_grad_enabled() else "value") if want_loss else None
        if coeff == 0 and not self.config.track_sparsity_stats:
            mode = None  # statistics off: not even the L1 value is computed (l1 = None)
        request = L1Terms(mode) if mode is not None else None
        extra = {"sfl_l1": request} if request is not None else {}  # the decoder layers append their L1 terms

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
            **extra,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = ce = l1 = None
        if want_loss:
            ce = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                    shift_labels=shift_labels, **kwargs)
            l1_terms = request.terms if request is not None else []
            if l1_terms and len(l1_terms) == len(self.model.layers):
                l1 = torch.stack(l1_terms).mean()
                loss = ce + coeff * l1 if coeff > 0 else ce
            else:
                if coeff > 0:
                    warnings.warn(
                        f"mlp_impl={self.config.mlp_impl!r} does not expose h, so the L1 term is "
                        "unavailable: loss = CE only (l1=None). Use mlp_impl='dense' for training.",
                        stacklevel=2,
                    )
                loss = ce
            self.last_losses = {
                "ce": ce.detach(),
                "l1": None if l1 is None else l1.detach(),
                "l1_coeff": coeff,
            }
        return SparseCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            ce=ce,
            l1=l1,
        )


__all__ = [
    "SparseLlamaMLP",
    "SparseLlamaDecoderLayer",
    "SparseLlamaPreTrainedModel",
    "SparseLlamaModel",
    "SparseLlamaForCausalLM",
    "SparseCausalLMOutputWithPast",
]
