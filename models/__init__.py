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
    # save_pretrained then writes `auto_map` and copies the modelling code into the checkpoint, so
    # AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True) works in a process that never imported us
    # (the dense and reference MLPs need only torch and transformers; mlp_impl="cuda" needs `pip install -e .`).
    SparseLlamaConfig.register_for_auto_class()
    SparseLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    # lm-eval's HFLM picks its causal backend from this mapping (else it warns and guesses)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(SparseLlamaConfig.model_type, SparseLlamaForCausalLM.__name__)

    __all__ = [
        "SparseLlamaConfig",
        "SparseLlamaForCausalLM",
        "SparseLlamaModel",
        "SparseLlamaMLP",
        "SparseCausalLMOutputWithPast",
        "MLP_IMPLS",
        "L1_REDUCTIONS",
    ]
