"""Model-level speed, energy and memory, dense vs sparse (paper Table 1 efficiency columns, Figs 4, 5). GPU only.

    # (a) a trained checkpoint, on real validation tokens
    python -m sfl.experiments.speed.bench trained --model runs/gpu/l1_sweep/relu_l1_1e-3/final --name l1_sweep/relu_l1_1e-3
    # (b) the paper's shapes (hidden 2048, N 5632, 32 heads; 8/18/28/38 layers = 0.5B/1B/1.5B/2B), random weights
    #     whose gates are calibrated to a paper-like activity profile (mean ~24-39 non-zeros per token, heavy tail)
    python -m sfl.experiments.speed.bench paper --layers 8 [--train]

Appends one JSON row per (model, mode) to --out (default results/speed/<trained|paper_shapes>.jsonl; schema in
notebooks/README.md): model, paper_scale, l1_coeff, mode (inference|training), dense_/sparse_tokens_per_s,
dense_/sparse_energy_j_per_token (NVML; null + energy_note when unavailable), dense_/sparse_peak_mem_gb,
batch_tokens, nnz_mean (+ per-layer profile), provenance, and what was timed.

What is timed
- inference: the decoder core `model.model` (no lm_head, as the official benchmark), bf16 weights, under
  inference_mode; "dense" = three cuBLAS GEMMs per FFN (relu(x Wg^T) * (x Wu^T)) Wd^T, "sparse" = the TwELL op
  (sfl.kernels.twell.ops.ffn) with each layer's own plan, i.e. the model's KernelConfig (SFL_KERNEL_* overrides
  applied once at start; mode --sparse-mode), logged as kernel_config. Both FFNs are plain functions swapped in for
  timing, so neither pays for the model's sparsity statistics; non-zeros are measured in a separate untimed pass.
  The layers' plans keep their W_d^T copies between blocks (their dispatch history lives there too): the bytes
  they hold after the sparse warm-up (sparse_resident_bytes) are left out of the dense side's peak.
- both modes: after a warm-up of both sides, dense and sparse run in interleaved blocks (ABBA ABBA ..., --blocks per
  side, >= --min-seconds per side); tokens/s from the median block; per-block times, their spread and the
  sparse/dense ratio of each adjacent block pair go in the row (an ordering bias of a few % was seen otherwise).
- paper shapes: the gates are calibrated on the timed tokens themselves (calibration_ok: every layer within 10%).
- training: full steps (forward with the L1 loss, backward, AdamW) on fp32 weights under bf16 autocast, as
  experiments/trainer/train.py runs them; peak memory = torch.cuda.max_memory_allocated over the timed steps. The sparse
  side trains with --train-impl (default cuda: the training op of kernels/train_ffn.py).
- energy: NVML total-energy counter difference over the timed loop (nvmlDeviceGetTotalEnergyConsumption), falling
  back to 20 ms power sampling; whole-GPU energy, so keep the GPU otherwise idle.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sfl.kernels.config import KernelConfig
from sfl.kernels.device import dense_ffn
from sfl.kernels.timing import time_layers
from sfl.kernels.twell import ops
from sfl.models import SparseLlamaConfig, SparseLlamaForCausalLM

from ..trainer.data_loader import TokenData
from ..trainer.provenance import collect

REPO_ROOT = Path(__file__).resolve().parents[2]
PAPER_SCALES = {8: "0.5B", 18: "1B", 28: "1.5B", 38: "2B"}
# Mean non-zeros per token per layer at L1 = 2e-5 (paper §4.2 [2]: 39 at 0.5B, 29 at 1.5B, 24 at 2B); the 1B
# value is not published: 34 is our interpolation, labelled as such in the rows.
PAPER_NNZ = {8: 39.0, 18: 34.0, 28: 29.0, 38: 24.0}
CALIB_TOL = 0.1  # relative: calibrated per-layer mean non-zeros within 10% of the target, else calibration_ok false


# ------------------------------------------------------------------------------------------------ energy
class EnergyMeter:
    """Whole-GPU energy over a code block: NVML energy counter, else NVML power sampling, else None + reason."""

    def __init__(self, device_index: int) -> None:
        self.note: str | None = None
        self.method: str | None = None
        self.handle = None
        try:
            import pynvml  # optional dependency (the nvidia-ml-py package, on GPU machines)
        except ImportError:
            self.note = "pynvml not importable: pip install nvidia-ml-py"
            return
        try:
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as e:  # noqa: BLE001 - NVML missing in the container, no permission, ...
            self.note = f"NVML unavailable: {type(e).__name__}: {e}"
            return
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self.method = "nvml_total_energy_counter"
        except Exception:  # noqa: BLE001
            try:
                pynvml.nvmlDeviceGetPowerUsage(self.handle)
                self.method = "nvml_power_sampling_20ms"
            except Exception as e:  # noqa: BLE001
                self.note = f"NVML has neither energy counter nor power readings: {e}"
                self.handle = None

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, float | None]]:
        out: dict[str, float | None] = {"joules": None}
        if self.handle is None:
            yield out
            return
        if self.method == "nvml_total_energy_counter":
            e0 = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            yield out
            torch.cuda.synchronize()
            out["joules"] = (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - e0) / 1000.0  # mJ -> J
            return
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0))
                time.sleep(0.02)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            yield out
            torch.cuda.synchronize()
        finally:
            stop.set()
            th.join()
        if len(samples) >= 2:
            out["joules"] = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(samples, samples[1:]))


# ------------------------------------------------------------------------------------------------ FFN swaps
def _dense_ffn(mlp, x: torch.Tensor, l1_terms=None) -> torch.Tensor:
    """HF LlamaMLP's three GEMMs (kernels.device.dense_ffn, the op's own dense fallback) without statistics."""
    return dense_ffn(x, mlp.gate_proj.weight if mlp.gated else None, mlp.up_proj.weight, mlp.down_proj.weight)


def _sparse_ffn(mlp, x: torch.Tensor, l1_terms=None) -> torch.Tensor:
    """The model's CUDA inference call without its statistics: one op call with the layer's plan (its KernelConfig,
    dispatch history and W_d^T cache)."""
    ops.ensure_loaded()   # registers the op's CUDA kernels (one dict lookup once loaded)
    wg = mlp.gate_proj.weight if mlp.gated else None
    return ops.ffn(x, wg, mlp.up_proj.weight, mlp.down_proj.weight, mlp.plan)


def use_kernel_config(model, sparse_mode: str, environ: dict[str, str] | None = None):
    """Give every layer a fresh plan from the model's KernelConfig with SFL_KERNEL_* (`environ`, read once by main)
    applied and mode = sparse_mode; returns that config."""
    cfg = KernelConfig.from_env(model.config.get_kernel_config(), environ=environ or {}).replace(mode=sparse_mode)
    model.set_kernel_config(cfg)
    return cfg


@contextlib.contextmanager
def plain_ffns(model, fn: Callable) -> Iterator[None]:
    """Replace every SparseLlamaMLP.forward by `fn(mlp, x, l1_terms)` (no statistics, no L1) for the duration."""
    mlps = model.sparse_mlps()
    for m in mlps:
        m.forward = types.MethodType(fn, m)
    try:
        yield
    finally:
        for m in mlps:
            del m.forward


# ------------------------------------------------------------------------------------------------ timing
def block_order(blocks: int) -> list[int]:
    """Side index (0 = dense, 1 = sparse) of each timed block: ABBA ABBA ... so that a linear drift of the GPU
    (clocks, temperature, allocator) over the run lands equally on both sides."""
    return [i for k in range(blocks) for i in ((0, 1) if k % 2 == 0 else (1, 0))]


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def interleaved_loop(sides: list[tuple[str, Callable[[], contextlib.AbstractContextManager], Callable[[], Any]]],
                     min_seconds: float, warmup: int, blocks: int, meter: EnergyMeter) -> dict[str, dict[str, Any]]:
    """Time two sides (name, context factory, step) in interleaved blocks (block_order) after warming up both.

    Each side gets `blocks` blocks of the same number of calls, >= min_seconds in all (from one timed call each);
    per side: seconds per call of every block (median = the headline), energy summed over its blocks (each block
    metered on its own), and peak memory = max over its blocks (peak stats reset before each block, so memory
    that the other side allocates inside its own blocks never counts here). A side whose step raises
    (NotImplementedError, ValueError, RuntimeError, ImportError) during warm-up is dropped with a note."""
    live, res = [], {}
    for name, ctx, step in sides:
        try:
            with ctx():
                for _ in range(max(1, warmup)):
                    step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                one = max(time.perf_counter() - t0, 1e-6)
        except (NotImplementedError, ValueError, RuntimeError, ImportError) as e:
            res[name] = {"note": f"not measured: {type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
            continue
        live.append((name, ctx, step, max(1, math.ceil(min_seconds / blocks / one))))
    for name, *_ in live:
        res[name] = {"block_s_per_call": [], "joules": [], "peak_bytes": 0, "reps": 0}
    order = block_order(blocks) if len(live) == 2 else [0] * blocks if live else []
    for i in tqdm(order, desc="interleaved blocks", leave=False, disable=not order):
        name, ctx, step, reps = live[i]
        r = res[name]
        with ctx():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with meter.measure() as energy:
                t0 = time.perf_counter()
                for _ in range(reps):
                    step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            r["peak_bytes"] = max(r["peak_bytes"], torch.cuda.max_memory_allocated())
        r["block_s_per_call"].append(wall / reps)
        r["joules"].append(energy["joules"])
        r["reps"] += reps
    for name, *_ in live:
        r = res[name]
        t = r["block_s_per_call"]
        r["s_per_call"] = _median(t)
        r["spread_pct"] = 100 * (max(t) - min(t)) / r["s_per_call"]
        r["total_joules"] = None if any(j is None for j in r["joules"]) else sum(r["joules"])
    return res


def side_fields(side: str, r: dict[str, Any], tokens_per_call: int) -> dict[str, Any]:
    """Row fields of one side (None + {side}_note where it was not measured)."""
    if "s_per_call" not in r:
        return {f"{side}_tokens_per_s": None, f"{side}_energy_j_per_token": None, f"{side}_peak_mem_gb": None,
                f"{side}_note": r.get("note")}
    return {f"{side}_tokens_per_s": tokens_per_call / r["s_per_call"],
            f"{side}_ms_per_call": 1000 * r["s_per_call"],
            f"{side}_block_ms": [round(1000 * t, 4) for t in r["block_s_per_call"]],
            f"{side}_block_spread_pct": r["spread_pct"],
            f"{side}_energy_j_per_token": (None if r["total_joules"] is None
                                           else r["total_joules"] / (tokens_per_call * r["reps"])),
            f"{side}_peak_mem_gb": r["peak_bytes"] / 1e9,
            f"{side}_reps": r["reps"]}


def paired_ratios(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sparse/dense speed ratio of each adjacent (dense, sparse) block pair: their spread shows the noise."""
    d, s = res.get("dense", {}), res.get("sparse", {})
    if "s_per_call" not in d or "s_per_call" not in s:
        return {}
    q = [a / b for a, b in zip(d["block_s_per_call"], s["block_s_per_call"])]  # = sparse tok/s / dense tok/s
    return {"speedup_sparse_over_dense": d["s_per_call"] / s["s_per_call"],
            "speedup_block_pairs": [round(v, 4) for v in q], "speedup_block_pairs_median": _median(q),
            "speedup_block_pairs_min": min(q), "speedup_block_pairs_max": max(q)}


