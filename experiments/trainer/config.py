"""Training configuration: defaults, YAML + --set overrides, validation with errors that name the key.

A config is a mapping (YAML top level; `kernel:` nests KernelConfig fields). Every accepted key is in DEFAULTS
below with a one-line description in DOCS; experiments/README.md ("train.py config") documents the same set.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
from pathlib import Path
from typing import Any

import yaml

from sfl.kernels.config import KernelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

# key: (default, description)
_SPEC: dict[str, tuple[Any, str]] = {
    # --- model
    "init_from": (None, "null = random init from the arch keys; else an HF checkpoint dir "
                        "(SparseLlama, or a dense Llama which is ReLU-fied on load)"),
    "vocab_size": (None, "null = data meta.json vocab_size"),
    "hidden_size": (128, "model width K"),
    "intermediate_size": (512, "FFN width N"),
    "num_hidden_layers": (4, "layers"),
    "num_attention_heads": (4, "attention heads"),
    "num_key_value_heads": (None, "null = num_attention_heads"),
    "max_position_embeddings": (None, "null = seq_len"),
    "rope_theta": (10000.0, "RoPE base"),
    "rms_norm_eps": (1e-5, "RMSNorm epsilon"),
    "initializer_range": (0.02, "init std"),
    "tie_word_embeddings": (True, "tie lm_head to the input embedding"),
    "gated_mlp": (True, "gated ReLU FFN (false: non-gated ReLU FFN, no gate_proj)"),
    "activation": ("relu", "relu (sparse model) | silu (dense SiLU baseline, paper Table 3; needs mlp_impl dense)"),
    "mlp_impl": ("dense", "dense | reference | cuda (training through kernels/train_ffn.py, inference through kernels/ffn.py)"),
    "kernel": ({}, "settings of the sparse paths (reference and cuda): KernelConfig fields (kernels/config.py), "
                   "e.g. {tile_n: 256, slots: 32, train_width: 128}; {} = the measured defaults"),
    # --- sparsity
    "l1_coeff": (0.0, "L1 coefficient (>= 0); loss = CE + coeff * L1"),
    "l1_reduction": ("mean", "mean = paper Eq. 2; sum = official code (x intermediate_size)"),
    "l1_warmup_start": (0, "optimizer step at which the L1 ramp starts (coeff is 0 before)"),
    "l1_warmup_steps": (0, "linear ramp length in steps from 0 to l1_coeff (0 = no ramp)"),
    "dead_window_tokens": (None, "dead-neuron window in tokens of all ranks; null = tokens per optimizer step"),
    "dead_reinit_lambda": (0.0, "paper Eq. 6 after every step: dead gate rows <- (1-lambda) w + lambda N(0, std^2); "
                                "0 = off, the paper's ablation uses 0.1"),
    "dead_reinit_std": (0.02, "std of the re-initialisation noise"),
    # --- data
    "data_dir": (None, "prepared data dir; null = $SFL_DATA_DIR or <repo>/.data"),
    "tokens_subdir": ("tokens", "subdir of data_dir with meta.json and the uint16 .bin files"),
    "seq_len": (128, "tokens per training sequence"),
    "data_order": ("random", "random = random windows per step (may overlap) | disjoint = the corpus's non-overlapping "
                             "windows, reshuffled every epoch; both deterministic in (seed, step, rank)"),
    # --- optimisation
    "max_steps": (300, "optimizer steps"),
    "micro_batch_size": (8, "sequences per forward per rank"),
    "grad_accum": (1, "micro-batches per optimizer step"),
    "global_batch_size": (None, "sequences per optimizer step over all ranks; sets grad_accum = global_batch_size / "
                                "(micro_batch_size * WORLD_SIZE); null = use grad_accum"),
    "lr": (1e-3, "peak learning rate"),
    "min_lr": (0.0, "cosine floor (absolute)"),
    "warmup_steps": (30, "linear LR warm-up steps"),
    "betas": ([0.9, 0.95], "AdamW betas"),
    "eps": (1e-8, "AdamW eps"),
    "weight_decay": (0.1, "AdamW weight decay (matrices only; norms/biases are not decayed)"),
    "grad_clip": (1.0, "max global grad norm (0 = no clipping)"),
    # --- run
    "seed": (0, "seed for init and data sampling"),
    "device": ("auto", "auto (cuda if available) | cpu | cuda | cuda:N"),
    "precision": ("auto", "auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32"),
    "compile": (False, "wrap the model in torch.compile"),
    # --- several processes (torchrun); experiments/trainer/distributed.py
    "parallel": ("ddp", "with WORLD_SIZE > 1: ddp (replicated weights) | fsdp (FSDP2 fully_shard per decoder layer)"),
    "fsdp_mixed_precision": (False, "fsdp: bf16 parameters in forward/backward, fp32 gradient reduction "
                                    "(MixedPrecisionPolicy); master weights and AdamW state stay fp32"),
    "activation_checkpointing": (False, "recompute every decoder layer in backward (non-reentrant checkpoint)"),
    "log_every": (10, "steps between step lines in train_log.jsonl"),
    "eval_every": (100, "steps between val evaluations (0 = only at the end)"),
    "eval_batches": (8, "val micro-batches per evaluation (fixed sequential windows)"),
    "ckpt_every": (100, "steps between checkpoints (0 = only at the end)"),
    "ckpt_last": (True, "checkpoint the last step; false only for runs whose training is thrown away (throughput "
                        "runs): then the run keeps no checkpoint that ckpt_every does not ask for"),
    "out_dir": ("runs/train", "output dir (relative paths are under the repo root)"),
    "save_final": (True, "save_pretrained the final model to <out_dir>/final"),
    "ckpt_hf": (True, "also save_pretrained each checkpoint's weights into its hf/ dir (from_pretrained opens it)"),
    "progress": (True, "tqdm progress bar"),
    "max_nonfinite_skips": (3, "a step whose loss or gradient norm is not finite is skipped (weights and optimizer "
                               "state untouched); this many in a row stop the run (0 = stop at the first)"),
}
DEFAULTS: dict[str, Any] = {k: v[0] for k, v in _SPEC.items()}
DOCS: dict[str, str] = {k: v[1] for k, v in _SPEC.items()}


def arg_parser(description: str) -> argparse.ArgumentParser:
    """train.py's command line; its --help lists every config key with its default and meaning. Light (no torch):
    train.py answers --help with it before its heavy imports."""
    shown = {k: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip() for k, (v, _) in _SPEC.items()}
    kw, dw = max(map(len, shown)) + 2, max(map(len, shown.values())) + 2
    keys = "\n".join(f"  {k:<{kw}}{shown[k]:<{dw}}{doc}" for k, (_, doc) in _SPEC.items())
    p = argparse.ArgumentParser(prog="python -m sfl.experiments.trainer.train", description=description,
                                epilog=f"config keys (YAML or --set key=value), with their defaults:\n{keys}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (flat key: value); omitted = defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (YAML-typed value); repeatable")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    p.add_argument("--resume-from", metavar="step_N", type=resume_step,
                   help="continue from the checkpoint of step N (e.g. the newest finite one after a divergence); "
                        "the newer checkpoints and final/ are removed, the log cut back to that step")
    return p


def resume_step(text: str) -> int:
    """`step_N`, `step_000000N` or `N` -> N."""
    digits = text.removeprefix("step_")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected step_N or N, e.g. step_400 (a checkpoint's step)")
    return int(digits)


class ConfigError(ValueError):
    """A bad training config value; the message names the key and what to do."""


def _parse_set(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote it, "
                          "e.g. --set 'key=\"text\"'") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The YAML error in one line: what is wrong and where."""
    where = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{what} at line {where.line + 1}, column {where.column + 1}" if where is not None else what


