"""Where the non-zeros are (paper Figs 6, 7, 10, 11): per-layer, per-token, per-position and per-neuron activity
of a trained checkpoint over held-out tokens, plus (on a GPU with the TwELL kernels) each layer's FFN time
dense vs sparse, i.e. its share of the speed-up.

    python -m sfl.experiments.activation_analysis.analyze --model runs/gpu/l1_sweep/relu_l1_1e-3/final \
        --name l1_sweep/relu_l1_1e-3 [--tokens 262144] [--seq-len 512] [--out results/activation_analysis]

Appends to <out>/ (schemas: notebooks/README.md "results/activation_analysis/"), replacing earlier rows of the
same --name so a rerun never duplicates:
  per_layer.jsonl  model, l1_coeff, layer, nnz_mean, nnz_max, dead_frac, dense_ms, sparse_ms (auto dispatch),
                   sparse_forced_ms, path, flagged_rows_frac, n_tokens[, figure]
  tokens.jsonl     model, l1_coeff, token, token_id, count, nnz_mean, group ('lowest'|'highest')
  position.jsonl   model, l1_coeff, position, nnz_mean, n
  neurons.jsonl    model, l1_coeff, layer, n_tokens, dead_frac, bin_edges, counts (per-neuron firing frequency
                   histogram: bin 0 = never fired, then log-spaced frequency bins), quantiles
Every row carries `provenance`. "Non-zeros" of a token = active FFN neurons (relu(gate) != 0) in one layer;
per-token and per-position values are means over layers. Token frequency filter as in the paper: tokens rarer
than 1/2^14 of the counted tokens are dropped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer

from sfl.kernels.timing import time_layers
from sfl.models import SparseLlamaForCausalLM

from ..trainer.data_loader import TokenData
from ..trainer.provenance import collect

REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_TOKEN_FREQ = 2.0 ** -14
N_EXTREME_TOKENS = 30


class ActivityRecorder:
    """Forward hooks on every SparseLlamaMLP: per-layer nnz per token (the model's own count) and per-neuron
    firing counts (recomputed from the MLP input with the same weights, in the same autocast dtype)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.mlps = model.sparse_mlps()
        n_layers, n = len(self.mlps), self.mlps[0].intermediate_size
        dev = next(model.parameters()).device
        self.nnz_sum = torch.zeros(n_layers, dtype=torch.float64, device=dev)
        self.nnz_max = torch.zeros(n_layers, device=dev)
        self.fire = torch.zeros(n_layers, n, dtype=torch.int64, device=dev)
        self.batch_nnz: list[torch.Tensor | None] = [None] * n_layers  # [M] of the current batch per layer
        self.n_tokens = 0
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.mlps)]
        self._recording_was = [m.record_per_token for m in self.mlps]
        model.record_nnz_per_token(True)  # per-token counts are kept only on request

    def _hook(self, i: int):
        def hook(mod, inp, out):
            nnz = mod.last_nnz_per_token.reshape(-1).float()
            self.batch_nnz[i] = nnz
            self.nnz_sum[i] += nnz.sum(dtype=torch.float64)
            self.nnz_max[i] = torch.maximum(self.nnz_max[i], nnz.max())
            x2 = inp[0].reshape(-1, inp[0].shape[-1])
            w = mod.gate_proj if mod.gated else mod.up_proj
            a = F.relu(F.linear(x2, w.weight, w.bias))
            self.fire[i] += (a != 0).sum(dim=0)  # NaN != 0: counts as active, as everywhere else
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for m, was in zip(self.mlps, self._recording_was):
            m.record_per_token = was
            if not was:
                m.last_nnz_per_token = None


def load_model(model_dir: Path, device: torch.device):
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"--model {model_dir}: no config.json; pass a save_pretrained dir such as "
                         "runs/gpu/l1_sweep/<run>/final")
    if json.loads(cfg_path.read_text()).get("model_type") != "sparse_llama":
        raise SystemExit(f"--model {model_dir}: not a sparse_llama checkpoint (train one with experiments/trainer/train.py)")
    model = SparseLlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.set_mlp_impl("dense")
    return model


