"""The one training entry point: SparseLlama (ReLU FFN + L1) language-model training.

    python -m sfl.experiments.trainer.train --config path.yaml [--set key=value ...] [--resume | --resume-from step_N]
    torchrun --nproc_per_node=N -m sfl.experiments.trainer.train --config path.yaml   # DDP, or FSDP2 with parallel: fsdp

Config keys: `--help` lists them with their defaults (experiments/trainer/config.py; experiments/README.md "train.py config").
Writes <out_dir>/train_log.jsonl (schema: experiments/README.md), crash-safe
checkpoints under <out_dir>/checkpoints (exact resume with --resume; each with a save_pretrained copy in hf/)
and <out_dir>/final (save_pretrained, loadable by experiments/trainer/evaluate.py after `import sfl.models`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .config import ConfigError, arg_parser, l1_coeff_at, load_config, lr_at

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

if __name__ == "__main__" and any(a == "-h" or a.startswith("--h") for a in sys.argv[1:]):
    arg_parser(__doc__).parse_args()  # prints the config keys and exits, before torch and transformers load (~15 s)

# The heavy imports come after the --help check above (E402 on purpose).
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

from .checkpoint import (HF_SUBDIR, RunWriteError, atomic_write_text, ckpt_root, clean_torn_checkpoints,  # noqa: E402
                         find_latest, list_checkpoints, load_checkpoint, os_error_of, remove_dir, write_failure,
                         write_pretrained)
from .data_loader import DataError, TokenData  # noqa: E402
# several processes (torchrun): wrapping, cross-rank statistics, DCP checkpoints -- see experiments/trainer/distributed.py
from .distributed import (Dist, accumulation_context, clip_grad_norm, eval_path, gather_trackers,  # noqa: E402
                          global_sparsity_stats, is_sharded, load_model_and_optimizer, local_dead_window, reinit_dead,
                          resolve_grad_accum, restore_trackers, resume_config_view, save_checkpoint_dcp,
                          unsharded_copy, wrap_model)
from .preflight import check_disk_space, check_kernels, planned_checkpoints  # noqa: E402
from .provenance import collect  # noqa: E402
from .rundir import RunDirError, RunLock, clean_stale_temps, tmp_name  # noqa: E402
from .runs import read_rows  # noqa: E402
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM  # noqa: E402
from sfl.models.convert import relufy  # noqa: E402

# Keys that may change between a checkpoint and its resumption without breaking exactness.
RESUME_MUTABLE = {"max_steps", "log_every", "eval_every", "eval_batches", "ckpt_every", "ckpt_last", "progress", "device",
                  "save_final", "ckpt_hf", "compile", "out_dir", "data_dir", "init_from", "parallel",
                  "activation_checkpointing", "max_nonfinite_skips"}


class TrainingDiverged(RuntimeError):
    """Non-finite losses or gradients the run cannot step past; no checkpoint with non-finite weights exists."""


# --------------------------------------------------------------------------------------- setup
def pick_device(cfg: dict[str, Any], d: Dist) -> torch.device:
    want = cfg["device"]
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"config key device={cfg['device']!r}: CUDA is not available; use device: cpu")
        dev = torch.device(f"cuda:{d.local_rank}") if want == "cuda" else torch.device(want)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def autocast_ctx(cfg: dict[str, Any], device: torch.device) -> contextlib.AbstractContextManager:
    prec = cfg["precision"]
    if prec == "auto":
        prec = "bf16" if device.type == "cuda" else "fp32"
    if prec == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def build_model(cfg: dict[str, Any], data_vocab: int, eos_id: int | None, dead_window: int) -> SparseLlamaForCausalLM:
    """Scratch model from the arch keys, or init_from a checkpoint (dense Llama is ReLU-fied)."""
    sparsity = dict(hidden_act=cfg["activation"], l1_coeff=float(cfg["l1_coeff"]), l1_reduction=cfg["l1_reduction"], mlp_impl=cfg["mlp_impl"],
                    kernel_config=dict(cfg["kernel"]) or None, dead_window_tokens=dead_window)
    if cfg["init_from"] is None:
        vocab = cfg["vocab_size"] or data_vocab
        config = SparseLlamaConfig(
            vocab_size=vocab, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"] or cfg["num_attention_heads"],
            max_position_embeddings=cfg["max_position_embeddings"] or cfg["seq_len"],
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rope_theta"])},
            rms_norm_eps=float(cfg["rms_norm_eps"]), initializer_range=float(cfg["initializer_range"]),
            tie_word_embeddings=cfg["tie_word_embeddings"], gated_mlp=cfg["gated_mlp"],
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None, **sparsity)
        model = SparseLlamaForCausalLM(config)
    else:
        src = Path(cfg["init_from"])
        if not (src / "config.json").is_file():
            raise ConfigError(f"config key init_from={str(src)!r}: no config.json there")
        model_type = json.loads((src / "config.json").read_text()).get("model_type")
        if model_type == "llama":
            model = relufy(LlamaForCausalLM.from_pretrained(src, dtype=torch.float32), **sparsity)
        elif model_type == SparseLlamaConfig.model_type:
            # config kwargs are applied before the model is built (and validated there)
            model = SparseLlamaForCausalLM.from_pretrained(src, dtype=torch.float32, **sparsity)
        else:
            raise ConfigError(f"config key init_from: model_type {model_type!r} unsupported (llama or sparse_llama)")
        vocab = model.config.vocab_size
        if model.config.max_position_embeddings < cfg["seq_len"]:
            raise ConfigError(f"config key seq_len={cfg['seq_len']} exceeds the checkpoint's "
                              f"max_position_embeddings={model.config.max_position_embeddings}")
    if vocab < data_vocab:
        raise ConfigError(f"config key vocab_size={vocab} is smaller than the data's vocab_size={data_vocab}")
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linear weights, embeddings); not norms or biases (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------------------- logging
class JsonlLog:
    """Append-only JSONL writer (rank 0 only). `lines` counts the lines in the file: a checkpoint records it,
    and a resume keeps exactly that many (`truncate_log`)."""

    def __init__(self, path: Path, enabled: bool, lines: int = 0) -> None:
        self.path, self.enabled, self.lines = path, enabled, lines
        self._f = open(path, "a") if enabled else None

    def write(self, obj: dict[str, Any]) -> None:
        if self._f is not None:
            try:
                self._f.write(json.dumps(obj) + "\n")
                self._f.flush()
            except OSError as e:
                self._fail(e)
            self.lines += 1

    def sync(self) -> None:
        if self._f is not None:
            try:
                os.fsync(self._f.fileno())
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError) -> None:
        """Stop on a failed write (a full disk above all); a resume cuts the torn line off (`truncate_log`)."""
        with contextlib.suppress(OSError):
            self._f.close()  # its flush fails again; the file is closed all the same
        self._f = None
        raise write_failure(e, f"the training log {self.path}", self.path.parent) from e

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def truncate_log(path: Path, step: int, keep_lines: int | None = None) -> int:
    """Cut the log back to what it held when the checkpoint being resumed was written, so the resumed run
    writes every later line (steps, evals, the final eval and 'final' line) exactly once. Returns the number
    of lines kept.

    `keep_lines` is the line count the checkpoint recorded (the log is fsynced before every save, so those
    lines are complete). Checkpoints written before it was recorded fall back to dropping the lines whose
    step is after `step`, and any 'final' line. Runs under the run lock, so no other process has the file open.
    """
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    if keep_lines is not None:
        kept = lines[:keep_lines]
    else:
        kept = []
        for line in lines:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the kill
            if obj.get("type") == "final" or obj.get("step", -1) > step:
                continue
            kept.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in kept))
    return len(kept)


def optimizer_step(fwd_model: torch.nn.Module, batch: torch.Tensor, cfg: dict[str, Any], coeff: float,
                   device: torch.device, params: list[torch.nn.Parameter], clip: float,
                   opt: torch.optim.Optimizer, sched: Any | None,
                   d: Dist | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step over `batch` ([micro_batch_size * grad_accum, seq_len + 1] windows): forward with the L1
    term under the run's autocast, backward per micro-batch, gradient clipping, AdamW, the LR schedule. Returns the
    summed (loss, ce, l1) of the micro-batches and the pre-clip gradient norm as device tensors, and whether AdamW
    stepped: a non-finite loss or gradient norm (on any rank of `d`) skips the update, as AMP's scaler does,
    leaving weights and optimizer state as they were. That check is the step's one host sync.
    experiments/speed/train_throughput.py times this very function."""
    mbs, accum = cfg["micro_batch_size"], cfg["grad_accum"]
    sums = torch.zeros(3, device=device)
    for i in range(accum):
        x = batch[i * mbs:(i + 1) * mbs].to(device, non_blocking=True)
        with accumulation_context(fwd_model, last=i == accum - 1), autocast_ctx(cfg, device):
            out = fwd_model(input_ids=x[:, :-1], shift_labels=x[:, 1:], l1_coeff=coeff, use_cache=False)
            (out.loss / accum).backward()
        l1 = out.l1.detach() if out.l1 is not None else torch.zeros((), device=device)
        sums += torch.stack([out.loss.detach().float(), out.ce.detach().float(), l1.float()])
    grad_norm = clip_grad_norm(params, clip)
    bad = (~torch.isfinite(torch.stack([sums[0], grad_norm.float()]))).any().float()
    if d is not None:
        bad = d.all_sum(bad)  # the ranks' losses differ: they must agree on skipping
    stepped = not bool(bad.item())
    if stepped:
        opt.step()
    if sched is not None:
        with warnings.catch_warnings():  # a skipped first update is intended, not the call-order mistake torch warns of
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            sched.step()  # the schedule follows the step count, skipped steps included
    opt.zero_grad(set_to_none=True)
    return sums, grad_norm, stepped


