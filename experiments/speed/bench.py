"""Model-level speed, energy and memory, dense vs sparse (paper Table 1 efficiency columns, Figs 4, 5). GPU only.

    # (a) a trained checkpoint, on real validation tokens
    python -m experiments.speed.bench trained --model runs/gpu/l1_sweep/relu_l1_1e-3/final --name l1_sweep/relu_l1_1e-3
    # (b) the paper's shapes (hidden 2048, N 5632, 32 heads; 8/18/28/38 layers = 0.5B/1B/1.5B/2B), random weights
    #     whose gates are calibrated to a paper-like activity profile (mean ~24-39 non-zeros per token, heavy tail)
    python -m experiments.speed.bench paper --layers 8 [--train]

Appends one JSON row per (model, mode) to --out (default results/speed/<trained|paper_shapes>.jsonl; schema in
notebooks/README.md): model, paper_scale, l1_coeff, mode (inference|training), dense_/sparse_tokens_per_s,
dense_/sparse_energy_j_per_token (NVML; null + energy_note when unavailable), dense_/sparse_peak_mem_gb,
batch_tokens, nnz_mean (+ per-layer profile), provenance, and what was timed.

What is timed
- inference: the decoder core `model.model` (no lm_head, as the official benchmark), bf16 weights, under
  inference_mode; "dense" = three cuBLAS GEMMs per FFN (relu(x Wg^T) * (x Wu^T)) Wd^T, "sparse" = kernels.ffn
  (TwELL, mode --sparse-mode). Both FFNs are plain functions swapped in for timing, so neither pays for the
  model's sparsity statistics; non-zeros are measured in a separate untimed pass. Each side runs >= --min-seconds.
- training: full steps (forward with the L1 loss, backward, AdamW) on fp32 weights under bf16 autocast, as
  experiments/train.py runs them; peak memory = torch.cuda.max_memory_allocated over the timed steps. The sparse
  side needs a training-capable sparse mlp_impl (--train-impl); until the training kernels exist it is recorded
  as null with the reason.
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

REPO_ROOT = Path(__file__).resolve().parents[2]
PAPER_SCALES = {8: "0.5B", 18: "1B", 28: "1.5B", 38: "2B"}
# Mean non-zeros per token per layer at L1 = 2e-5 (paper §4.2 [2]: 39 at 0.5B, 29 at 1.5B, 24 at 2B); the 1B
# value is not published: 34 is our interpolation, labelled as such in the rows.
PAPER_NNZ = {8: 39.0, 18: 34.0, 28: 29.0, 38: 24.0}


# ------------------------------------------------------------------------------------------------ energy
class EnergyMeter:
    """Whole-GPU energy over a code block: NVML energy counter, else NVML power sampling, else None + reason."""

    def __init__(self, device_index: int) -> None:
        self.note: str | None = None
        self.method: str | None = None
        self.handle = None
        try:
            import pynvml  # provided by the nvidia-ml-py package
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
def _dense_ffn(mlp, x: torch.Tensor) -> torch.Tensor:
    if mlp.gated:
        return F.linear(F.relu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                        mlp.down_proj.weight)
    return F.linear(F.relu(F.linear(x, mlp.up_proj.weight)), mlp.down_proj.weight)


def _sparse_ffn_factory(mode: str) -> Callable:
    from kernels import ffn

    def fwd(mlp, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if mlp.gated:
            y = ffn.sparse_gated_ffn(x2, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mode=mode)
        else:
            y = ffn.sparse_nongated_ffn(x2, mlp.up_proj.weight, mlp.down_proj.weight, mode=mode)
        return y.reshape(shape)
    return fwd


@contextlib.contextmanager
def plain_ffns(model, fn: Callable) -> Iterator[None]:
    """Replace every SparseLlamaMLP.forward by `fn(mlp, x)` (no statistics, no L1) for the duration."""
    mlps = model.sparse_mlps()
    for m in mlps:
        m.forward = types.MethodType(fn, m)
    try:
        yield
    finally:
        for m in mlps:
            del m.forward


# ------------------------------------------------------------------------------------------------ timing
def timed_loop(step: Callable[[], Any], min_seconds: float, warmup: int, meter: EnergyMeter) -> dict[str, Any]:
    """Warm up, estimate reps for >= min_seconds, then time `reps` calls with energy; returns seconds per call."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, math.ceil(min_seconds / one))
    with meter.measure() as energy:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"s_per_call": wall / reps, "reps": reps, "joules": energy["joules"]}


