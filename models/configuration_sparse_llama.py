"""SparseLlamaConfig: a LlamaConfig with a ReLU FFN and the sparsity knobs of the paper.

Every sparsity field is checked when the config is built (and again by `check_sparsity_fields()`,
which callers run after mutating a config), so a bad value fails at start-up with a message that
names the field instead of surfacing as a shape error deep inside a kernel.
"""
from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

try:  # the installed project; a checkpoint's copy of this file (transformers' custom code) has a copy beside it
    from sfl.kernels.config import TILE_N, KernelConfig
except ModuleNotFoundError as e:
    if e.name != "sfl":
        raise
    from .kernel_config import TILE_N, KernelConfig

MLP_IMPLS = ("dense", "reference", "cuda")
ACTIVATIONS = ("relu", "silu")  # silu only for the dense SiLU baseline (paper Table 3)
L1_REDUCTIONS = ("mean", "sum")
# Fields of earlier versions, now KernelConfig fields: a saved config.json that has them is read into kernel_config.
LEGACY_KERNEL_FIELDS = {"twell_tile_n": "tile_n", "twell_slots": "slots", "twell_mode": "mode"}


class SparseLlamaConfig(LlamaConfig):
    r"""Llama architecture whose MLP is ReLU-gated (or non-gated ReLU) and L1-regularised.

    Extra fields (all saved in config.json):
        gated_mlp: True -> h = relu(x Wg^T) * (x Wu^T); False -> h = relu(x Wu^T) (no gate_proj).
        l1_coeff: weight of the L1 activation penalty added to the CE loss (>= 0).
        l1_reduction: "mean" = paper Eq. 2 (mean |h| over tokens x neurons, then mean over layers);
            "sum" = the official code's variant (sum over neurons, mean over tokens, mean over
            layers), i.e. exactly intermediate_size times larger.
        mlp_impl: "dense" (three F.linear), "reference" (pure-PyTorch TwELL path in
            kernels.reference, exact, slow) or "cuda" (TwELL kernels: kernels.ffn for inference,
            kernels.train_ffn for training).
        kernel_config: the sparse paths' settings (sfl.kernels.config.KernelConfig fields, as a dict; None =
            defaults; a run's YAML kernel: block). The reference and the CUDA kernels read the same fields
            (tile_n, slots, mode, ...) through `get_kernel_config()`.
        hot_neurons: per layer, the number of leading neurons computed as dense GEMMs in sparse calls
            (KernelConfig.hot_neurons: multiples of 256, below intermediate_size; None = 0 everywhere). Set by
            SparseLlamaForCausalLM.order_hot_neurons_, which also puts each layer's most frequently firing neurons
            first (the weights are saved in that order).
        track_sparsity_stats: accumulate non-zeros per token on the device (read by sparsity_stats()); a model
            compiled with torch.compile keeps them on for mlp_impl="cuda" (see kernels/sparse_llama_mlp.py).
            False with mlp_impl="dense" and l1_coeff 0: no statistics at all (no counts, no dead-neuron tracker,
            no L1 value): the MLP runs HF LlamaMLP's ops, the paper's uninstrumented dense baseline.
        dead_window_tokens: a neuron counts as dead when it has not fired in this many most recent
            training tokens (paper: one optimiser step, ~2^20 tokens).
    hidden_act is "relu" (the sparse model) or "silu" (dense SiLU baseline of paper Table 3: same
    architecture, mlp_impl must be "dense"; its activations are not sparse).
    """

    model_type = "sparse_llama"

    hidden_act: str = "relu"
    gated_mlp: bool = True
    l1_coeff: float = 0.0
    l1_reduction: str = "mean"
    mlp_impl: str = "dense"
    dead_window_tokens: int = 1_048_576
    kernel_config: dict | None = None
    hot_neurons: list | None = None
    track_sparsity_stats: bool = True

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "kernel_config" and isinstance(value, KernelConfig):  # kept as a dict: configs are saved as JSON
            value = value.to_dict()
        super().__setattr__(key, value)

    def __post_init__(self, **kwargs):
        legacy = {new: kwargs.pop(old) for old, new in LEGACY_KERNEL_FIELDS.items() if old in kwargs}
        if legacy:  # a config.json of an earlier version: its TwELL fields, unless kernel_config sets them
            self.kernel_config = {**legacy, **(self.kernel_config or {})}
        super().__post_init__(**kwargs)
        self.check_sparsity_fields()

    def check_sparsity_fields(self) -> None:
        """Raise ValueError naming the offending field if any sparsity setting is invalid."""

        def bad(field: str, value: object, why: str) -> ValueError:
            return ValueError(f"SparseLlamaConfig.{field}={value!r} is invalid: {why}")

        if self.hidden_act not in ACTIVATIONS:
            raise bad("hidden_act", self.hidden_act,
                      f"must be one of {ACTIVATIONS} (convert other checkpoints with `python -m sfl.models.convert`)")
        if self.hidden_act != "relu" and self.mlp_impl != "dense":
            raise bad("hidden_act", self.hidden_act,
                      f"mlp_impl={self.mlp_impl!r} computes ReLU FFNs only; use hidden_act='relu' or mlp_impl='dense'")
        if not isinstance(self.gated_mlp, bool):
            raise bad("gated_mlp", self.gated_mlp, "must be a bool")
        if isinstance(self.l1_coeff, bool) or not isinstance(self.l1_coeff, (int, float)):
            raise bad("l1_coeff", self.l1_coeff, "must be a number >= 0")
        if not self.l1_coeff >= 0:  # also rejects NaN
            raise bad("l1_coeff", self.l1_coeff, "must be >= 0 (0 disables the L1 penalty)")
        if self.l1_reduction not in L1_REDUCTIONS:
            raise bad("l1_reduction", self.l1_reduction, f"must be one of {L1_REDUCTIONS}")
        if self.mlp_impl not in MLP_IMPLS:
            raise bad("mlp_impl", self.mlp_impl, f"must be one of {MLP_IMPLS}")
        if isinstance(self.dead_window_tokens, bool) or not isinstance(self.dead_window_tokens, int) or \
                self.dead_window_tokens < 1:
            raise bad("dead_window_tokens", self.dead_window_tokens, "must be a positive integer")
        if not isinstance(self.track_sparsity_stats, bool):
            raise bad("track_sparsity_stats", self.track_sparsity_stats, "must be a bool")
        if self.hot_neurons is not None:
            hot = self.hot_neurons
            if not isinstance(hot, (list, tuple)) or len(hot) != self.num_hidden_layers or any(
                    isinstance(h, bool) or not isinstance(h, int) or h < 0 or h % 256 or h >= self.intermediate_size
                    for h in hot):
                raise bad("hot_neurons", hot, f"must be a list of {self.num_hidden_layers} (one per layer) multiples "
                          f"of 256 below intermediate_size={self.intermediate_size}, or None")
        try:
            kc = self.get_kernel_config()
        except (TypeError, ValueError) as e:
            raise bad("kernel_config", self.kernel_config, str(e)) from e
        if self.mlp_impl == "cuda" and kc.tile_n != TILE_N:
            raise bad("kernel_config", self.kernel_config,
                      f"the CUDA kernels are built for tile_n={TILE_N}; use it, or mlp_impl='reference'")
        if self.mlp_impl != "dense":
            if self.intermediate_size % kc.tile_n != 0:
                raise bad("intermediate_size", self.intermediate_size,
                          f"mlp_impl={self.mlp_impl!r} needs intermediate_size to be a multiple of "
                          f"kernel_config tile_n={kc.tile_n}; change one of them or use mlp_impl='dense'")
            if self.mlp_bias:
                raise bad("mlp_bias", self.mlp_bias,
                          f"mlp_impl={self.mlp_impl!r} has no bias support; use mlp_impl='dense'")

    def get_kernel_config(self, layer: int | None = None) -> KernelConfig:
        """The KernelConfig the sparse paths run with: kernel_config; for a layer, with that layer's hot_neurons
        when they are set."""
        d = dict(self.kernel_config or {})
        if layer is not None and self.hot_neurons is not None:
            d["hot_neurons"] = int(self.hot_neurons[layer])
        return KernelConfig.from_dict(d)


__all__ = ["SparseLlamaConfig", "MLP_IMPLS", "L1_REDUCTIONS", "ACTIVATIONS"]