def read_yaml(path: str | os.PathLike) -> Any:
    """A YAML config file's content; a missing, unreadable or malformed file is a ConfigError saying so."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found: check the --config path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e}): pass a readable YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML ({_yaml_problem(e)}): fix that line "
                          "(flat `key: value` lines, see experiments/README.md 'train.py config')") from None


def _check_keys(keys: list[str], where: str) -> None:
    for key in keys:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r} in {where}{hint}; see experiments/README.md "
                              "section 'train.py config' for the accepted keys")


def load_config(path: str | os.PathLike | None = None, sets: list[str] | None = None) -> dict[str, Any]:
    """Defaults <- YAML file <- --set key=value overrides, then validate and resolve paths."""
    cfg = dict(DEFAULTS)
    if path is not None:
        loaded = read_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of key: value")
        _check_keys(list(loaded), str(path))
        cfg.update(loaded)
    for item in sets or []:
        key, value = _parse_set(item)
        _check_keys([key], "--set")
        cfg[key] = value
    cfg = coerce_numbers(cfg)
    validate(cfg)
    return resolve(cfg)


FLOAT_KEYS = ("l1_coeff", "lr", "min_lr", "eps", "weight_decay", "grad_clip", "rope_theta", "rms_norm_eps",
              "initializer_range")


def _to_float(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def coerce_numbers(cfg: dict[str, Any]) -> dict[str, Any]:
    """YAML 1.1 reads `1e-3` (no dot) as a string: turn numeric strings of float keys into floats."""
    cfg = dict(cfg)
    for k in FLOAT_KEYS:
        if k in cfg:
            cfg[k] = _to_float(cfg[k])
    if isinstance(cfg.get("betas"), (list, tuple)):
        cfg["betas"] = [_to_float(b) for b in cfg["betas"]]
    return cfg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def kernel_config(cfg: dict[str, Any]) -> KernelConfig:
    """The run's kernel: block as the KernelConfig the model's sparse paths run with (ConfigError if invalid)."""
    if not isinstance(cfg["kernel"], dict):
        raise ConfigError(f"config key kernel={cfg['kernel']!r} is invalid: must be a mapping of KernelConfig "
                          "fields (kernels/config.py), e.g. {slots: 32}")
    try:
        return KernelConfig.from_dict(cfg["kernel"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key kernel={cfg['kernel']!r} is invalid: {e}") from e


def validate(cfg: dict[str, Any]) -> None:
    """Raise ConfigError naming the first invalid key. Model-level checks (tileability etc.) are
    repeated by SparseLlamaConfig when the model is built."""
    _check_keys(list(cfg), "config")
    _check_numbers(cfg)
    _check_choices_and_shapes(cfg)


def _bad(cfg: dict[str, Any], key: str, why: str) -> ConfigError:
    return ConfigError(f"config key {key}={cfg[key]!r} is invalid: {why}")


def _check_numbers(cfg: dict[str, Any]) -> None:
    """The keys that are numbers or flags, each on its own: type and range."""
    pos_int = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "seq_len",
               "max_steps", "micro_batch_size", "grad_accum", "log_every", "eval_batches"]
    for k in pos_int:
        if not _is_int(cfg[k]) or cfg[k] < 1:
            raise _bad(cfg, k, "must be a positive integer")
    for k in ["l1_warmup_start", "l1_warmup_steps", "warmup_steps", "eval_every", "ckpt_every", "seed",
              "max_nonfinite_skips"]:
        if not _is_int(cfg[k]) or cfg[k] < 0:
            raise _bad(cfg, k, "must be an integer >= 0")
    if cfg["seed"] >= 2**32:  # numpy's global seed is 32-bit
        raise _bad(cfg, "seed", "must be < 2**32 (4294967296)")
    for k in ["vocab_size", "num_key_value_heads", "max_position_embeddings", "dead_window_tokens",
              "global_batch_size"]:
        if cfg[k] is not None and (not _is_int(cfg[k]) or cfg[k] < 1):
            raise _bad(cfg, k, "must be null or a positive integer")
    for k in ["l1_coeff", "lr", "min_lr", "eps", "weight_decay", "grad_clip"]:
        if not _is_num(cfg[k]) or cfg[k] < 0:
            raise _bad(cfg, k, "must be a finite number >= 0")
    for k in ["rope_theta", "rms_norm_eps", "initializer_range"]:
        if not _is_num(cfg[k]) or cfg[k] <= 0:
            raise _bad(cfg, k, "must be a finite number > 0")
    if cfg["lr"] <= 0:
        raise _bad(cfg, "lr", "must be > 0")
    if cfg["min_lr"] > cfg["lr"]:
        raise _bad(cfg, "min_lr", f"must be <= lr ({cfg['lr']})")
    betas = cfg["betas"]
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_num(b) and 0 <= b < 1 for b in betas)):
        raise _bad(cfg, "betas", "must be a list of two numbers in [0, 1), e.g. [0.9, 0.95]")
    for k in ["tie_word_embeddings", "gated_mlp", "compile", "save_final", "ckpt_last", "ckpt_hf", "progress", "fsdp_mixed_precision",
              "activation_checkpointing"]:
        if not isinstance(cfg[k], bool):
            raise _bad(cfg, k, "must be true or false")
    if not _is_num(cfg["dead_reinit_lambda"]) or not 0 <= cfg["dead_reinit_lambda"] <= 1:
        raise _bad(cfg, "dead_reinit_lambda", "must be a number in [0, 1] (0 = off; the paper uses 0.1)")
    if not _is_num(cfg["dead_reinit_std"]) or cfg["dead_reinit_std"] <= 0:
        raise _bad(cfg, "dead_reinit_std", "must be a finite number > 0")


def _check_choices_and_shapes(cfg: dict[str, Any]) -> None:
    """The keys with a fixed set of values, the paths, and the keys that must agree with each other."""
    if cfg["l1_reduction"] not in ("mean", "sum"):
        raise _bad(cfg, "l1_reduction", "must be 'mean' (paper Eq. 2) or 'sum' (official code)")
    if cfg["activation"] not in ("relu", "silu"):
        raise _bad(cfg, "activation", "must be relu or silu")
    if cfg["activation"] != "relu" and cfg["mlp_impl"] != "dense":
        raise _bad(cfg, "activation", "silu runs only with mlp_impl: dense")
    if cfg["mlp_impl"] not in ("dense", "reference", "cuda"):
        raise _bad(cfg, "mlp_impl", "must be one of dense, reference, cuda")
    if cfg["mlp_impl"] == "cuda" and str(cfg["device"]) == "cpu":
        raise _bad(cfg, "mlp_impl", "the cuda kernels need device cuda (or auto on a GPU machine); on CPU train with "
                                    "mlp_impl: dense (or reference)")
    kernel = kernel_config(cfg)
    if cfg["mlp_impl"] != "dense" and cfg["init_from"] is None and cfg["intermediate_size"] % kernel.tile_n:
        raise _bad(cfg, "intermediate_size", f"mlp_impl={cfg['mlp_impl']} needs a multiple of the kernel "
                                             f"tile_n={kernel.tile_n}; change either, or use mlp_impl: dense")
    if cfg["hidden_size"] % cfg["num_attention_heads"] != 0:
        raise _bad(cfg, "num_attention_heads", f"must divide hidden_size ({cfg['hidden_size']})")
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["init_from"] is None and head_dim % 2:  # RoPE rotates pairs of channels
        raise _bad(cfg, "num_attention_heads", f"gives head_dim = hidden_size / num_attention_heads = {head_dim}, "
                                               "which RoPE needs even; change hidden_size or num_attention_heads")
    kv = cfg["num_key_value_heads"]
    if kv is not None and cfg["num_attention_heads"] % kv != 0:
        raise _bad(cfg, "num_key_value_heads", f"must divide num_attention_heads ({cfg['num_attention_heads']})")
    mpe = cfg["max_position_embeddings"]
    if mpe is not None and mpe < cfg["seq_len"]:
        raise _bad(cfg, "max_position_embeddings", f"must be >= seq_len ({cfg['seq_len']})")
    if cfg["warmup_steps"] > cfg["max_steps"]:
        raise _bad(cfg, "warmup_steps", f"must be <= max_steps ({cfg['max_steps']})")
    if not (cfg["device"] in ("auto", "cpu", "cuda") or str(cfg["device"]).startswith("cuda:")):
        raise _bad(cfg, "device", "must be auto, cpu, cuda or cuda:N")
    if cfg["parallel"] not in ("ddp", "fsdp"):
        raise _bad(cfg, "parallel", "must be ddp or fsdp")
    if cfg["fsdp_mixed_precision"] and cfg["parallel"] != "fsdp":
        raise _bad(cfg, "fsdp_mixed_precision", "needs parallel: fsdp")
    if cfg["data_order"] not in ("random", "disjoint"):
        raise _bad(cfg, "data_order", "must be random or disjoint")
    if cfg["global_batch_size"] is not None and cfg["global_batch_size"] % cfg["micro_batch_size"]:
        raise _bad(cfg, "global_batch_size", f"must be a multiple of micro_batch_size ({cfg['micro_batch_size']})")
    if cfg["precision"] not in ("auto", "bf16", "fp32"):
        raise _bad(cfg, "precision", "must be auto, bf16 or fp32")
    for k in ["init_from", "data_dir"]:
        if cfg[k] is not None and not isinstance(cfg[k], str):
            raise _bad(cfg, k, "must be null or a path string")
    if not isinstance(cfg["tokens_subdir"], str) or not cfg["tokens_subdir"]:
        raise _bad(cfg, "tokens_subdir", "must be a non-empty path string (a subdir of data_dir), e.g. tokens")
    if not isinstance(cfg["out_dir"], str) or not cfg["out_dir"]:
        raise _bad(cfg, "out_dir", "must be a non-empty path string")


def _abs(p: str) -> str:
    path = Path(os.path.expandvars(os.path.expanduser(p)))
    return str(path if path.is_absolute() else (REPO_ROOT / path))


def resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill path defaults (data_dir from $SFL_DATA_DIR or <repo>/.data) and make paths absolute."""
    cfg = dict(cfg)
    cfg["betas"] = [float(b) for b in cfg["betas"]]
    if cfg["data_dir"] is None:
        cfg["data_dir"] = os.environ.get("SFL_DATA_DIR") or str(REPO_ROOT / ".data")
    cfg["data_dir"] = _abs(cfg["data_dir"])
    cfg["out_dir"] = _abs(cfg["out_dir"])
    if cfg["init_from"] is not None:
        cfg["init_from"] = _abs(cfg["init_from"])
    return cfg


def l1_coeff_at(cfg: dict[str, Any], step: int) -> float:
    """L1 coefficient for optimizer step `step` (0-based): 0 before l1_warmup_start, then a linear
    ramp reaching l1_coeff after l1_warmup_steps steps."""
    start, ramp = cfg["l1_warmup_start"], cfg["l1_warmup_steps"]
    if step < start:
        return 0.0
    if ramp == 0:
        return float(cfg["l1_coeff"])
    return float(cfg["l1_coeff"]) * min(1.0, (step - start + 1) / ramp)


def lr_at(cfg: dict[str, Any], step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up to lr over warmup_steps,
    then cosine decay to min_lr at max_steps."""
    lr, min_lr, warm, total = cfg["lr"], cfg["min_lr"], cfg["warmup_steps"], cfg["max_steps"]
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))