def weights_finite(model: torch.nn.Module, d: Dist) -> bool:
    """Whether every parameter entry is finite, on all ranks (FSDP2: each checks its shards)."""
    bad = torch.zeros((), device=next(model.parameters()).device)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        bad += (~torch.isfinite(local.detach())).any()
    return not bool(d.all_sum(bad).item())


# --------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model: SparseLlamaForCausalLM, windows: torch.Tensor, cfg: dict[str, Any], device: torch.device,
             d: Dist, window: int) -> tuple[float, float]:
    """Mean val CE over the fixed val windows (sharded over ranks) and mean nnz per token, both over all ranks."""
    was_training = model.training
    model.eval()
    model.reset_sparsity_stats(dead_tracker=False)
    mbs = cfg["micro_batch_size"]
    starts = list(range(0, len(windows), mbs))
    tot = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token CE, token count
    counted = None  # per-layer stats before a padding forward
    for r in range(-(-len(starts) // d.world)):  # every rank runs as many forwards (FSDP gathers in each)
        j = r * d.world + d.rank
        if j >= len(starts) and counted is None:
            counted = [m.sparsity_stats() for m in model.sparse_mlps()]
        x = windows[starts[j if j < len(starts) else 0]:][:mbs].to(device)
        with autocast_ctx(cfg, device), eval_path(model):
            out = model(input_ids=x[:, :-1], shift_labels=x[:, 1:])
        if j < len(starts):
            n = x[:, 1:].numel()
            tot += torch.stack([out.ce.double() * n, torch.tensor(float(n), dtype=torch.float64, device=device)])
    tot = d.all_sum(tot)
    nnz = global_sparsity_stats(model, d, window, local=counted)["nnz_mean"]
    model.reset_sparsity_stats(dead_tracker=False)
    model.train(was_training)
    return float(tot[0] / tot[1]), nnz


# --------------------------------------------------------------------------------------- train
def check_resume_config(saved: dict[str, Any], cfg: dict[str, Any]) -> None:
    diff = sorted(k for k in cfg if k not in RESUME_MUTABLE and saved.get(k) != cfg[k])
    if diff:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {cfg[k]!r}" for k in diff)
        raise ConfigError(f"--resume with a config that changes {details}; only {sorted(RESUME_MUTABLE)} may "
                          "change on resume (start a new out_dir otherwise)")


def rank0_check(d: Dist, fn: Callable[[], Any]) -> Any:
    """fn() on rank 0 only (a check that reads every shard or the disk once); its ConfigError or DataError
    stops every rank (the others would wait in the next collective). Returns fn's result on rank 0."""
    result, err = None, None
    if d.main:
        try:
            result = fn()
        except (ConfigError, DataError) as e:
            err = e
    if d.world > 1:
        msg = d.broadcast(None if err is None else (isinstance(err, DataError), str(err)))
        if msg is not None and err is None:
            err = (DataError if msg[0] else ConfigError)(f"on rank 0: {msg[1]}")
    if err is not None:
        raise err
    return result


def finished_run(out_dir: Path, cfg: dict[str, Any], world: int = 1) -> dict[str, Any] | None:
    """The log's 'final' line if the run in out_dir is finished at this config's max_steps (its newest
    checkpoint is at that step and the final line was written after it), else None. A config that the run
    could not be resumed with is refused (ConfigError) as on any resume."""
    ckpt = find_latest(out_dir)
    rows = read_rows(out_dir / "train_log.jsonl")
    final = next((r for r in reversed(rows) if r.get("type") == "final"), None)
    if ckpt is None or final is None or not (checkpoint_step(ckpt) == final.get("step") == cfg["max_steps"]):
        return None
    saved = load_checkpoint(ckpt, model=False)
    now = {**cfg, "grad_accum": resolve_grad_accum(cfg, world)}
    check_resume_config(saved["config"], resume_config_view(saved["config"], saved.get("world_size", 1), now, world))
    return final


def checkpoint_step(ckpt_dir: Path) -> int:
    return int(ckpt_dir.name.split("_")[1])


def checkpoint_names(out_dir: Path) -> str:
    return ", ".join(c.name for c in list_checkpoints(out_dir)) or "none"


def pick_checkpoint(out_dir: Path, step: int | None) -> Path | None:
    """The checkpoint a resume starts from: the newest, or that of `step` (ConfigError if there is none)."""
    if step is None:
        return find_latest(out_dir)
    want = next((c for c in list_checkpoints(out_dir) if checkpoint_step(c) == step), None)
    if want is None:
        raise ConfigError(f"--resume-from {step}: {out_dir} has no complete checkpoint of step {step}; "
                          f"the checkpoints there: {checkpoint_names(out_dir)}")
    return want


def drop_newer_than(out_dir: Path, step: int) -> None:
    """--resume-from an older checkpoint: the newer ones and final/ belong to the abandoned continuation."""
    doomed = [c for c in list_checkpoints(out_dir) if checkpoint_step(c) > step]
    if (out_dir / "final").is_dir():
        doomed.append(out_dir / "final")
    for path in doomed:
        remove_dir(path)
        print(f"--resume-from {step}: removed {path} (written after step {step})", file=sys.stderr)


def check_tokenizer(tokenizer_dir: Path) -> None:
    """The data dir's tokenizer loads (it is saved beside every model): a DataError now, not at the first save."""
    if not tokenizer_dir.is_dir():
        return
    try:
        AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # a corrupt tokenizer.json surfaces as any of several library errors
        raise DataError(f"the tokenizer in {tokenizer_dir} does not load ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); rebuild it with `python -m sfl.data.prepare "
                        f"--only tokenizer --data-dir {tokenizer_dir.parent} --force`, or set save_final and ckpt_hf "
                        "to false") from None


def check_data_unchanged(data: TokenData, out_dir: Path, step: int) -> None:
    """DataError if a shard is no longer the file verified at start (run at every log line and before every
    checkpoint, so no checkpoint is written from batches of a changed shard)."""
    why = data.changed_since_verified()
    if why is not None:
        latest = find_latest(out_dir)
        since = f"checkpoint {latest.name}" if latest is not None else "the start"
        raise DataError(f"{why} during the run (seen at step {step}); the batches since the previous check may hold "
                        f"the changed data, and no checkpoint was written from them. Restore the file and rerun "
                        f"with --resume (it continues from {since}), or start a new out_dir on the new data")


def diverged_advice(out_dir: Path) -> str:
    latest = find_latest(out_dir)
    kept = (f"the newest checkpoint, {latest.name}, holds finite weights" if latest is not None
            else "no checkpoint was written")
    return (f"{kept}. Lower lr (or l1_coeff) and start a new out_dir, or resume an earlier state "
            "with --resume-from STEP")


def note_skip(log: JsonlLog, d: Dist, cfg: dict[str, Any], out_dir: Path, step: int, mean: torch.Tensor,
              grad_norm: torch.Tensor, n_skips: int) -> None:
    """Log a skipped update (non-finite loss or gradient norm); stop after max_nonfinite_skips in a row."""
    loss, ce, l1v = d.all_mean(mean).tolist()
    gn = float(grad_norm)
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    log.write({"type": "skip", "step": step, "loss": loss, "ce": ce, "l1": l1v, "grad_norm": gn, "in_a_row": n_skips})
    if n_skips > cfg["max_nonfinite_skips"]:
        raise TrainingDiverged(f"non-finite {what} at step {step} (loss {loss}, grad_norm {gn}), {n_skips} step(s) in "
                               f"a row, more than max_nonfinite_skips={cfg['max_nonfinite_skips']}: training stopped "
                               f"with the last update skipped; {diverged_advice(out_dir)}")
    if d.main:
        print(f"step {step}: non-finite {what} (loss {loss}, grad_norm {gn}): update skipped, weights unchanged "
              f"({n_skips} in a row, at most {cfg['max_nonfinite_skips']})", file=sys.stderr)


def train(cfg: dict[str, Any], resume: bool = False, resume_from: int | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the final summary dict (also the log's final line).

    Rank 0 holds the run directory's lock for the whole run (a second writer is refused at once), and
    everything knowable before step 1 is checked before it: device and kernels here, data and disk space
    in `_train`. `--resume` of a finished run is a no-op that returns its final line. `resume_from` (a step)
    resumes from that checkpoint instead of the newest; the newer ones are removed."""
    resume = resume or resume_from is not None
    t_start = time.time()
    d = Dist()
    device = pick_device(cfg, d)
    check_kernels(cfg["mlp_impl"], device, str(cfg["device"]))
    out_dir = Path(cfg["out_dir"])
    lock = RunLock(out_dir) if d.main else None
    if lock is not None:
        lock.acquire()
    try:
        if resume and resume_from is None:
            final = finished_run(out_dir, cfg, d.world)
            if final is not None:
                if d.main:
                    print(f"--resume: the run in {out_dir} already finished at step {final['step']} (its log has the "
                          "final line); nothing to do. To train further, raise max_steps.", file=sys.stderr)
                return final
        return _train(cfg, resume, d, device, t_start, resume_from)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: dict[str, Any], resume: bool, d: Dist, device: torch.device, t_start: float,
           resume_from: int | None = None) -> dict[str, Any]:
    """The run inside the lock: set-up, resume, the log's first line, the loop and finalisation, in this order."""
    d.init(device)
    run = _Run(cfg, d, device, t_start)
    ckpt_dir = run.prepare_out_dir(resume, resume_from)
    run.load_data()
    run.build()
    log_lines = run.restore(ckpt_dir, resume_from) if ckpt_dir is not None else 0
    run.open_log(log_lines, resumed=ckpt_dir is not None)
    last_saved = run.loop(resumed=ckpt_dir is not None)
    return run.finish(last_saved)


class _Run:
    """The state of one training run in this process, shared by the steps `_train` takes. The loop advances
    `step` and the counters; every checkpoint saves them, and a resume restores them."""

    def __init__(self, cfg: dict[str, Any], d: Dist, device: torch.device, t_start: float) -> None:
        self.cfg, self.d, self.device, self.t_start = cfg, d, device, t_start
        self.out_dir = Path(cfg["out_dir"])
        self.log_path = self.out_dir / "train_log.jsonl"
        self.step, self.wall_prev, self.n_reinit, self.n_skips = 0, 0.0, 0, 0

    # ----------------------------------------------------------------------------------- set-up
    def prepare_out_dir(self, resume: bool, resume_from: int | None) -> Path | None:
        """Clear what interrupted processes left and refuse an out_dir holding a run unless resuming; returns
        the checkpoint a resume starts from (None: from scratch)."""
        d, out_dir, log_path = self.d, self.out_dir, self.log_path
        if d.main:
            for stale in clean_stale_temps(out_dir, ckpt_root(out_dir)):
                print(f"removed {stale} (a temporary file of an interrupted process)", file=sys.stderr)
            for torn in clean_torn_checkpoints(out_dir):
                print(f"removed {torn} (a checkpoint half-deleted by an interrupted process)", file=sys.stderr)
        d.barrier()
        ckpt_dir = pick_checkpoint(out_dir, resume_from) if resume else None
        if d.main:
            if not resume and (log_path.exists() or find_latest(out_dir) is not None):
                raise ConfigError(f"out_dir={str(out_dir)!r} already holds a run; pass --resume to continue it "
                                  "or choose another out_dir")
            out_dir.mkdir(parents=True, exist_ok=True)
            if resume and ckpt_dir is None:
                print(f"--resume: no checkpoint in {out_dir}, starting from scratch", file=sys.stderr)
                log_path.unlink(missing_ok=True)  # killed before its first checkpoint: the run restarts whole
        d.barrier()
        return ckpt_dir

    def load_data(self) -> None:
        """The token data (fingerprinted once, on rank 0), the batch sizes, the val windows, the tokenizer check."""
        cfg, d = self.cfg, self.d
        data = self.data = TokenData(Path(cfg["data_dir"]) / cfg["tokens_subdir"], cfg["seq_len"],
                                     cfg["data_order"], d.world)
        self.data_fp = rank0_check(d, data.fingerprint)  # checksums + id range of every shard (one read)
        cfg = self.cfg = {**cfg, "grad_accum": resolve_grad_accum(cfg, d.world)}
        mbs, accum, seq = cfg["micro_batch_size"], cfg["grad_accum"], cfg["seq_len"]
        tokens_per_step_rank = mbs * accum * seq
        self.tokens_per_step = tokens_per_step_rank * d.world
        self.dead_window = local_dead_window(cfg, d.world, tokens_per_step_rank)  # per rank
        n_val = cfg["eval_batches"] * mbs
        if n_val > data.n_val_windows and d.main:
            print(f"note: val split has only {data.n_val_windows} windows of {seq + 1} tokens; evaluating on all "
                  f"of them instead of eval_batches*micro_batch_size={n_val}", file=sys.stderr)
        self.val_windows = data.val_windows(min(n_val, data.n_val_windows))  # DataError if the val split is too small
        self.tokenizer_dir = Path(cfg["data_dir"]) / "tokenizer"
        if cfg["save_final"] or cfg["ckpt_hf"]:  # copied beside every saved model: a broken one would fail there
            rank0_check(d, lambda: check_tokenizer(self.tokenizer_dir))

    def build(self) -> None:
        """The seeded model, the disk-space check, the wrapped model (DDP or FSDP2), AdamW and its schedule."""
        cfg, d = self.cfg, self.d
        seed_everything(cfg["seed"])
        model = self.model = build_model(cfg, self.data.vocab_size, self.data.meta.get("eos_id"),
                                         self.dead_window).to(self.device)
        model.train()
        self.n_params = sum(p.numel() for p in model.parameters())
        rank0_check(d, lambda: check_disk_space(self.out_dir, model, len(list_checkpoints(self.out_dir)),
                                                cfg["save_final"], cfg["ckpt_hf"], planned_checkpoints(cfg)))
        self.fwd_model = wrap_model(model, cfg, d, self.device)  # before the optimizer: FSDP2 replaces parameters
        self.opt = torch.optim.AdamW(param_groups(model, cfg["weight_decay"]), lr=cfg["lr"],
                                     betas=tuple(cfg["betas"]), eps=cfg["eps"])
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(cfg, s) / cfg["lr"])

    # ----------------------------------------------------------------------------------- resume
    def restore(self, ckpt_dir: Path, resume_from: int | None) -> int:
        """Load a checkpoint after checking that it may be resumed with this config and data; returns the
        number of log lines it was written after (rank 0; 0 elsewhere)."""
        cfg, d, out_dir = self.cfg, self.d, self.out_dir
        # CPU: RNG states must stay CPU ByteTensors; load_state_dict moves weights/optimizer state to device.
        state = load_checkpoint(ckpt_dir, map_location="cpu", model=False)
        check_resume_config(state["config"], resume_config_view(state["config"], state["world_size"], cfg, d.world))
        if state["step"] > cfg["max_steps"]:
            raise ConfigError(f"--resume: the newest checkpoint in {out_dir} is at step {state['step']}, past "
                              f"max_steps={cfg['max_steps']}; resume with max_steps >= {state['step']}")
        mismatch = rank0_check(d, lambda: self.data.fingerprint_mismatch(state["data"]))
        if mismatch is not None:
            raise DataError(f"--resume: the data differ from the checkpoint's: {mismatch}")
        load_model_and_optimizer(ckpt_dir, state, self.model, self.opt)  # any world size, DDP or FSDP2
        if not weights_finite(self.model, d):  # written by a version that saved without checking
            raise TrainingDiverged(f"checkpoint {ckpt_dir} holds non-finite weights: resume from an earlier one "
                                   f"with --resume-from STEP (kept: {checkpoint_names(out_dir)})")
        self.sched.load_state_dict(state["scheduler"])
        restore_trackers(self.model, state["trackers"], d)
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        set_rng_state(rngs[d.rank % len(rngs)])  # another world size: nothing in training draws from these
        self.step, self.wall_prev = state["step"], state["wall_s"]
        self.n_reinit = state.get("counters", {}).get("reinit_neurons", 0)  # re-initialised since the last step line
        log_lines = 0
        if d.main:
            if resume_from is not None:
                drop_newer_than(out_dir, self.step)
            log_lines = truncate_log(self.log_path, self.step, state.get("log_lines"))
        self.n_skips = state.get("counters", {}).get("nonfinite_skips", 0)
        return log_lines

    # ----------------------------------------------------------------------------------- provenance
    def open_log(self, log_lines: int, resumed: bool) -> None:
        """Open the log and write its header (a new run) or a resume line: what a run's numbers depend on
        besides its config: the code and machine, the processes, the kernels' settings, the exact data."""
        d, data, model = self.d, self.data, self.model
        self.log = JsonlLog(self.log_path, d.main, lines=log_lines)
        data_info = {"tokens_dir": str(data.dir), "tokenizer": data.meta.get("tokenizer"), **(self.data_fp or {})}
        setup = {"world_size": d.world, "kernel_config": model.config.get_kernel_config().to_dict(), "data": data_info}
        if not resumed:
            mc = model.config  # the built model's shape (with init_from the arch keys of cfg are not used)
            arch = {k: getattr(mc, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "vocab_size", "gated_mlp")}
            self.log.write({"type": "header", "provenance": collect(), "config": self.cfg, "model": arch,
                            "n_params": self.n_params, **setup})
        else:  # a resume may run on another number of processes, or with other kernel settings
            self.log.write({"type": "resume", "step": self.step, "provenance": collect(), **setup})

    # ----------------------------------------------------------------------------------- the loop
    def loop(self, resumed: bool) -> int:
        """Train to max_steps, with the log, eval and checkpoint lines on their schedules; returns the step of
        the last checkpoint (-1: none since the start of a new run)."""
        cfg, d, model = self.cfg, self.d, self.model
        if cfg["compile"]:
            self.fwd_model = torch.compile(self.fwd_model)
        accum = cfg["grad_accum"]
        params = [p for p in model.parameters() if p.requires_grad]
        clip = cfg["grad_clip"] if cfg["grad_clip"] > 0 else float("inf")
        bar = tqdm(total=cfg["max_steps"], initial=self.step, disable=not (cfg["progress"] and d.main),
                   desc="train", dynamic_ncols=True)
        self.t_log, self.tok_log = time.time(), 0
        last_saved = self.step if resumed else -1
        while self.step < cfg["max_steps"]:
            coeff = l1_coeff_at(cfg, self.step)
            lr = self.opt.param_groups[0]["lr"]
            batch = self.data.train_batch(cfg["seed"], self.step, d.rank, cfg["micro_batch_size"] * accum)
            model.reset_sparsity_stats(dead_tracker=False)
            sums, grad_norm, stepped = optimizer_step(self.fwd_model, batch, cfg, coeff, self.device, params, clip,
                                                      self.opt, self.sched, d)
            coeff = model.last_losses.get("l1_coeff", coeff)  # the coefficient the forward applied, as logged
            if cfg["dead_reinit_lambda"] > 0:
                self.n_reinit += reinit_dead(model, cfg, self.step, self.dead_window, d)
            self.step += 1
            step = self.step
            self.tok_log += self.tokens_per_step
            bar.update(1)
            self.n_skips = 0 if stepped else self.n_skips + 1
            if not stepped:
                note_skip(self.log, d, cfg, self.out_dir, step, sums / accum, grad_norm, self.n_skips)

            if step % cfg["log_every"] == 0 or step == cfg["max_steps"]:
                self.log_step(sums / accum, grad_norm, coeff, lr, bar)
            if cfg["eval_every"] and step % cfg["eval_every"] == 0 and step < cfg["max_steps"]:
                self.log_eval()
            if cfg["ckpt_every"] and step % cfg["ckpt_every"] == 0 and step < cfg["max_steps"]:
                self.save(step)
                last_saved = step
        bar.close()
        return last_saved

    def log_step(self, mean: torch.Tensor, grad_norm: torch.Tensor, coeff: float, lr: float, bar: tqdm) -> None:
        """The step line: losses (mean over ranks), sparsity over all ranks, throughput since the last line."""
        cfg, d, step = self.cfg, self.d, self.step
        rank0_check(d, lambda: check_data_unchanged(self.data, self.out_dir, step))
        loss, ce, l1v = (d.all_mean(mean)).tolist()
        st = global_sparsity_stats(self.model, d, self.dead_window)  # over all ranks
        now = time.time()
        line = {"type": "step", "step": step, "tokens": step * self.tokens_per_step, "loss": loss, "ce": ce,
                "l1": l1v, "l1_coeff": coeff, "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": self.tok_log / max(now - self.t_log, 1e-9), "nnz_mean": st["nnz_mean"],
                "nnz_max": st["nnz_max"], "dead_frac": st["dead_frac"],
                "nnz_mean_per_layer": st["nnz_mean_per_layer"], "nnz_max_per_layer": st["nnz_max_per_layer"],
                "dead_frac_per_layer": st["dead_frac_per_layer"]}
        if cfg["dead_reinit_lambda"] > 0:
            line["reinit_neurons"], self.n_reinit = self.n_reinit, 0
        if self.device.type == "cuda":
            line["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.write(line)
        bar.set_postfix(loss=f"{loss:.3f}", ce=f"{ce:.3f}", nnz=f"{st['nnz_mean']:.1f}")
        self.t_log, self.tok_log = now, 0

    def log_eval(self) -> float:
        """Evaluate on the val windows and write the eval line; returns the val CE."""
        val_ce, val_nnz = evaluate(self.model, self.val_windows, self.cfg, self.device, self.d, self.dead_window)
        self.log.write({"type": "eval", "step": self.step, "val_ce": val_ce, "val_nnz_mean": val_nnz})
        return val_ce

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        """Everything but model and optimizer (those go through DCP); collective when world > 1."""
        d, cfg = self.d, self.cfg
        rngs = [None] * d.world
        if d.world > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        return {"step": done, "scheduler": self.sched.state_dict(), "trackers": gather_trackers(self.model, d),
                "rng": rngs, "sampler": {"kind": f"stateless(seed, step, rank), order {cfg['data_order']}",
                                         "seed": cfg["seed"], "next_step": done},
                "data": self.data_fp, "world_size": d.world, "config": cfg,
                "wall_s": self.wall_prev + time.time() - self.t_start,
                # what a resume needs to write the log an uninterrupted run writes
                "log_lines": self.log.lines,
                "counters": {"reinit_neurons": self.n_reinit, "nonfinite_skips": self.n_skips}}

    def save(self, done: int) -> None:
        """Checkpoint the state after step `done` (collective), never one with non-finite weights."""
        d, model = self.d, self.model
        if not weights_finite(model, d):  # never a checkpoint that cannot be resumed from
            raise TrainingDiverged(f"the weights after step {done} are not finite, so no checkpoint was written; "
                                   f"{diverged_advice(self.out_dir)}")
        rank0_check(d, lambda: check_data_unchanged(self.data, self.out_dir, done))
        state = self.checkpoint_state(done)
        if d.main:
            self.log.sync()
        write_hf = None
        if self.cfg["ckpt_hf"]:  # a from_pretrained-able copy of the same weights beside the training state
            plain = unsharded_copy(model, d) if is_sharded(model) else model  # collective under FSDP2
            write_hf = lambda tmp: write_pretrained(plain, tmp / HF_SUBDIR, self.tokenizer_dir)  # noqa: E731
        # collective: every rank writes its shards
        save_checkpoint_dcp(self.out_dir, done, model, self.opt, state, d, write_hf)

    # ----------------------------------------------------------------------------------- finalisation
    def finish(self, last_saved: int) -> dict[str, Any]:
        """The last checkpoint, the final evaluation, the final model and the log's final line."""
        cfg, d = self.cfg, self.d
        if cfg["ckpt_last"] and last_saved != self.step:
            self.save(self.step)  # before the final evaluation: a failure there never loses the training
        val_ce = self.log_eval()
        wall = self.wall_prev + time.time() - self.t_start
        final = {"type": "final", "step": self.step, "val_ce": val_ce, "wall_s": wall}
        if cfg["save_final"]:
            plain = unsharded_copy(self.model, d) if is_sharded(self.model) else self.model  # FSDP2: gathered on rank 0
            if d.main:
                save_final(plain, self.out_dir / "final", Path(cfg["data_dir"]))
        self.log.write(final)
        self.log.sync()
        self.log.close()
        d.close()
        return final


def save_final(model: SparseLlamaForCausalLM, dest: Path, data_dir: Path) -> None:
    """save_pretrained (+ the data dir's tokenizer) into dest, via a temp dir + rename. A failed write (a full
    disk above all; safetensors reports it without an errno) is a RunWriteError naming it."""
    tmp = dest.with_name(tmp_name(dest.name))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_pretrained(model, tmp, data_dir / "tokenizer")
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = os_error_of(e)
        if cause is None:
            raise
        raise write_failure(cause, f"the final model {dest}", dest.parent) from e
    if dest.exists():
        remove_dir(dest)
    os.replace(tmp, dest)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return arg_parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        final = train(cfg, resume=args.resume, resume_from=args.resume_from)
    except (ConfigError, DataError, RunDirError, RunWriteError, TrainingDiverged) as e:
        sys.exit(f"error: {e}")
    except ValueError as e:  # SparseLlamaConfig field errors surface here
        if "SparseLlamaConfig." in str(e):
            sys.exit(f"error: {e}")
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(final))


if __name__ == "__main__":
    main()
