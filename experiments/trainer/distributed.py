"""Several processes, one training loop: torchrun ranks, DDP / FSDP2 wrapping, cross-rank sparsity statistics,
distributed checkpoints (torch.distributed.checkpoint, "DCP") and the consolidated final model.

Everything here reduces to the plain single-process operation when WORLD_SIZE is 1, so experiments/trainer/train.py runs
the same loop in one process, under DDP (`parallel: ddp`, replicated weights: small models) and under FSDP2
(`parallel: fsdp`, `torch.distributed.fsdp.fully_shard` per decoder layer + the root: paper-scale models).

What is reduced across ranks, so that the logged numbers equal a single process's on the same global batch:
- loss / CE / L1: every rank's micro-batches hold the same number of tokens, so the mean over ranks of the
  per-rank means is the global mean (train.py's all_mean).
- non-zeros per token: per layer, the sum over tokens and the token count are summed over ranks, the max is
  maxed (`global_sparsity_stats`).
- dead neurons: the per-neuron "tokens since last firing" counters are min-reduced; a neuron is dead when it
  has fired on no rank within the window. `dead_window_tokens` counts tokens of all ranks; each rank's
  counters advance by its own tokens, so the per-rank window is dead_window_tokens / world. For a window that
  is a whole number of optimizer steps (the default: one step) this is exactly the single-process fraction.
- dead-neuron re-initialisation (paper Eq. 6) uses the min-reduced counters and the same noise on every rank;
  under FSDP each rank moves the rows of its own shard (`reinit_dead`).
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from sfl.kernels.layout import make_down_shardable_
from sfl.models import SparseLlamaForCausalLM
from sfl.models.sparsity import dead_fraction, reinit_dead_rows

from .checkpoint import (CheckpointWriteError, abort_checkpoint, begin_checkpoint, commit_checkpoint, os_error_of,
                         write_state)
from .config import DEFAULTS, ConfigError
from .weight_hashes import WeightIntegrityError, verify_weight_hashes, write_weight_hashes

DCP_SUBDIR = "dcp"  # <checkpoint>/dcp/: model + optimizer, written by torch.distributed.checkpoint


# --------------------------------------------------------------------------------------- ranks
class Dist:
    """Rank/world from the torchrun environment; world 1 without it."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.main = self.rank == 0
        self.launched = "WORLD_SIZE" in os.environ  # started by torchrun

    def init(self, device: torch.device) -> None:
        """A process group for every run torchrun started (WORLD_SIZE set), one process included: `parallel: fsdp`
        then shards over one GPU exactly as over several (the 1-GPU point of a scaling measurement, and the FSDP2
        path on a machine with one GPU)."""
        if self.launched and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")

    def all_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
            t /= self.world
        return t

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def all_min(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MIN)

    def _reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t, op=op)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """End the run's process group: a last barrier, then destroy_process_group. gloo's worker thread drops a
        finished collective's tensors (a Python decref, so it needs the GIL) just after wait() returns, and the
        group's destructor, run when the DDP wrapper is freed, joins that thread while this one holds the GIL: a drop
        still pending then hangs the rank at exit (seen in CI: ~ProcessGroupGloo under Reducer's dealloc, the worker
        in ~AsyncBarrierWork waiting for the GIL). The sleep releases the GIL so that the drop happens first."""
        if dist.is_initialized():
            dist.barrier()
            time.sleep(0.05)
            dist.destroy_process_group()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


# --------------------------------------------------------------------------------------- batch geometry
def resolve_grad_accum(cfg: dict[str, Any], world: int) -> int:
    """grad_accum for this world size: global_batch_size / (micro_batch_size * world) when global_batch_size
    is set (the paper's configs: 512 sequences on any number of GPUs), else the grad_accum key."""
    gbs, mbs = cfg["global_batch_size"], cfg["micro_batch_size"]
    if gbs is None:
        return cfg["grad_accum"]
    if gbs % (mbs * world):
        raise ConfigError(f"config key global_batch_size={gbs} is not a multiple of micro_batch_size x WORLD_SIZE = "
                          f"{mbs} x {world}; change micro_batch_size or the number of processes")
    return gbs // (mbs * world)