def decode_token(tok: Any, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else str(token_id)


def replace_rows(path: Path, model_name: str, rows: list[dict[str, Any]]) -> None:
    """Rewrite path without earlier rows of this model, then append the new ones (via a temp file + rename)."""
    kept = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("model") != model_name:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    tmp.write_text("".join(x + "\n" for x in kept + [json.dumps(r) for r in rows]))
    os.replace(tmp, path)


def pick_device(device: str) -> torch.device:
    """--device: "auto" is CUDA when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(model_dir: Path, ddir: Path) -> Any:
    """The checkpoint's tokenizer, else the prepared data's; None (tokens reported by id) when neither loads."""
    where = model_dir if (model_dir / "tokenizer.json").is_file() else ddir / "tokenizer"
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        print(f"note: no tokenizer ({e}); tokens are reported by id", file=sys.stderr)
        return None


class Activity:
    """The counts of one pass over the held-out windows: per layer and neuron (the ActivityRecorder), per token id
    and per position (means over layers of each token's non-zeros)."""

    def __init__(self, model: torch.nn.Module, vocab: int, seq_len: int, dev: torch.device) -> None:
        self.tok_sum = torch.zeros(vocab, dtype=torch.float64, device=dev)
        self.tok_cnt = torch.zeros(vocab, dtype=torch.float64, device=dev)
        self.pos_sum = torch.zeros(seq_len, dtype=torch.float64, device=dev)
        self.pos_cnt = 0
        self.rec = ActivityRecorder(model)

    def add(self, x: torch.Tensor, vocab: int) -> None:
        """One batch's counts, after the model's forward on x [B, T] (the recorder holds its per-layer nnz)."""
        per_tok = torch.stack([n.reshape(x.shape) for n in self.rec.batch_nnz]).mean(0).double()  # [B, T]
        ids = x.reshape(-1)
        self.tok_sum += torch.bincount(ids, weights=per_tok.reshape(-1), minlength=vocab)
        self.tok_cnt += torch.bincount(ids, minlength=vocab).double()
        self.pos_sum += per_tok.sum(0)
        self.pos_cnt += x.shape[0]
        self.rec.n_tokens += x.numel()


def count_activity(model: torch.nn.Module, windows: torch.Tensor, name: str, seq_len: int, batch: int,
                   dev: torch.device, keep_timing_inputs: bool) -> tuple[Activity, list[torch.Tensor]]:
    """Forward every window, counting non-zeros; with keep_timing_inputs, the first batch's MLP inputs too (bf16,
    as the model's autocast forward sees them) for the timing pass."""
    cfg = model.config
    vocab, n_layers = int(cfg.vocab_size), cfg.num_hidden_layers
    act = Activity(model, vocab, seq_len, dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    timing_inputs: list[torch.Tensor] = []
    grab: list[Any] = []
    if keep_timing_inputs:
        grab = [m.register_forward_hook(lambda mod, inp, out: timing_inputs.append(
            inp[0].reshape(-1, inp[0].shape[-1]).to(torch.bfloat16).contiguous()) if len(timing_inputs) < n_layers
            else None) for m in model.sparse_mlps()]
    with torch.no_grad(), amp:
        for i in tqdm(range(0, len(windows), batch), desc=f"analyze {name}", dynamic_ncols=True):
            x = windows[i:i + batch, :-1].to(dev)
            model(input_ids=x)
            for h in grab:
                h.remove()
            grab = []
            act.add(x, vocab)
    act.rec.remove()
    return act, timing_inputs


def layer_times(model: torch.nn.Module, timing_inputs: list[torch.Tensor], timing: bool,
                dev: torch.device) -> tuple[list[dict[str, Any]], str | None]:
    """Per layer, the FFN times dense vs sparse ({} each when not timed), and why not when asked for but not timed."""
    times: list[dict[str, Any]] = [{}] * model.config.num_hidden_layers
    if timing and dev.type == "cuda":
        try:
            return time_layers(model.sparse_mlps(), timing_inputs), None
        except Exception as e:  # noqa: BLE001 - kernels missing/unsupported: record why, keep the activity data
            return times, f"{type(e).__name__}: {e}"
    if timing:
        return times, "no CUDA device: per-layer FFN times need the TwELL kernels on a GPU"
    return times, None


def per_layer_rows(act: Activity, fire_frac: torch.Tensor, times: list[dict[str, Any]], timing_note: str | None,
                   base: dict[str, Any], cfg: Any, seq_len: int, batch: int, figure: str | None,
                   prov: dict[str, Any]) -> list[dict[str, Any]]:
    """per_layer.jsonl: each layer's non-zeros per token, dead neurons and FFN times."""
    rec, n_tok = act.rec, act.rec.n_tokens
    rows = []
    for i in range(cfg.num_hidden_layers):
        r = dict(base, layer=i, nnz_mean=float(rec.nnz_sum[i] / n_tok), nnz_max=float(rec.nnz_max[i]),
                 dead_frac=float((fire_frac[i] == 0).double().mean()),
                 dense_ms=times[i].get("dense_ms"), sparse_ms=times[i].get("sparse_ms"),
                 sparse_forced_ms=times[i].get("sparse_forced_ms"), path=times[i].get("path"),
                 flagged_rows_frac=times[i].get("flagged_rows_frac"),
                 max_abs_diff_vs_dense=times[i].get("max_abs_diff_vs_dense"), n_tokens=n_tok,
                 intermediate_size=int(cfg.intermediate_size), seq_len=seq_len, timing_batch_tokens=(
                     batch * seq_len if times[i] else None), provenance=prov)
        if timing_note:
            r["timing_note"] = timing_note
        if figure:
            r["figure"] = figure
        rows.append(r)
    return rows


def token_rows(act: Activity, tok: Any, base: dict[str, Any], prov: dict[str, Any]) -> list[dict[str, Any]]:
    """tokens.jsonl: the tokens (at least MIN_TOKEN_FREQ of those counted) with the fewest and the most non-zeros."""
    n_tok = act.rec.n_tokens
    cnt = act.tok_cnt.cpu()
    mean_by_tok = (act.tok_sum.cpu() / cnt.clamp(min=1))
    keep = torch.nonzero(cnt >= MIN_TOKEN_FREQ * n_tok).reshape(-1)
    order = keep[torch.argsort(mean_by_tok[keep])]
    k = min(N_EXTREME_TOKENS, len(order) // 2)
    rows = []
    for group, ids in (("lowest", order[:k]), ("highest", order[len(order) - k:].flip(0))):
        for t in ids.tolist():
            rows.append(dict(base, token=decode_token(tok, t), token_id=t, count=int(cnt[t]),
                             nnz_mean=float(mean_by_tok[t]), group=group, n_tokens=n_tok,
                             min_freq=MIN_TOKEN_FREQ, provenance=prov))
    return rows


def neuron_rows(fire_frac: torch.Tensor, n_tok: int, base: dict[str, Any],
                prov: dict[str, Any]) -> list[dict[str, Any]]:
    """neurons.jsonl: per layer, the histogram of the neurons' firing frequencies. Bin 0 = never fired; then 4
    log-spaced bins per decade from 1/n_tok to 1."""
    lo = math.floor(math.log10(1.0 / n_tok))
    edges = [10 ** (lo + j / 4) for j in range(-4 * lo + 1)]
    rows = []
    for i in range(fire_frac.shape[0]):
        f = fire_frac[i]
        counts = [int((f == 0).sum())] + [int(((f > a) & (f <= b)).sum()) for a, b in zip([0.0] + edges[:-1], edges)]
        rows.append(dict(base, layer=i, n_tokens=n_tok, dead_frac=float((f == 0).double().mean()),
                         bin_edges=[0.0] + edges, counts=counts,
                         quantiles={str(q): float(torch.quantile(f, q)) for q in (0.5, 0.9, 0.99, 1.0)},
                         provenance=prov))
    return rows


def analyze(model_dir: Path, name: str, out_dir: Path, tokens: int, seq_len: int, batch: int, device: str,
            data_dir: str | None, figure: str | None, timing: bool) -> dict[str, Any]:
    """Count the non-zeros of the checkpoint at model_dir over `tokens` held-out tokens, time its layers (GPU), and
    replace the rows of `name` in out_dir's four logs; returns a one-line summary."""
    dev = pick_device(device)
    model = load_model(model_dir, dev)
    cfg = model.config
    l1 = float(cfg.l1_coeff)
    ddir = Path(data_dir or os.environ.get("SFL_DATA_DIR") or REPO_ROOT / ".data")
    data = TokenData(ddir / "tokens", seq_len)
    windows = data.val_windows(min(max(1, tokens // seq_len), data.n_val_windows))
    tok = load_tokenizer(model_dir, ddir)
    act, timing_inputs = count_activity(model, windows, name, seq_len, batch, dev, timing and dev.type == "cuda")
    n_tok = act.rec.n_tokens
    prov = collect()
    base = {"model": name, "l1_coeff": l1}
    times, timing_note = layer_times(model, timing_inputs, timing, dev)
    fire_frac = (act.rec.fire.double() / n_tok).cpu()
    per_layer = per_layer_rows(act, fire_frac, times, timing_note, base, cfg, seq_len, batch, figure, prov)
    tokens_out = token_rows(act, tok, base, prov)
    pos = (act.pos_sum.cpu() / max(act.pos_cnt, 1)).tolist()
    pos_rows = [dict(base, position=p, nnz_mean=v, n=act.pos_cnt, provenance=prov) for p, v in enumerate(pos)]
    out_dir.mkdir(parents=True, exist_ok=True)
    for fname, rows in (("per_layer.jsonl", per_layer), ("tokens.jsonl", tokens_out), ("position.jsonl", pos_rows),
                        ("neurons.jsonl", neuron_rows(fire_frac, n_tok, base, prov))):
        replace_rows(out_dir / fname, name, rows)
    return {"model": name, "l1_coeff": l1, "n_tokens": n_tok,
            "nnz_mean": sum(r["nnz_mean"] for r in per_layer) / cfg.num_hidden_layers,
            "nnz_max": max(r["nnz_max"] for r in per_layer),
            "lowest": [r["token"] for r in tokens_out if r["group"] == "lowest"][:8],
            "highest": [r["token"] for r in tokens_out if r["group"] == "highest"][:8],
            "timing": timing_note or ("per-layer FFN ms recorded" if times[0] else "off")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="save_pretrained dir of a sparse_llama model")
    ap.add_argument("--name", required=True, help="model key in the logs, e.g. l1_sweep/relu_l1_1e-3")
    ap.add_argument("--out", default=str(REPO_ROOT / "results" / "activation_analysis"))
    ap.add_argument("--tokens", type=int, default=262144, help="val tokens to analyse (capped at the val split; "
                    "paper: 2^20)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="sequences per forward")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--figure", default=None, choices=["fig6", "fig10", "fig11"],
                    help="which paper figure this model stands for (default: by L1, see notebooks/README.md)")
    ap.add_argument("--no-timing", action="store_true", help="skip the per-layer dense vs sparse FFN timing (GPU)")
    a = ap.parse_args(argv)
    if a.tokens < a.seq_len:
        raise SystemExit(f"--tokens {a.tokens} < --seq-len {a.seq_len}: analyse at least one sequence")
    s = analyze(Path(a.model), a.name, Path(a.out), a.tokens, a.seq_len, a.batch, a.device, a.data_dir, a.figure,
                not a.no_timing)
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