def _layer_paths(model) -> list[dict[str, Any]] | None:
    """Per layer, the sparse side's dispatch counters so far (each layer's plan.info()), or None if unavailable."""
    out = []
    for m in model.sparse_mlps():
        try:
            h = m.plan.info()
        except Exception:  # noqa: BLE001 - no kernels build here: the row just lacks the field
            return None
        out.append({"sparse_calls": h.get("sparse_calls", 0), "dense_calls": h.get("dense_calls", 0),
                    "p_est": h.get("p"), "flagged_frac": h.get("f")})
    return out


def measure_inference(model, ids: torch.Tensor, sparse_mode: str, min_seconds: float, warmup: int,
                      meter: EnergyMeter, blocks: int = 6, lm_head: bool = False) -> dict[str, Any]:
    """Decoder-core forward tokens/s, J/token and peak memory, dense vs sparse in interleaved blocks; plus the
    path each layer took on the sparse side and a correctness check. lm_head=True times the whole model instead
    (model(input_ids), lm_head included: the same dense GEMM on both sides)."""
    n_tok = ids.numel()
    sparse_fn = _sparse_ffn
    modes = {m.plan.config.mode for m in model.sparse_mlps()}
    if modes != {sparse_mode}:
        raise ValueError(f"the layers' plans run mode {sorted(modes)}, not --sparse-mode {sparse_mode!r}: "
                         "call use_kernel_config(model, sparse_mode) first")

    @contextlib.contextmanager
    def side(fn: Callable) -> Iterator[None]:
        with contextlib.ExitStack() as st:
            st.enter_context(plain_ffns(model, fn))
            st.enter_context(torch.inference_mode())
            yield

    def step() -> None:
        model(input_ids=ids) if lm_head else model.model(input_ids=ids)

    before = _layer_paths(model)
    # the plans' persistent allocations (W_d^T copies) appear with the sparse side's first calls and stay: measured
    # here, after a warm-up of the sparse side, and kept out of the dense side's peak below
    resident = None
    try:
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        with side(sparse_fn):
            for _ in range(max(1, warmup)):
                step()
        torch.cuda.synchronize()
        resident = max(0, torch.cuda.memory_allocated() - m0)
    except (NotImplementedError, ValueError, RuntimeError, ImportError):
        pass  # the loop below records why the sparse side cannot run
    res = interleaved_loop([("dense", lambda: side(_dense_ffn), step), ("sparse", lambda: side(sparse_fn), step)],
                           min_seconds, warmup, blocks, meter)
    after = _layer_paths(model)
    out: dict[str, Any] = {"blocks_per_side": blocks, "block_order": "ABBA (A = dense)", "warmup_calls": warmup,
                           "sparse_resident_bytes": resident}
    if resident and "peak_bytes" in res.get("dense", {}):
        res["dense"]["peak_bytes"] -= resident
    for name in ("dense", "sparse"):
        out.update(side_fields(name, res[name], n_tok))
        if f"{name}_ms_per_call" in out:
            out[f"{name}_ms_per_forward"] = out.pop(f"{name}_ms_per_call")
    out.update(paired_ratios(res))
    if before is not None and after is not None and all(p["sparse_calls"] is not None for p in after):
        # calls per layer during warm-up + timing of the sparse side (auto mode: the first call runs dense)
        out["sparse_layer_paths"] = [{"sparse_calls": a["sparse_calls"] - b["sparse_calls"],
                                      "dense_calls": a["dense_calls"] - b["dense_calls"],
                                      "p_est": a["p_est"], "flagged_frac": a["flagged_frac"]}
                                     for a, b in zip(after, before)]
        out["sparse_layers_mostly_sparse"] = sum(1 for p in out["sparse_layer_paths"]
                                                 if p["sparse_calls"] > p["dense_calls"])
    # checked after timing, on the timed batch: the sparse side's per-layer dispatch history is then the one the
    # timed calls used (a layer's first call runs dense by design)
    if out["sparse_tokens_per_s"] is None or lm_head:  # the decoder core's outputs are checked by the core row
        return out
    outputs = {}
    for name, fn in (("dense", _dense_ffn), ("sparse", sparse_fn)):
        with side(fn):
            outputs[name] = model.model(input_ids=ids).last_hidden_state.float()
    d, s = outputs["dense"], outputs["sparse"]
    out["max_rel_diff_sparse_vs_dense"] = float((s - d).abs().max() / d.abs().max().clamp(min=1e-6))
    out["rel_l2_diff_sparse_vs_dense"] = float((s - d).norm() / d.norm().clamp(min=1e-6))
    return out