def local_dead_window(cfg: dict[str, Any], world: int, tokens_per_step_rank: int) -> int:
    """The per-rank dead-neuron window: dead_window_tokens (tokens of all ranks) / world, or one step's tokens
    per rank by default (the paper's definition: not fired anywhere in the last optimizer step)."""
    window = cfg["dead_window_tokens"]
    if window is None:
        return tokens_per_step_rank
    if window % world:
        raise ConfigError(f"config key dead_window_tokens={window} counts tokens of all ranks and must be a multiple "
                          f"of WORLD_SIZE={world}")
    return window // world


def resume_config_view(saved: dict[str, Any], saved_world: int, cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """cfg as the resume check compares it: the split of the global batch into micro_batch_size x grad_accum x
    world may change (resume onto another number of ranks), the global batch itself may not."""
    g_saved = saved["micro_batch_size"] * saved["grad_accum"] * saved_world
    g_now = cfg["micro_batch_size"] * cfg["grad_accum"] * world
    if g_saved != g_now:
        raise ConfigError(f"--resume: the checkpoint's global batch is {g_saved} sequences (micro_batch_size "
                          f"{saved['micro_batch_size']} x grad_accum {saved['grad_accum']} x WORLD_SIZE "
                          f"{saved_world}), now {g_now}; keep it (set global_batch_size, or grad_accum) or start a "
                          "new out_dir")
    view = dict(cfg)
    for k in ("micro_batch_size", "grad_accum", "global_batch_size"):
        view[k] = saved.get(k, cfg[k])
    for k, v in cfg.items():  # keys newer than the checkpoint: at their default they are what it ran with
        if k not in saved and v == DEFAULTS.get(k):
            view[k] = None
    return view


# --------------------------------------------------------------------------------------- wrapping
def wrap_model(model: torch.nn.Module, cfg: dict[str, Any], d: Dist, device: torch.device) -> torch.nn.Module:
    """The module the loop calls. Activation checkpointing per decoder layer (HF's non-reentrant
    torch.utils.checkpoint) when asked; in one process the model itself; DDP or FSDP2 under torchrun.

    FSDP2: every decoder layer is its own fully_shard unit (gathered for its forward/backward, resharded
    after), the root holds the (tied) embedding, final norm and lm_head. Parameters stay in place as sharded
    DTensors on `model`, so model.sparse_mlps(), get_state_dict and the optimizer see the same objects.

    A neuron-major W_d (the TwELL paths' layout) becomes one contiguous [N, K] parameter first, in every setting,
    so that FSDP2 can shard it (by neuron) and a checkpoint has the same parameters on any number of processes
    (kernels/layout.py); its state dict keeps down_proj.weight [K, N].
    """
    make_down_shardable_(model.sparse_mlps())
    if cfg["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not dist.is_initialized():
        return model
    if cfg["parallel"] == "ddp":
        # broadcast_buffers=False: the per-neuron dead counters are per-rank statistics.
        with warnings.catch_warnings():  # torch >= 2.13 deprecates the flag but still advises it for this case
            warnings.simplefilter("ignore", FutureWarning)
            return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    mesh = init_device_mesh(device.type, (d.world,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg["fsdp_mixed_precision"] else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def accumulation_context(fwd_model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """DDP skips the gradient all-reduce on all but the last micro-batch. FSDP2 reduce-scatters every
    micro-batch (its unsharded gradients would otherwise stay allocated across the whole accumulation)."""
    no_sync = getattr(fwd_model, "no_sync", None)
    if last or no_sync is None:
        return contextlib.nullcontext()
    return no_sync()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm before clipping (sharded FSDP gradients included), then clip to max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def eval_path(model: torch.nn.Module) -> Any:
    """Evaluation of an FSDP2 model through the CUDA inference op. FSDP2 frees and refills a layer's gathered
    weights in the same storage without bumping their version counter (checked on torch 2.13), while the
    inference path caches per weight storage and version (the bf16 cast in kernels/sparse_llama_mlp.inference_weights,
    the hot rows in the runtime): it could serve the weights of an earlier step. So, while evaluating, every MLP
    bumps its weights' versions before its forward (after FSDP2 has gathered them): the caches see new weights.
    Training goes through the training op, which caches nothing per weight."""
    if model.config.mlp_impl != "cuda" or not is_sharded(model):
        yield
        return
    hooks = [mlp.register_forward_pre_hook(_bump_weight_versions) for mlp in model.sparse_mlps()]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _bump_weight_versions(mlp: torch.nn.Module, args: Any) -> None:
    for w in (mlp.gate_proj.weight if mlp.gated else None, mlp.up_proj.weight, mlp.down_proj.weight):
        if w is not None:
            torch.autograd.graph.increment_version(w)


# --------------------------------------------------------------------------------------- sparsity statistics
@torch.no_grad()
def global_sparsity_stats(model: torch.nn.Module, d: Dist, window: int,
                          local: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """model.sparsity_stats() over the tokens of all ranks (the same keys). `local` = per-layer
    mlp.sparsity_stats() taken earlier (evaluate: before a padding forward); default: now.
    Collective when world > 1: every rank calls it."""
    mlps = model.sparse_mlps()
    local = local if local is not None else [m.sparsity_stats() for m in mlps]
    n_layers = len(mlps)
    dev = mlps[0].tokens_since_fire.device
    tokens = torch.tensor([float(p["tokens"]) for p in local], dtype=torch.float64, device=dev)
    # sums of per-token counts are whole numbers: round away the float round trip through nnz_mean
    sums = torch.tensor([round(p["nnz_mean"] * p["tokens"]) if p["tokens"] else 0.0 for p in local],
                        dtype=torch.float64, device=dev)
    maxes = torch.tensor([p["nnz_max"] if p["tokens"] else float("-inf") for p in local], dtype=torch.float64,
                         device=dev)
    summed = d.all_sum(torch.cat([sums, tokens]))
    sums, tokens = summed[:n_layers], summed[n_layers:]
    maxes = d.all_max(maxes)
    since = d.all_min(torch.stack([m.tokens_since_fire for m in mlps]))
    nnz_mean = [float(s / t) if t > 0 else float("nan") for s, t in zip(sums, tokens)]
    nnz_max = [float(m) if t > 0 else float("nan") for m, t in zip(maxes, tokens)]
    dead = [float(dead_fraction(s, window)) for s in since]
    n = max(n_layers, 1)
    return {"nnz_mean_per_layer": nnz_mean, "nnz_max_per_layer": nnz_max, "dead_frac_per_layer": dead,
            "tokens": int(tokens[0]) if n_layers else 0, "nnz_mean": sum(nnz_mean) / n,
            "nnz_max": max(nnz_max, default=float("nan")), "dead_frac": sum(dead) / n}


@torch.no_grad()
def reinit_dead(model: torch.nn.Module, cfg: dict[str, Any], step: int, window: int, d: Dist) -> int:
    """Dead-neuron re-initialisation (paper Eq. 6) after an optimizer step; returns how many rows moved.

    A neuron is dead only if it is dead on every rank (min over ranks of the tokens-since-fire counters), and
    every rank draws the same noise (generator seeded by seed and step), so replicas stay identical and
    --resume stays exact. Under FSDP2 each rank writes the rows of its own shard of the weight.
    """
    gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
    total = 0
    for mlp in model.sparse_mlps():
        since = d.all_min(mlp.tokens_since_fire)
        weight = mlp.gate_proj.weight if mlp.gated else mlp.up_proj.weight
        lam, std = cfg["dead_reinit_lambda"], cfg["dead_reinit_std"]
        if hasattr(weight, "to_local"):
            total += _reinit_dead_rows_sharded(weight, since, window, lam, std, gen)
        else:
            total += reinit_dead_rows(weight, since, window, lam, std, gen)
    return total


def _reinit_dead_rows_sharded(weight: Any, since: torch.Tensor, window: int, lam: float, std: float,
                              gen: torch.Generator) -> int:
    """reinit_dead_rows on a DTensor sharded on dim 0 (FSDP2): draws the noise of every dead row, in the
    same order as the unsharded function, and applies the rows this rank holds."""
    if tuple(weight.placements) != (Shard(0),):
        raise NotImplementedError(f"dead-neuron re-initialisation of a weight sharded as {weight.placements}")
    dead = (since >= window).nonzero().flatten().cpu()  # CPU like the noise (a CUDA mask cannot index it)
    if dead.numel() == 0:
        return 0
    noise = torch.randn((dead.numel(), weight.shape[1]), generator=gen, dtype=torch.float32)
    local = weight.to_local()
    rows = weight.shape[0]
    chunk = -(-rows // weight.device_mesh.size())  # torch.chunk's split, FSDP2's dim-0 layout
    lo = min(weight.device_mesh.get_local_rank() * chunk, rows)
    if local.shape[0] != min(chunk, rows - lo):
        raise RuntimeError(f"unexpected FSDP shard: {local.shape[0]} rows at offset {lo} of {rows}")
    mine = (dead >= lo) & (dead < lo + local.shape[0])
    if mine.any():
        idx = (dead[mine] - lo).to(local.device)
        new = (1.0 - lam) * local.index_select(0, idx).float() + lam * std * noise[mine].to(local.device)
        local.index_copy_(0, idx, new.to(local.dtype))
    return int(dead.numel())


# --------------------------------------------------------------------------------------- dead counters
def gather_trackers(model: torch.nn.Module, d: Dist) -> list[torch.Tensor]:
    """Per layer: int64 [world, N], every rank's tokens-since-fire counters (collective when world > 1)."""
    mine = torch.stack([m.tokens_since_fire for m in model.sparse_mlps()])  # [L, N]
    if d.world == 1:
        return [t.unsqueeze(0).cpu() for t in mine]
    parts = [torch.empty_like(mine) for _ in range(d.world)]
    dist.all_gather(parts, mine)
    both = torch.stack(parts, dim=1).cpu()  # [L, world, N]
    return list(both)


@torch.no_grad()
def restore_trackers(model: torch.nn.Module, saved: list[torch.Tensor], d: Dist) -> None:
    """Load the counters gathered by gather_trackers. Same world size: each rank its own row (exact).
    Another world size: every rank starts from the min over the saved ranks, rescaled from old-rank to
    new-rank tokens (floor): a neuron keeps the number of whole steps since it last fired anywhere, so the
    dead fraction for a window of whole steps continues exactly."""
    for mlp, t in zip(model.sparse_mlps(), saved):
        t = t if t.dim() == 2 else t.unsqueeze(0)  # checkpoints of one process before DCP: [N]
        if t.shape[0] == d.world:
            row = t[d.rank]
        else:
            row = t.min(dim=0).values * t.shape[0] // d.world
        mlp.tokens_since_fire.copy_(row)


# --------------------------------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def _quiet_single_process() -> Any:
    """DCP warns on every save/load without a process group, even when asked for exactly that (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_checkpoint_dcp(out_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                        state: dict[str, Any], d: Dist,
                        write_extra: Callable[[Path], None] | None = None) -> None:
    """Crash-safe checkpoint `step`: model + optimizer through DCP (each rank writes its shards in parallel;
    resharding on load), the rest (`state`: step, scheduler, RNG, counters, config) as state.pt by rank 0, then
    `write_extra(temp dir)` on rank 0 (the save_pretrained copy); COMPLETE and the atomic rename come last
    (checkpoint.py). Collective: every rank calls it."""
    def stop_on_error(err: Exception | None) -> None:  # every rank raises when one failed (none waits forever)
        msg = d.broadcast(None if err is None or not d.main else str(err)) if d.world > 1 else None
        if err is not None:
            raise err
        if msg is not None:
            raise CheckpointWriteError(f"checkpoint {step} failed on rank 0: {msg}")

    tmp, err = None, None
    if d.main:
        try:
            tmp = begin_checkpoint(out_dir, step)
        except CheckpointWriteError as e:
            err = e
    stop_on_error(err)
    tmp = Path(d.broadcast(str(tmp) if d.main else None))
    msd, osd = get_state_dict(model, opt)
    try:
        with _quiet_single_process():
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp / DCP_SUBDIR, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP gathers all ranks' failures: every rank raises here
        cause = _dcp_os_error(e)
        if cause is None:
            raise
        if d.main:
            raise abort_checkpoint(cause, out_dir, step, tmp) from e
        raise CheckpointWriteError(cause.errno, f"checkpoint {step}: {cause}") from e
    d.barrier()
    if d.main:
        try:
            write_weight_hashes(tmp / DCP_SUBDIR)  # checked by a resume before it loads them
            write_state(tmp, state)
            if write_extra is not None:
                _write_extra(write_extra, tmp)
        except OSError as e:
            err = abort_checkpoint(e, out_dir, step, tmp)
        if err is None:
            try:
                commit_checkpoint(out_dir, step, tmp)
            except CheckpointWriteError as e:
                err = e
    stop_on_error(err)


def _write_extra(write: Callable[[Path], None], tmp: Path) -> None:
    """write(tmp), with a failure that is not an OSError (safetensors reports a full disk as its own
    SafetensorError) raised as one, so the checkpoint is aborted cleanly and every rank stops."""
    try:
        write(tmp)
    except OSError:
        raise
    except Exception as e:
        cause = os_error_of(e)  # e.g. safetensors' "No space left on device", which has no errno of its own
        raise OSError(cause.errno if cause is not None else None,
                      f"the save_pretrained copy failed: {type(e).__name__}: {e}") from e


def _dcp_os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed DCP save (in the exception chain, or among a CheckpointException's
    per-rank failures), if any."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return None


def load_checkpoint_dcp(ckpt_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint's model and optimizer into `model`/`opt` as they are laid out now (any world
    size, DDP, FSDP2 or one process), after checking its shards against the SHA-256 recorded when they were
    written (checkpoints older than that record have none to check). Collective when world > 1."""
    try:
        verify_weight_hashes(Path(ckpt_dir) / DCP_SUBDIR)
    except WeightIntegrityError as e:
        raise ConfigError(f"--resume: {e}; or resume from an earlier checkpoint with --resume-from STEP") from None
    msd, osd = get_state_dict(model, opt)  # also creates the optimizer's state tensors to load into
    sd = {"model": msd, "optim": osd}
    with _quiet_single_process():
        dcp.load(sd, checkpoint_id=Path(ckpt_dir) / DCP_SUBDIR, no_dist=not dist.is_initialized())
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def load_model_and_optimizer(ckpt_dir: Path, state: dict[str, Any], model: torch.nn.Module,
                             opt: torch.optim.Optimizer) -> None:
    """Model and AdamW state of a checkpoint: its DCP shards, or the full state dicts inside the state.pt of a
    checkpoint written before DCP (those resume on an unsharded model only)."""
    if "model" not in state:
        load_checkpoint_dcp(ckpt_dir, model, opt)
        return
    if is_sharded(model):
        raise ConfigError(f"--resume: {ckpt_dir} predates distributed checkpoints; resume it without parallel: fsdp")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


# --------------------------------------------------------------------------------------- final model
def unsharded_copy(model: torch.nn.Module, d: Dist) -> torch.nn.Module | None:
    """An ordinary CPU copy of an FSDP2 model, on rank 0 (None elsewhere), for save_pretrained: the full
    weights gathered shard by shard into a model built on the meta device (no init, no second copy).
    Collective: every rank calls it."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.main:
        return None
    with torch.device("meta"):
        plain = SparseLlamaForCausalLM(model.config)
    plain.to_empty(device="cpu")
    plain.tie_weights()  # to_empty gives the tied lm_head its own storage; tie it again before loading
    plain.load_state_dict(full)
    return plain
