"""Sparse Llama models. Importing this package registers "sparse_llama" with the Auto classes,
so AutoConfig / AutoModel / AutoModelForCausalLM.from_pretrained (and lm-eval's HFLM) load it."""

if __name__ == "models":  # imported by the bare name from a checkout: not this package (sfl/_shadow.py says why)
    from sfl._shadow import defer_to_installed

    defer_to_installed(__name__)
else:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_sparse_llama import L1_REDUCTIONS, MLP_IMPLS, SparseLlamaConfig
    from .modeling_sparse_llama import (
        SparseCausalLMOutputWithPast,
        SparseLlamaForCausalLM,
        SparseLlamaMLP,
        SparseLlamaModel,
    )

    AutoConfig.register(SparseLlamaConfig.model_type, SparseLlamaConfig, exist_ok=True)
    AutoModel.register(SparseLlamaConfig, SparseLlamaModel, exist_ok=True)
    AutoModelForCausalLM.register(SparseLlamaConfig, SparseLlamaForCausalLM, exist_ok=True)

    __all__ = [
        "SparseLlamaConfig",
        "SparseLlamaForCausalLM",
        "SparseLlamaModel",
        "SparseLlamaMLP",
        "SparseCausalLMOutputWithPast",
        "MLP_IMPLS",
        "L1_REDUCTIONS",
    ]
