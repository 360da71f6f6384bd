"""ReLU-fication: turn a dense HF Llama checkpoint into a SparseLlamaForCausalLM.

All weights are copied unchanged; only the activation changes (SiLU -> ReLU), so the converted
model is a *different function* that needs fine-tuning (with L1) to recover quality.

    python -m sfl.models.convert --src <data_dir>/smollm2-135m --out runs/smollm2-135m-relu [--l1-coeff 2e-5]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from .configuration_sparse_llama import SparseLlamaConfig
from .modeling_sparse_llama import SparseLlamaForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Keys of a saved config that describe the old class, not the architecture.
_DROP_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "dtype",
              "torch_dtype")


def sparse_config_from_llama(config: LlamaConfig, **overrides: Any) -> SparseLlamaConfig:
    """SparseLlamaConfig with the architecture of `config`, hidden_act='relu', plus overrides."""
    if config.model_type not in ("llama", SparseLlamaConfig.model_type):
        raise ValueError(f"--src must be a Llama checkpoint (model_type 'llama'), got {config.model_type!r}")
    d = {k: v for k, v in config.to_dict().items() if k not in _DROP_KEYS}
    d.update({"hidden_act": "relu", "gated_mlp": True})
    d.update(overrides)
    return SparseLlamaConfig.from_dict(d)


def relufy(dense: LlamaForCausalLM, **config_overrides: Any) -> SparseLlamaForCausalLM:
    """Copy every weight of a dense LlamaForCausalLM into a ReLU-gated SparseLlamaForCausalLM."""
    config = sparse_config_from_llama(dense.config, **config_overrides)
    dtype = next(dense.parameters()).dtype
    sparse = SparseLlamaForCausalLM(config).to(dtype)
    missing, unexpected = sparse.load_state_dict(dense.state_dict(), strict=False)
    # lm_head may be absent from either side when embeddings are tied; anything else is a bug.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"state_dict mismatch during conversion: missing={missing}, unexpected={unexpected}")
    sparse.tie_weights()
    sparse.reset_sparsity_stats()
    return sparse


def convert(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
            **config_overrides: Any) -> SparseLlamaForCausalLM:
    """Load `src`, ReLU-fy it, save to `out` (save_pretrained + the tokenizer when src has one)."""
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"--src {src} has no config.json; point it at an HF Llama checkpoint dir "
                                "(e.g. <data_dir>/smollm2-135m, made by the data prep step)")
    dense = LlamaForCausalLM.from_pretrained(src, dtype=_DTYPES[dtype])
    sparse = relufy(dense, **config_overrides)
    out.mkdir(parents=True, exist_ok=True)
    sparse.save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    except (OSError, ValueError, TypeError):
        pass  # checkpoint without tokenizer files: the model alone is still valid
    return sparse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="dense HF Llama checkpoint directory")
    p.add_argument("--out", required=True, help="output directory for the SparseLlama checkpoint")
    p.add_argument("--l1-coeff", type=float, default=0.0)
    p.add_argument("--l1-reduction", choices=("mean", "sum"), default="mean")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model = convert(args.src, args.out, dtype=args.dtype, l1_coeff=args.l1_coeff, l1_reduction=args.l1_reduction)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: SparseLlamaForCausalLM, {n:,} parameters, ReLU gate, l1_coeff={args.l1_coeff}")


if __name__ == "__main__":
    main()