def mlp_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's FFN input on ids ([M, hidden] each, model dtype), from one forward of the decoder core."""
    xs: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp: xs.append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
             for m in model.sparse_mlps()]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return [x.contiguous() for x in xs]


def layer_times(model, ids: torch.Tensor) -> list[dict[str, Any]]:
    """Per layer on ids' tokens (the paper's per-layer speed contribution, App. D.3): non-zeros per token and the
    median ms of the dense FFN, of the sparse op with auto dispatch and with every call forced through TwELL
    (kernels.timing.time_layers)."""
    xs = mlp_inputs(model, ids)
    with torch.inference_mode():  # xs are inference tensors: no autograd on them
        nnz = [float((F.linear(x, (m.gate_proj if m.gated else m.up_proj).weight) > 0).sum(dim=1).float().mean())
               for m, x in zip(model.sparse_mlps(), xs)]
        rows = time_layers(model.sparse_mlps(), xs)
    return [{"layer": i, "nnz_mean": n, "tokens": int(x.shape[0]), **r} for i, (n, x, r) in enumerate(zip(nnz, xs, rows))]


def activity(model, ids: torch.Tensor, chunk: int = 8) -> dict[str, Any]:
    """Per-layer mean/max non-zeros per token through the model's own dense path (untimed)."""
    model.set_mlp_impl("dense")
    model.reset_sparsity_stats(dead_tracker=False)
    with torch.inference_mode():
        for i in range(0, ids.shape[0], chunk):
            model.model(input_ids=ids[i:i + chunk])
    st = model.sparsity_stats(reset=True)
    return {"nnz_mean": st["nnz_mean"], "nnz_max": st["nnz_max"], "nnz_mean_per_layer": st["nnz_mean_per_layer"],
            "nnz_max_per_layer": st["nnz_max_per_layer"]}