def measure_inference(model, ids: torch.Tensor, sparse_mode: str, min_seconds: float, warmup: int,
                      meter: EnergyMeter) -> dict[str, Any]:
    """Decoder-core forward tokens/s, J/token and peak memory, dense vs sparse; plus a correctness check."""
    n_tok = ids.numel()
    out: dict[str, Any] = {}
    outputs = {}
    for side, fn in (("dense", _dense_ffn), ("sparse", _sparse_ffn_factory(sparse_mode))):
        with plain_ffns(model, fn), torch.inference_mode():
            torch.cuda.reset_peak_memory_stats()
            r = timed_loop(lambda: model.model(input_ids=ids), min_seconds, warmup, meter)
            # checked after timing, on the timed batch: the sparse side's per-layer dispatch history is then
            # the one the timed calls used (a layer's first call runs dense by design)
            outputs[side] = model.model(input_ids=ids).last_hidden_state.float()
        out[f"{side}_tokens_per_s"] = n_tok / r["s_per_call"]
        out[f"{side}_ms_per_forward"] = 1000 * r["s_per_call"]
        out[f"{side}_energy_j_per_token"] = None if r["joules"] is None else r["joules"] / (n_tok * r["reps"])
        out[f"{side}_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out[f"{side}_reps"] = r["reps"]
    d, s = outputs["dense"], outputs["sparse"]
    out["max_rel_diff_sparse_vs_dense"] = float((s - d).abs().max() / d.abs().max().clamp(min=1e-6))
    out["rel_l2_diff_sparse_vs_dense"] = float((s - d).norm() / d.norm().clamp(min=1e-6))
    return out


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


def measure_training(model, ids: torch.Tensor, micro_batch: int, train_impl: str, steps: int, warmup: int,
                     min_seconds: float, meter: EnergyMeter) -> dict[str, Any]:
    """Training tokens/s, J/token and peak memory (fp32 weights + bf16 autocast + AdamW, L1 loss on),
    dense mlp_impl vs `train_impl`. Leaves the model in fp32 with updated weights: call it last."""
    out: dict[str, Any] = {"train_impl": train_impl}
    model.float().train()
    coeff = float(model.config.l1_coeff)  # the model's own recipe: L1 = 0 models train without the penalty
    x = ids[:micro_batch]
    for side, impl in (("dense", "dense"), ("sparse", train_impl)):
        try:
            model.set_mlp_impl(impl)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x[:, :-1], shift_labels=x[:, 1:], l1_coeff=coeff).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # allocates optimizer state before the peak-memory window
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            r = timed_loop(step, min_seconds, warmup, meter)
            n_tok = x[:, :-1].numel()
            out[f"{side}_tokens_per_s"] = n_tok / r["s_per_call"]
            out[f"{side}_energy_j_per_token"] = None if r["joules"] is None else r["joules"] / (n_tok * r["reps"])
            out[f"{side}_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
            del opt
        except (NotImplementedError, ValueError, RuntimeError, ImportError) as e:
            out[f"{side}_tokens_per_s"] = out[f"{side}_energy_j_per_token"] = out[f"{side}_peak_mem_gb"] = None
            out[f"{side}_note"] = f"not measured: {type(e).__name__}: {str(e)[:300]}"
            model.zero_grad(set_to_none=True)
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
    from models import SparseLlamaConfig, SparseLlamaForCausalLM

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
    from models import SparseLlamaConfig, SparseLlamaForCausalLM

    cfg = SparseLlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=n, num_hidden_layers=n_layers,
                            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                            tie_word_embeddings=True, gated_mlp=True, mlp_impl="dense")
    with torch.device(device):
        return SparseLlamaForCausalLM(cfg).eval()


