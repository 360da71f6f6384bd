"""Start-up checks of a training run: everything that can be known before step 1 is checked before it.

A run that cannot finish must fail in its first seconds, not after training: the kernels the
chosen `mlp_impl` needs on the chosen device, and the disk space its checkpoints and final model take.
The data checks (shards, checksums, val windows) live with the data (experiments/trainer/data_loader.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from sfl.kernels.loader import KernelUnavailableError, load_twell

from .checkpoint import KEEP as CKPT_KEEP
from .config import ConfigError


def check_kernels(mlp_impl: str, device: torch.device, device_key: str) -> None:
    """Refuse an `mlp_impl` whose kernels cannot run on `device`.

    mlp_impl 'cuda' trains through kernels/train_ffn.py (exact torch fallback where its extension is missing)
    but evaluates through the inference kernels of kernels/ffn.py, which need a CUDA device and a built
    extension: both are checked here, so a run never trains to its end and then fails in the final eval.
    """
    if mlp_impl != "cuda":
        return  # dense and reference are plain PyTorch: any device
    if device.type != "cuda":
        why = ("no CUDA GPU is visible, so device: auto resolved to cpu" if device_key == "auto"
               else f"device={device_key!r}")
        raise ConfigError(f"config key mlp_impl='cuda' needs a CUDA GPU but {why}; on this machine train with "
                          "mlp_impl: dense (or reference, the slow pure-PyTorch TwELL path)")
    try:
        load_twell()
    except KernelUnavailableError as e:
        raise ConfigError(f"config key mlp_impl='cuda': the TwELL inference kernels the evaluations run through "
                          f"cannot be loaded here ({e}); use mlp_impl: dense (or reference)") from None


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """Estimated size of one training checkpoint: fp32 weights + AdamW's two moments + buffers."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 3 * params + buffers


def final_model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path` (its nearest existing ancestor)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def planned_checkpoints(cfg: dict) -> int:
    """How many checkpoints a run from step 0 writes: every ckpt_every steps before the last, then the last one."""
    every = (cfg["max_steps"] - 1) // cfg["ckpt_every"] if cfg["ckpt_every"] else 0
    return every + (1 if cfg["ckpt_last"] else 0)


def check_disk_space(out_dir: Path, model: torch.nn.Module, n_existing: int, save_final: bool,
                     ckpt_hf: bool = False, n_planned: int = CKPT_KEEP + 1) -> None:
    """Refuse a run whose next checkpoints and final model do not fit on out_dir's filesystem.

    Peak use while saving is the kept checkpoints plus the one being written, plus the final model and its
    temp copy; what already exists is subtracted. A full disk later (other writers) is still reported
    clearly by the checkpoint writer, with the previous checkpoint intact.
    """
    ckpt = checkpoint_bytes(model) + (final_model_bytes(model) if ckpt_hf else 0)  # + its save_pretrained copy
    n_ckpt = min(n_planned, max(1, CKPT_KEEP + 1 - n_existing))  # at most CKPT_KEEP kept + 1 being written
    need = ckpt * n_ckpt + (2 * final_model_bytes(model) if save_final else 0)
    free = free_bytes(out_dir)
    if free < need:
        mib = 2 ** 20
        raise ConfigError(f"out_dir={str(out_dir)!r}: {free / mib:.0f} MiB free on its filesystem, but this run "
                          f"needs about {need / mib:.0f} MiB for {n_ckpt} checkpoint(s) of {ckpt / mib:.0f} MiB "
                          f"at once{' and its final model' if save_final else ''}; free space or choose another "
                          "out_dir")