def measure_training(model, ids: torch.Tensor, micro_batch: int, train_impl: str, warmup: int, min_seconds: float,
                     meter: EnergyMeter, blocks: int = 6) -> dict[str, Any]:
    """Training tokens/s, J/token and peak memory (fp32 weights + bf16 autocast + AdamW, L1 loss on), dense
    mlp_impl vs `train_impl`, in interleaved blocks. One optimizer serves both sides (same parameters), so neither
    side's peak memory holds a second copy of the AdamW state. The number of steps follows from min_seconds.
    Leaves the model in fp32: call it last."""
    out: dict[str, Any] = {"train_impl": train_impl, "blocks_per_side": blocks, "block_order": "ABBA (A = dense)",
                           "warmup_calls": warmup}
    model.float().train()
    coeff = float(model.config.l1_coeff)  # the model's own recipe: L1 = 0 models train without the penalty
    x = ids[:micro_batch]
    # lr 0: AdamW does its whole update but the calibrated weights stay; with lr > 0 the activity drifts within a
    # few steps (train_throughput.Trainer; lab/speed/logs.tar.xz: train_throughput_lr_drift_h100.jsonl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x[:, :-1], shift_labels=x[:, 1:], l1_coeff=coeff).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def side(impl: str) -> Iterator[None]:
        model.set_mlp_impl(impl)  # ValueError for an unknown impl: the side is recorded as not measured
        try:
            yield
        except BaseException:
            opt.zero_grad(set_to_none=True)  # a failed backward leaves partial grads
            raise
        finally:
            model.set_mlp_impl("dense")

    with side("dense"):
        step()  # allocates the optimizer state before any peak-memory window
    torch.cuda.synchronize()
    res = interleaved_loop([("dense", lambda: side("dense"), step), ("sparse", lambda: side(train_impl), step)],
                           min_seconds, warmup, blocks, meter)
    n_tok = x[:, :-1].numel()
    for name in ("dense", "sparse"):
        out.update(side_fields(name, res[name], n_tok))
        if f"{name}_ms_per_call" in out:
            out[f"{name}_ms_per_step"] = out.pop(f"{name}_ms_per_call")
    out.update(paired_ratios(res))
    opt.state.clear()  # frees the AdamW moments (the closures above still reference opt)
    torch.cuda.empty_cache()
    model.set_mlp_impl("dense")
    model.eval()
    return out