@torch.no_grad()
def calibrate_paper_model(model, targets: list[float], calib_ids: torch.Tensor, *, heavy_ids: torch.Tensor,
                          heavy_scale: float = 0.5, dead_frac: float = 0.3, spread: float = 0.5,
                          seed: int = 0) -> None:
    """Shape every layer's activity: layer l gets mean non-zeros per token ~= targets[l] on calib_ids, ~dead_frac
    of its neurons never fire, neuron firing rates vary (log-normal-like), and tokens in heavy_ids fire many more
    neurons (heavy tail, paper: max often > 10x the mean).

    Mechanism: residual dimension 0 holds a per-token constant c_v (1, or heavy_scale for heavy tokens) that
    attention and FFN never write to, so after RMSNorm x[0] = s_m > 0 acts as a bias input; gate column 0 is set to
    -(mu_j + (alpha + delta_j) sigma_j) / mean(s), giving pre-activation r_mj - (mu_j + (alpha + delta_j) sigma_j)
    s_m / mean(s), where r is the random part and mu_j, sigma_j its mean and std over the calibration tokens. alpha is bisected per layer on the calibration batch, layer by layer (later
    layers see the calibrated earlier ones)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    emb = model.model.embed_tokens.weight
    emb[:, 0] = 1.0
    emb[heavy_ids.to(emb.device), 0] = heavy_scale
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0
        layer.mlp.down_proj.weight[0, :] = 0
    n = model.config.intermediate_size
    delta = (spread * torch.randn(n, generator=g))
    dead = torch.rand(n, generator=g) < dead_frac
    delta[dead] = 1e3  # never fires
    captured: list[torch.Tensor] = []
    for li, (layer, target) in enumerate(zip(model.model.layers, targets)):
        h = layer.mlp.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].detach()))
        captured.clear()
        model.model(input_ids=calib_ids)
        h.remove()
        x = captured[0].reshape(-1, captured[0].shape[-1]).float()
        wg = layer.mlp.gate_proj.weight
        r = x[:, 1:] @ wg[:, 1:].float().t()  # [M, N] random part
        s = x[:, 0]
        sbar = s.mean()
        mu, sigma = r.mean(dim=0), r.std(dim=0).clamp(min=1e-6)
        d = delta.to(r.device)

        def nnz(alpha: float) -> float:
            z = r - (mu + (alpha + d) * sigma)[None, :] * (s / sbar)[:, None]
            return float((z > 0).sum(dim=1).float().mean())

        lo, hi = -10.0, 40.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if nnz(mid) > target else (lo, mid)
        alpha = (lo + hi) / 2
        wg[:, 0] = (-(mu + (alpha + d) * sigma) / sbar).to(wg.dtype)


# ------------------------------------------------------------------------------------------------ main
def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("experiments/speed/bench.py measures GPU speed, energy and memory: it needs a CUDA GPU "
                         "(none visible). Run it on the H100 machine (bash experiments/speed/run.sh).")
    return torch.device("cuda")


def val_ids(n_seq: int, seq_len: int, data_dir: str | None) -> torch.Tensor:
    """[n_seq, seq_len + 1] validation windows."""
    from experiments.data_loader import TokenData

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
    import models  # noqa: F401
    from models import SparseLlamaForCausalLM

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
    for n_layers in a.layers:
        scale = PAPER_SCALES.get(n_layers)
        mean_nnz = a.nnz_mean if a.nnz_mean is not None else PAPER_NNZ.get(n_layers, 30.0)
        targets = paper_profile(n_layers, mean_nnz)
        model = build_paper_model(n_layers, dev, torch.bfloat16, seed=a.seed)
        g = torch.Generator(device="cpu").manual_seed(a.seed)
        vocab = model.config.vocab_size
        heavy = torch.randperm(vocab, generator=g)[: max(1, int(a.heavy_frac * vocab))]
        calib = torch.randint(0, vocab, (a.calib_seqs, a.seq_len), generator=g).to(dev)
        t0 = time.time()
        calibrate_paper_model(model, targets, calib, heavy_ids=heavy, heavy_scale=a.heavy_scale,
                              dead_frac=a.dead_frac, seed=a.seed)
        ids = torch.randint(0, vocab, (a.batch, a.seq_len + 1), generator=g).to(dev)  # fresh tokens, not calib
        model.config.l1_coeff = 2e-5  # training side: the paper's recommended sparse recipe (L1 on)
        model.config.l1_reduction = "sum"
        name = f"paper-shape {scale}" if scale else f"paper-shape {n_layers} layers"
        extra = {"calibration_s": round(time.time() - t0, 1), "target_nnz_mean": mean_nnz,
                 "target_nnz_per_layer": targets, "target_note": ("paper §4.2 mean at L1=2e-5" if n_layers in (8, 28, 38)
                                                                  else "interpolated (1B not published)" if n_layers == 18
                                                                  else "user/default"),
                 "heavy_frac": a.heavy_frac, "heavy_scale": a.heavy_scale, "dead_frac_target": a.dead_frac,
                 "input": "random token ids", "num_hidden_layers": n_layers}
        rows += measure_all(model, ids, a, dev, name=name, paper_scale=scale, l1=None, extra=extra,
                            train=a.train and n_layers in a.train_layers)
        del model
        torch.cuda.empty_cache()
    return rows


def measure_all(model, ids: torch.Tensor, a: argparse.Namespace, dev: torch.device, *, name: str,
                paper_scale: str | None, l1: float | None, extra: dict[str, Any], train: bool = True) -> list[dict]:
    from experiments.provenance import collect

    meter = EnergyMeter(dev.index if dev.index is not None else torch.cuda.current_device())
    act = activity(model, ids[:, :-1])
    common = {"model": name, "paper_scale": paper_scale, "l1_coeff": l1, "batch_size": a.batch, "seq_len": a.seq_len,
              "hidden_size": model.config.hidden_size, "intermediate_size": model.config.intermediate_size,
              "num_hidden_layers": model.config.num_hidden_layers, "gated_mlp": model.config.gated_mlp,
              "sparse_mode": a.sparse_mode, "energy_method": meter.method, "energy_note": meter.note, **act, **extra}
    print(f"[{name}] non-zeros per token: mean {act['nnz_mean']:.1f}, max {act['nnz_max']:.0f} "
          f"(of {model.config.intermediate_size})", flush=True)
    rows = []
    inf = measure_inference(model, ids[:, :-1], a.sparse_mode, a.min_seconds, a.warmup, meter)
    rows.append({**common, "mode": "inference", "batch_tokens": ids[:, :-1].numel(), "timed": "model.model forward "
                 "(no lm_head), bf16 weights, inference_mode", **inf, "provenance": collect()})
    print(f"[{name}] inference: dense {inf['dense_tokens_per_s'] / 1e3:.1f} tok/ms, sparse "
          f"{inf['sparse_tokens_per_s'] / 1e3:.1f} tok/ms ({100 * (inf['sparse_tokens_per_s'] / inf['dense_tokens_per_s'] - 1):+.1f}%)",
          flush=True)
    if train:
        mb = min(a.train_micro_batch, ids.shape[0])
        tr = measure_training(model, ids, mb, a.train_impl, a.train_steps, a.warmup, a.min_seconds, meter)
        rows.append({**common, "mode": "training", "batch_tokens": mb * a.seq_len, "timed": "forward (with the model's L1) + "
                     "backward + AdamW, fp32 weights + bf16 autocast", **tr, "provenance": collect()})
        sp = tr.get("sparse_tokens_per_s")
        print(f"[{name}] training: dense {tr['dense_tokens_per_s'] / 1e3 if tr.get('dense_tokens_per_s') else float('nan'):.1f} tok/ms, "
              f"sparse {sp / 1e3 if sp else float('nan'):.1f} tok/ms {tr.get('sparse_note', '')}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    for p in (sub.add_parser("trained", help="a trained checkpoint on validation tokens"),
              sub.add_parser("paper", help="the paper's shapes with calibrated activity")):
        p.add_argument("--batch", type=int, default=None, help="sequences per forward (trained 64, paper 32)")
        p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (trained 512, paper 2048)")
        p.add_argument("--sparse-mode", default="auto", choices=["auto", "sparse"],
                       help="kernels.ffn mode: auto may run dense where sparsity does not pay; sparse forces TwELL")
        p.add_argument("--train-impl", default="cuda", help="mlp_impl for the sparse training side")
        p.add_argument("--train-micro-batch", type=int, default=8)
        p.add_argument("--train-steps", type=int, default=10)
        p.add_argument("--min-seconds", type=float, default=3.0, help="minimum timed seconds per side")
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
    p.add_argument("--heavy-frac", type=float, default=0.01, help="fraction of the vocabulary that fires heavily")
    p.add_argument("--heavy-scale", type=float, default=0.5, help="bias scale of heavy tokens (< 1: more active)")
    p.add_argument("--dead-frac", type=float, default=0.3, help="fraction of never-firing neurons (paper: >30%%)")
    p.add_argument("--calib-seqs", type=int, default=4)
    a = ap.parse_args(argv)
    a.batch = a.batch or (64 if a.what == "trained" else 32)
    a.seq_len = a.seq_len or (512 if a.what == "trained" else 2048)
    out = Path(a.out) if a.out else REPO_ROOT / "results" / "speed" / ("trained.jsonl" if a.what == "trained"
                                                                          else "paper_shapes.jsonl")
    rows = run_trained(a) if a.what == "trained" else run_paper(a)
    write_rows(out, rows)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