# ------------------------------------------------------------------------------------------------ paper shapes
def paper_profile(n_layers: int, mean_nnz: float) -> list[float]:
    """Per-layer target mean non-zeros with the paper's 1.5B shape (§4.3): the first two layers least active, a
    hump in the first half (peak near 20% depth), a lower plateau later; rescaled to average `mean_nnz`."""
    w = []
    for i in range(n_layers):
        u = i / max(1, n_layers - 1)
        v = 0.6 + 1.4 * math.exp(-((u - 0.22) / 0.18) ** 2)
        v *= 0.3 if i == 0 else 0.5 if i == 1 else 1.0
        w.append(v)
    s = sum(w) / n_layers
    return [mean_nnz * v / s for v in w]


def build_paper_model(n_layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random-weight SparseLlama with the paper's shapes; residual dimension 0 carries a per-vocab constant
    (nothing writes to it: row 0 of every o_proj and down_proj is zero), which gives the gates an exact bias
    channel for calibrate_paper_model."""
    torch.manual_seed(seed)
    cfg = SparseLlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=n_layers,
                            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                            gated_mlp=True, mlp_impl="dense")
    with torch.device(device):
        model = SparseLlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def small_paper_like_model(n_layers: int, hidden: int, n: int, heads: int, vocab: int, device: torch.device):
    """Same construction at toy sizes (tests, CPU)."""
    cfg = SparseLlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=n, num_hidden_layers=n_layers,
                            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                            tie_word_embeddings=True, gated_mlp=True, mlp_impl="dense")
    with torch.device(device):
        return SparseLlamaForCausalLM(cfg).eval()


class _Captured(Exception):
    """Raised by a forward hook to stop the model once the wanted layer's FFN input is captured."""


def _mlp_input(model, layer_idx: int, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """[M, hidden] input of layer `layer_idx`'s FFN on ids, in the model's dtype (forward stopped right there)."""
    mlp = model.sparse_mlps()[layer_idx]
    parts: list[torch.Tensor] = []

    def hook(mod, inp) -> None:
        parts.append(inp[0].detach().reshape(-1, inp[0].shape[-1]))
        raise _Captured

    h = mlp.register_forward_pre_hook(hook)
    try:
        for i in range(0, ids.shape[0], chunk):
            try:
                model.model(input_ids=ids[i:i + chunk])
            except _Captured:
                pass
    finally:
        h.remove()
    return torch.cat(parts)


@torch.no_grad()
def calibrate_paper_model(model, targets: list[float], calib_ids: torch.Tensor, *, heavy_ids: torch.Tensor,
                          heavy_scale: float = 0.5, dead_frac: float = 0.3, spread: float = 0.5,
                          seed: int = 0, chunk: int = 8) -> list[float]:
    """Shape every layer's activity: layer l gets mean non-zeros per token == targets[l] on calib_ids (heavy
    tokens included), ~dead_frac of its neurons never fire, neuron firing rates vary (log-normal-like), and tokens
    in heavy_ids fire many more neurons (heavy tail, paper: max often > 10x the mean). Returns the achieved mean
    per layer on calib_ids. Pass the very tokens that will be timed: the mean is dominated by the few heavy
    tokens (and their activity grows with depth), so it does not carry over to another small token sample.

    Mechanism: residual dimension 0 holds a per-token constant c_v (1, or heavy_scale for heavy tokens) that
    attention and FFN never write to, so after RMSNorm x[0] = s_m > 0 acts as a bias input; gate column 0 is set to
    -(mu_j + (alpha + delta_j) sigma_j) / mean(s), giving pre-activation r_mj - (mu_j + (alpha + delta_j) sigma_j)
    s_m / mean(s), where r is the random part and mu_j, sigma_j its mean and std over the calibration tokens.
    alpha is bisected per layer, layer by layer (later layers see the calibrated earlier ones), on the layer's
    real gate GEMM in the model's dtype with the bias written into the weight, i.e. counting exactly what the
    model computes (bf16 rounding of the bias included); the count is monotone in alpha."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 1.0
    emb[heavy_ids.to(emb.device), 0] = heavy_scale
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0
        layer.mlp.down_proj.weight[0, :] = 0
    # Under autocast the model's weights are cast once per autocast region and cached (leaf tensors requiring grad):
    # every in-place write below must drop that cache, or the counts (and the next layer's inputs) see stale weights.
    torch.clear_autocast_cache()
    n = model.config.intermediate_size
    delta = (spread * torch.randn(n, generator=g))
    dead = torch.rand(n, generator=g) < dead_frac
    delta[dead] = 1e3  # never fires
    achieved = []
    for li, target in enumerate(tqdm(targets, desc="calibrating layers", leave=False)):
        x = _mlp_input(model, li, calib_ids, chunk)  # [M, hidden], model dtype
        wg = model.sparse_mlps()[li].gate_proj.weight
        r = x[:, 1:].float() @ wg[:, 1:].float().t()  # [M, N] random part
        s = x[:, 0].float()
        sbar = s.mean()
        mu, sigma = r.mean(dim=0), r.std(dim=0).clamp(min=1e-6)
        del r
        d = delta.to(x.device)

        def bias(alpha: float) -> torch.Tensor:
            return -(mu + (alpha + d) * sigma) / sbar

        def nnz(alpha: float) -> float:
            wg[:, 0] = bias(alpha).to(wg.dtype)
            torch.clear_autocast_cache()
            cnt = torch.zeros((), device=x.device, dtype=torch.float64)
            for i in range(0, x.shape[0], 16384):  # bounded transient memory at 32 x 2048 tokens
                cnt += (F.linear(x[i:i + 16384], wg) > 0).sum(dtype=torch.float64)
            return float(cnt) / x.shape[0]

        lo, hi = -10.0, 40.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if nnz(mid) > target else (lo, mid)
        # the end of the bracket closer to the target (the count is a step function of alpha)
        alpha = min((lo, hi), key=lambda a_: abs(nnz(a_) - target))
        achieved.append(nnz(alpha))  # also leaves wg[:, 0] = bias(alpha)
    return achieved


# ------------------------------------------------------------------------------------------------ main
def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("experiments/speed/bench.py measures GPU speed, energy and memory: it needs a CUDA GPU "
                         "(none visible). Run it on the H100 machine (bash experiments/speed/run.sh).")
    return torch.device("cuda")


def val_ids(n_seq: int, seq_len: int, data_dir: str | None) -> torch.Tensor:
    """[n_seq, seq_len + 1] validation windows."""
    ddir = Path(data_dir or os.environ.get("SFL_DATA_DIR") or REPO_ROOT / ".data")
    data = TokenData(ddir / "tokens", seq_len)
    if data.n_val_windows < n_seq:
        raise SystemExit(f"--batch {n_seq} x --seq-len {seq_len} needs {n_seq} val windows; the val split has "
                         f"{data.n_val_windows}: lower --batch or --seq-len")
    return data.val_windows(n_seq)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def run_trained(a: argparse.Namespace) -> list[dict[str, Any]]:
    dev = require_cuda()
    mdir = Path(a.model)
    if not (mdir / "config.json").is_file():
        raise SystemExit(f"--model {mdir}: no config.json (a save_pretrained dir such as runs/gpu/l1_sweep/<run>/final)")
    model = SparseLlamaForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).to(dev).eval()
    ids = val_ids(a.batch, a.seq_len, a.data_dir).to(dev)  # [B, seq_len + 1]: training uses shifted targets
    return measure_all(model, ids, a, dev, name=a.name, paper_scale=None, l1=float(model.config.l1_coeff),
                       extra={"checkpoint": str(mdir), "input": "validation tokens"}, train=a.train)


def run_paper(a: argparse.Namespace) -> list[dict[str, Any]]:
    dev = require_cuda()
    rows = []
    levels = [(n, None) for n in a.layers] if not a.nnz_sweep else [(n, v) for n in a.layers for v in a.nnz_sweep]
    for n_layers, sweep_nnz in levels:
        scale = PAPER_SCALES.get(n_layers)
        mean_nnz = sweep_nnz if sweep_nnz is not None else (
            a.nnz_mean if a.nnz_mean is not None else PAPER_NNZ.get(n_layers, 30.0))
        targets = paper_profile(n_layers, mean_nnz)
        model = build_paper_model(n_layers, dev, torch.bfloat16, seed=a.seed)
        g = torch.Generator(device="cpu").manual_seed(a.seed)
        vocab = model.config.vocab_size
        heavy = torch.randperm(vocab, generator=g)[: max(1, int(a.heavy_frac * vocab))]
        ids = torch.randint(0, vocab, (a.batch, a.seq_len + 1), generator=g).to(dev)
        t0 = time.time()
        # calibrated on the timed tokens themselves (a few heavy tokens dominate the mean: another sample of
        # tokens would land elsewhere); the achieved profile is measured again on them in measure_all
        achieved = calibrate_paper_model(model, targets, ids[:, :-1], heavy_ids=heavy, heavy_scale=a.heavy_scale,
                                         dead_frac=a.dead_frac, seed=a.seed)
        cal_mean = sum(achieved) / len(achieved)
        cal_ok = all(abs(v - t) <= CALIB_TOL * t for v, t in zip(achieved, targets))
        print(f"[{n_layers} layers] calibrated in {time.time() - t0:.0f}s: mean non-zeros {cal_mean:.1f} "
              f"(target {mean_nnz:.1f}); per layer within {100 * CALIB_TOL:.0f}%: {cal_ok}", flush=True)
        model.config.l1_coeff = 2e-5  # training side: the paper's recommended sparse recipe (L1 on)
        model.config.l1_reduction = "sum"
        name = f"paper-shape {scale}" if scale else f"paper-shape {n_layers} layers"
        if sweep_nnz is not None:  # its own model key, so Table 1 (the paper's activity) never picks these rows
            name, scale = f"{name}, {sweep_nnz:g} non-zeros/token", None
        extra = {"calibration_s": round(time.time() - t0, 1), "target_nnz_mean": mean_nnz,
                 "calibration_nnz_per_layer": achieved, "calibration_nnz_mean": cal_mean,
                 "calibration_ok": cal_ok, "calibration_tol": CALIB_TOL, "calibration_tokens": "the timed batch",
                 "target_nnz_per_layer": targets, "target_note": ("activity sweep (mean set by --nnz-sweep)" if sweep_nnz is not None
                                                                  else "user (--nnz-mean)" if a.nnz_mean is not None
                                                                  else "paper §4.2 mean at L1=2e-5" if n_layers in (8, 28, 38)
                                                                  else "interpolated (1B not published)" if n_layers == 18
                                                                  else "user/default"),
                 "seed": a.seed, "heavy_frac": a.heavy_frac, "heavy_scale": a.heavy_scale, "dead_frac_target": a.dead_frac,
                 "input": "random token ids", "num_hidden_layers": n_layers,
                 "activity_sweep_of": (PAPER_SCALES.get(n_layers) or f"{n_layers} layers") if sweep_nnz is not None else None}
        new = measure_all(model, ids, a, dev, name=name, paper_scale=scale, l1=None, extra=extra,
                          train=a.train and n_layers in a.train_layers)
        write_rows(a.out, new)  # per shape: a run cut short keeps the shapes it finished
        rows += new
        del model
        torch.cuda.empty_cache()
    return rows


def _summary(r: dict[str, Any]) -> str:
    """One log line: tokens/ms per side, the speed-up, the block-pair range and the block spread."""
    def tpm(side: str) -> str:
        v = r.get(f"{side}_tokens_per_s")
        return "n/a" if v is None else f"{v / 1e3:.1f} tok/ms (blocks spread {r[f'{side}_block_spread_pct']:.1f}%)"
    line = f"dense {tpm('dense')}, sparse {tpm('sparse')}"
    if "speedup_sparse_over_dense" in r:
        line += (f"; sparse vs dense {100 * (r['speedup_sparse_over_dense'] - 1):+.1f}% (block pairs "
                 f"{100 * (r['speedup_block_pairs_min'] - 1):+.1f}%..{100 * (r['speedup_block_pairs_max'] - 1):+.1f}%)")
    return line


def measure_all(model, ids: torch.Tensor, a: argparse.Namespace, dev: torch.device, *, name: str,
                paper_scale: str | None, l1: float | None, extra: dict[str, Any], train: bool = True) -> list[dict]:
    meter = EnergyMeter(dev.index if dev.index is not None else torch.cuda.current_device())
    kcfg = use_kernel_config(model, a.sparse_mode, getattr(a, "kernel_env", None))
    act = activity(model, ids[:, :-1])
    common = {"model": name, "paper_scale": paper_scale, "l1_coeff": l1, "batch_size": a.batch, "seq_len": a.seq_len,
              "hidden_size": model.config.hidden_size, "intermediate_size": model.config.intermediate_size,
              "num_hidden_layers": model.config.num_hidden_layers, "gated_mlp": model.config.gated_mlp,
              "sparse_mode": a.sparse_mode, "kernel_config": kcfg.to_dict(), "energy_method": meter.method,
              "energy_note": meter.note, **act, **extra}
    print(f"[{name}] non-zeros per token: mean {act['nnz_mean']:.1f}, max {act['nnz_max']:.0f} "
          f"(of {model.config.intermediate_size})", flush=True)
    rows = []
    inf = measure_inference(model, ids[:, :-1], a.sparse_mode, a.min_seconds, a.warmup, meter, a.blocks)
    rows.append({**common, "mode": "inference", "batch_tokens": ids[:, :-1].numel(), "timed": "model.model forward "
                 "(no lm_head), bf16 weights, inference_mode", **inf, "provenance": collect()})
    print(f"[{name}] inference: {_summary(inf)}; layers mostly sparse: "
          f"{inf.get('sparse_layers_mostly_sparse')}/{model.config.num_hidden_layers}", flush=True)
    if getattr(a, "with_lm_head", False):
        full = measure_inference(model, ids[:, :-1], a.sparse_mode, a.min_seconds, a.warmup, meter, a.blocks, lm_head=True)
        rows.append({**common, "mode": "inference_lm_head", "batch_tokens": ids[:, :-1].numel(), "timed": "whole model "
                     "forward (lm_head included), bf16 weights, inference_mode", **full, "provenance": collect()})
        print(f"[{name}] inference with lm_head: {_summary(full)}", flush=True)
    if getattr(a, "layer_times", False):
        lt_ids = ids[: max(1, 16384 // a.seq_len), :-1]
        lt = layer_times(model, lt_ids)
        rows.append({**common, "mode": "layer_times", "batch_tokens": lt_ids.numel(), "timed": "each layer's FFN "
                     "alone on its own input: dense (3 GEMMs), sparse op auto, sparse op forced (median of 20)",
                     "layer_times": lt, "provenance": collect()})
        print(f"[{name}] per-layer times: dense {sum(r['dense_ms'] for r in lt):.2f} ms, forced sparse "
              f"{sum(r['sparse_forced_ms'] for r in lt):.2f} ms over {len(lt)} layers", flush=True)
    if train:
        mb = min(a.train_micro_batch, ids.shape[0])
        tr = measure_training(model, ids, mb, a.train_impl, a.warmup, a.min_seconds, meter, a.blocks)
        rows.append({**common, "mode": "training", "batch_tokens": mb * a.seq_len, "timed": "forward (with the model's L1) + "
                     "backward + AdamW, fp32 weights + bf16 autocast", **tr, "provenance": collect()})
        print(f"[{name}] training: {_summary(tr)} {tr.get('sparse_note') or ''}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    for p in (sub.add_parser("trained", help="a trained checkpoint on validation tokens"),
              sub.add_parser("paper", help="the paper's shapes with calibrated activity")):
        p.add_argument("--batch", type=int, default=None, help="sequences per forward (trained 64, paper 32)")
        p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (trained 512, paper 2048)")
        p.add_argument("--sparse-mode", default="auto", choices=["auto", "sparse"],
                       help="KernelConfig.mode of the sparse side: auto may run dense where sparsity does not pay; "
                            "sparse forces TwELL")
        p.add_argument("--train-impl", default="cuda", help="mlp_impl for the sparse training side")
        p.add_argument("--train-micro-batch", type=int, default=8)
        p.add_argument("--min-seconds", type=float, default=3.0, help="minimum timed seconds per side")
        p.add_argument("--blocks", type=int, default=6,
                       help="timed blocks per side, interleaved dense/sparse (ABBA...); the median block is reported")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--data-dir", default=None)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", default=None)
    t = sub.choices["trained"]
    t.add_argument("--model", required=True)
    t.add_argument("--name", required=True, help="model key, <experiment>/<run>, e.g. l1_sweep/relu_l1_1e-3")
    t.add_argument("--no-train", dest="train", action="store_false")
    p = sub.choices["paper"]
    p.add_argument("--layers", type=int, nargs="+", default=[8, 18, 28, 38])
    p.add_argument("--train", action="store_true", help="also time training (memory: fp32 weights + AdamW)")
    p.add_argument("--train-layers", type=int, nargs="+", default=[8, 18])
    p.add_argument("--nnz-mean", type=float, default=None, help="target mean non-zeros per token (default: paper's)")
    p.add_argument("--nnz-sweep", type=float, nargs="+", default=None,
                   help="time each --layers shape at each of these mean non-zeros per token (Fig. 4/5 counterpart: "
                        "speed-up against activity); rows are keyed 'paper-shape <scale>, <v> non-zeros/token'")
    p.add_argument("--heavy-frac", type=float, default=0.01, help="fraction of the vocabulary that fires heavily")
    p.add_argument("--heavy-scale", type=float, default=0.5, help="bias scale of heavy tokens (< 1: more active)")
    p.add_argument("--dead-frac", type=float, default=0.3, help="fraction of never-firing neurons (paper: >30%%)")
    for p in (sub.choices["trained"], sub.choices["paper"]):
        p.add_argument("--with-lm-head", action="store_true",
                       help="also time the whole model (lm_head included) beside the decoder core (mode inference_lm_head)")
        p.add_argument("--layer-times", action="store_true",
                       help="also time every layer's FFN alone, dense vs sparse auto vs forced, on 16 K tokens "
                            "(mode layer_times: the per-layer speed contribution)")
    a = ap.parse_args(argv)
    a.kernel_env = {k: v for k, v in os.environ.items() if k.startswith("SFL_KERNEL_")}   # read once
    if a.blocks < 1:
        ap.error("--blocks must be >= 1 (timed blocks per side)")
    a.batch = a.batch or (64 if a.what == "trained" else 32)
    a.seq_len = a.seq_len or (512 if a.what == "trained" else 2048)
    out = Path(a.out) if a.out else REPO_ROOT / "results" / "speed" / ("trained.jsonl" if a.what == "trained"
                                                                          else "paper_shapes.jsonl")
    a.out = out
    rows = run_paper(a) if a.what == "paper" else run_trained(a)
    if a.what == "trained":
        write_rows(out, rows)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
