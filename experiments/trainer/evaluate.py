"""The one downstream-eval entry point (lm-eval 0.4.13 Python API over the repo's task YAMLs).

    python -m sfl.experiments.trainer.evaluate --model .data/smollm2-135m --tasks all --limit 20 \
        --batch-size 16 --device cpu --out runs/eval_smollm2 [--mlp-impl dense|reference|cuda]

Writes <out>/eval.json ({"provenance", "model", "limit", "num_fewshot", "tasks": {task: {"acc", "acc_norm", "n",
"acc_stderr", "acc_norm_stderr", "version"}} (lm-eval's standard errors), "per_doc": {task: {"acc": "0110...",
"acc_norm", "docs_sha256"}} (each document's 0/1 score, doc_id = position: what `python -m sfl.experiments.trainer.paired_eval`
compares two checkpoints on), "nnz_per_token_mean", "nnz_per_token_per_layer", ...}) and prints a table.
`--num-fewshot K` (default 0) and `--log-samples` (lm-eval's full per-document samples, prompts and loglikelihoods
included, into <out>/samples_<task>.jsonl) go to lm-eval as they are. Mean non-zeros per token
are recorded during the eval forwards: from each module exposing `last_nnz_per_token` (our sparse
MLPs, with per-token recording switched on for the run; the CUDA inference path keeps totals only, so there the
layers' device counters are read, padding included), else from the output of every `mlp.act_fn` (plain HF Llama). lm-eval is imported only inside
the functions that run it, so this module imports on machines without it.

Split evaluation, for a GPU machine without lm-eval (experiments/trainer/loglik.py explains it):

    python -m sfl.experiments.trainer.evaluate --model .data/smollm2-135m --tasks all --export-requests R.npz --out D  # CPU
    python -m sfl.experiments.trainer.evaluate --model RUN/final --score R.npz --out D --device cuda --mlp-impl cuda  # GPU
    python -m sfl.experiments.trainer.evaluate --replay D/scores.npz --requests R.npz --out E                      # CPU

The last step writes the same eval.json as a direct run; lm-eval computes every metric from the GPU's
loglikelihoods. `--score` needs no lm-eval.

A model it cannot trust is refused with a one-line error: weight files that differ from their weights.sha256.json
(experiments/trainer/weight_hashes.py), an unreadable config or weight file, a tokenizer larger than the embedding,
mlp_impl cuda off a GPU; and, where the weights are scored (a direct run, `--score`), weights that do not fit
config.json (missing, unexpected or reshaped tensors; `--allow-partial` evaluates such a model anyway).
eval.json and scores.* are written to a temp file and renamed into place.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sfl.data import DataNotPrepared, paths, require
from sfl.data.lm_tasks import TASK_SPLITS, EvalDataError, check_eval_files, lm_eval_name, parse_tasks, write_tasks

from .checkpoint import atomic_write_text
from .loglik import load_requests, load_scores, save_requests, save_scores, score_requests
from .provenance import collect
from .weight_hashes import HASH_FILE, WeightIntegrityError, verify_weight_hashes

for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")


# ----------------------------------------------------------------------------------------- nnz stats

class NnzRecorder:
    """Accumulates per-layer non-zeros per token over every forward of the model.

    Padding: lm-eval right-pads its batches with token id 0 and feeds no attention mask (causal
    models), so padded positions do not change real ones; `set_valid` gets a [B*T] bool mask of the
    real positions (derived from the input ids) and only those are counted.
    """

    def __init__(self, model: torch.nn.Module):
        self.sources: list[tuple[str, torch.nn.Module]] = []
        self.kind = None
        for name, mod in model.named_modules():
            if hasattr(mod, "last_nnz_per_token"):
                self.sources.append((name, mod))
        self._recording_was: list[bool] = []
        if self.sources:
            self.kind = "last_nnz_per_token"
            for _, mod in self.sources:  # our MLPs keep per-token counts only on request
                self._recording_was.append(bool(getattr(mod, "record_per_token", False)))
                mod.record_per_token = True
                mod.last_nnz_per_token = None
        else:
            for name, mod in model.named_modules():
                if name.endswith("mlp.act_fn"):
                    self.sources.append((name, mod))
            self.kind = "act_fn_output" if self.sources else None
        n = len(self.sources)
        self.sum = [0.0] * n
        self.count = [0] * n
        self.max = [0.0] * n
        self.valid: torch.Tensor | None = None
        # forwards without per-token counts (mlp_impl="cuda" inference): the device counters' increments instead
        self.counter_forwards = 0
        self._before: list[torch.Tensor | None] = [None] * n
        self.handles = [mod.register_forward_hook(self._make_hook(i)) for i, (_, mod) in enumerate(self.sources)]
        if self.kind == "last_nnz_per_token":
            self.handles += [mod.register_forward_pre_hook(self._make_pre_hook(i))
                             for i, (_, mod) in enumerate(self.sources) if hasattr(mod, "nnz_stats")]

    def set_valid(self, valid: torch.Tensor | None) -> None:
        self.valid = None if valid is None else valid.reshape(-1)

    def _make_pre_hook(self, i: int):
        def pre_hook(mod, inp):
            self._before[i] = mod.nnz_stats.clone()  # on the device: no sync
        return pre_hook

    def _from_counters(self, i: int, mod: torch.nn.Module) -> None:
        before, self._before[i] = self._before[i], None
        if before is None:
            return
        total, mx, tokens = (int(v) for v in (mod.nnz_stats - before).tolist())
        if tokens <= 0:
            return
        self.counter_forwards += 1
        self.sum[i] += float(total)
        self.count[i] += tokens
        self.max[i] = max(self.max[i], float(mod.nnz_stats[1]))  # the counter's max since its last reset

    def _make_hook(self, i: int):
        def hook(mod, inp, out):
            if self.kind == "last_nnz_per_token":
                nnz = getattr(mod, "last_nnz_per_token", None)
                if nnz is None:
                    self._from_counters(i, mod)
                    return
                mod.last_nnz_per_token = None  # consumed: a later forward that records none is not counted twice
                self._before[i] = None
                nnz = nnz.reshape(-1)
            else:
                h = out[0] if isinstance(out, tuple) else out
                nnz = (h != 0).reshape(-1, h.shape[-1]).sum(-1)  # NaN != 0, so NaN counts as active
            nnz = nnz.detach().float()
            if self.valid is not None and self.valid.numel() == nnz.numel():
                nnz = nnz[self.valid.to(nnz.device)]
            if nnz.numel() == 0:
                return
            self.sum[i] += nnz.sum().item()
            self.count[i] += nnz.numel()
            self.max[i] = max(self.max[i], nnz.max().item())
        return hook

    def per_layer_mean(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self.sum, self.count)]

    def summary(self) -> dict[str, Any]:
        means = self.per_layer_mean()
        vals = [m for m in means if m is not None]
        return {"nnz_per_token_mean": sum(vals) / len(vals) if vals else None,
                "nnz_per_token_per_layer": means,
                "nnz_per_token_max_per_layer": [m if c else None for m, c in zip(self.max, self.count)],
                "nnz_source": self.kind if not self.counter_forwards else "nnz_stats_counters (padding included)",
                "nnz_tokens_counted": self.count[0] if self.count else 0}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for (_, mod), was in zip(self.sources, self._recording_was):
            mod.record_per_token = was
            if not was:
                mod.last_nnz_per_token = None
        self._recording_was = []


def valid_mask_right_padded(inps: torch.Tensor) -> torch.Tensor:
    """[B, T] ids right-padded with 0 -> bool mask of positions up to each row's last non-zero id.
    (A real trailing token with id 0 would be dropped from the count; documented limitation.)"""
    nz = inps != 0
    pos = torch.arange(inps.shape[1], device=inps.device).expand_as(inps)
    last = torch.where(nz, pos, torch.full_like(pos, -1)).max(dim=1, keepdim=True).values
    return pos <= last


# ----------------------------------------------------------------------------------------- model

def resolve_model_dir(model: str) -> Path:
    p = Path(model).expanduser()
    if p.is_file():
        p = p.parent  # e.g. .../model.safetensors or .../config.json
    if not (p / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json found in {p}. Pass a directory written by "
                         f"save_pretrained (e.g. .data/smollm2-135m from `python -m sfl.data.prepare --only model`).")
    return p


def check_weight_hashes(model_dir: Path) -> None:
    """Refuse weight files that differ from the SHA-256 recorded at save time; a folder without the record
    (not written by our trainer) loads with a notice."""
    try:
        checked = verify_weight_hashes(model_dir)
    except WeightIntegrityError as e:
        raise SystemExit(f"error: {e}") from None
    if not checked:
        print(f"note: {model_dir} has no {HASH_FILE}; its weight files are loaded unchecked", file=sys.stderr)


def load_error(model_dir: Path, e: BaseException) -> SystemExit:
    """A one-line error for a model folder transformers cannot read (bad config.json, missing or
    truncated weight file)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return SystemExit(f"error: cannot load the model in {model_dir} ({type(e).__name__}: {first}); check that "
                      "config.json and the weight files are complete (restore the folder or save the model again)")


def check_loading_info(model_dir: Path, info: dict[str, Any], allow_partial: bool) -> None:
    """Refuse a model whose weights did not all load into it: tensors the config has no place for
    (UNEXPECTED), parameters the weights lack (MISSING: freshly initialised) or of another shape."""
    problems = {"missing": sorted(info.get("missing_keys") or ()),
                "unexpected": sorted(info.get("unexpected_keys") or ()),
                "of another shape": sorted(str(k[0] if isinstance(k, tuple) else k)
                                           for k in info.get("mismatched_keys") or ())}
    found = [f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
             for what, keys in problems.items() if keys]
    if not found:
        return
    msg = (f"{model_dir}: the weights do not fit its config.json: {'; '.join(found)} tensors. The model would be "
           "partly random, so its scores would be wrong")
    if allow_partial:
        print(f"warning: {msg} (evaluated anyway: --allow-partial)", file=sys.stderr)
        return
    raise SystemExit(f"error: {msg}. Fix config.json to match the weights, or pass --allow-partial if this is "
                     "deliberate")


def check_vocab(model: torch.nn.Module, tok: Any, tok_src: str) -> None:
    """The tokenizer's ids must all have a row in the model's embedding."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise SystemExit(f"error: the tokenizer {tok_src} has {len(tok):,} tokens, but the model's embedding has "
                         f"{rows:,} rows: it is not this model's tokenizer. Save the model's own tokenizer into the "
                         "model folder (tokenizer.json, tokenizer_config.json)")


def check_mlp_impl(cfg: Any, device: str) -> None:
    """mlp_impl="cuda" (from --mlp-impl or config.json) runs the CUDA kernels: refuse it on a CPU up front."""
    if getattr(cfg, "mlp_impl", None) == "cuda" and device != "cuda":
        raise SystemExit("error: mlp_impl 'cuda' runs the CUDA kernels and needs --device cuda on a GPU; on a CPU "
                         "pass --mlp-impl reference (exact, slow) or --mlp-impl dense")


def load_model(model_dir: Path, device: str, dtype: torch.dtype, mlp_impl: str | None,
               data_dir: str | None = None, twell_mode: str | None = None,
               allow_partial: bool = False) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, tokenizer source) of a save_pretrained folder, refusing what would give wrong
    scores: weight files that fail their SHA-256, weights that do not fit the config (unless allow_partial),
    a tokenizer with ids beyond the embedding, mlp_impl="cuda" off a GPU."""
    try:  # registers sparse_llama with the Auto classes; plain Llama works without it
        from sfl import models  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken models/ must not block evaluating plain HF models
        print(f"note: `import sfl.models` failed ({type(e).__name__}: {e}); only stock HF architectures load",
              file=sys.stderr)
    check_weight_hashes(model_dir)
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise load_error(model_dir, e) from None
    if mlp_impl is not None:
        if not hasattr(cfg, "mlp_impl"):
            raise SystemExit(f"--mlp-impl applies to sparse_llama models; {model_dir} is {cfg.model_type}")
        cfg.mlp_impl = mlp_impl
    if twell_mode is not None:
        if not hasattr(cfg, "kernel_config"):
            raise SystemExit(f"--twell-mode applies to sparse_llama models; {model_dir} is {cfg.model_type}")
        cfg.kernel_config = {**(cfg.kernel_config or {}), "mode": twell_mode}
    check_mlp_impl(cfg, device)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), config=cfg, dtype=dtype,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise load_error(model_dir, e) from None
    check_loading_info(model_dir, info, allow_partial)
    model = model.to(device).eval()
    tok_src = str(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(tok_src)
    except (OSError, ValueError, TypeError):
        tok_src = str(require("tokenizer", data_dir).tokenizer)  # models saved without tokenizer files
        tok = AutoTokenizer.from_pretrained(tok_src)
    check_vocab(model, tok, tok_src)
    return model, tok, tok_src


# ----------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (save_pretrained output); for --replay only its "
                                                  "tokenizer is used (default: the exported requests' model)")
    ap.add_argument("--tasks", default="all", help="'all' or comma list of: hellaswag, commonsense_qa, piqa, "
                                                  "winogrande, arc_easy, arc_challenge, openbookqa")
    ap.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    ap.add_argument("--num-fewshot", type=int, default=0,
                    help="lm-eval's num_fewshot (default 0, the paper's setting); the offline data have no train "
                         "split, so lm-eval draws the shots from the evaluated split, never the document itself")
    ap.add_argument("--log-samples", action="store_true",
                    help="also write lm-eval's logged samples (prompts, loglikelihoods, scores) to "
                         "<out>/samples_<task>.jsonl; eval.json holds the per-document 0/1 scores either way")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", required=True, help="output dir (eval.json is written there)")
    ap.add_argument("--mlp-impl", default=None, choices=["dense", "reference", "cuda"],
                    help="override config.mlp_impl of a sparse_llama model")
    ap.add_argument("--twell-mode", default=None, choices=["auto", "sparse"],
                    help="with --mlp-impl cuda: auto dispatch (default) or every layer through TwELL")
    ap.add_argument("--data-dir", default=None, help="prepared data dir (default $SFL_DATA_DIR or <repo>/.data)")
    ap.add_argument("--eval-dir", default=None, help="dir with <task>.jsonl (default <data_dir>/eval)")
    split = ap.add_mutually_exclusive_group()
    split.add_argument("--export-requests", default=None, metavar="R.npz",
                       help="split eval, step 1 (lm-eval): write the tokenised requests of --tasks/--limit to R.npz")
    split.add_argument("--score", default=None, metavar="R.npz",
                       help="split eval, step 2 (no lm-eval): score R.npz with --model into <out>/scores.npz")
    split.add_argument("--replay", default=None, metavar="SCORES.npz",
                       help="split eval, step 3 (lm-eval): metrics from SCORES.npz (needs --requests)")
    ap.add_argument("--requests", default=None, metavar="R.npz", help="the requests file a --replay scored")
    ap.add_argument("--max-tokens", type=int, default=32768, help="--score: padded tokens per forward")
    ap.add_argument("--allow-partial", action="store_true",
                    help="evaluate even when the weights do not all fit config.json (missing, unexpected or "
                         "reshaped tensors); without it such a model is refused, as its scores would be wrong")
    return ap


@dataclass(frozen=True)
class LmEvalSettings:
    """What lm-eval is asked for, the same in a direct run, an export and a replay."""

    tasks: list[str]
    limit: int | None = None
    num_fewshot: int = 0
    log_samples: bool = False  # keep lm-eval's full samples (written by main); per-doc 0/1 scores are kept always


@dataclass
class LmEvalOutput:
    tasks: dict[str, Any]  # eval.json "tasks"
    per_doc: dict[str, Any]  # eval.json "per_doc"
    samples: dict[str, list[dict]] | None  # lm-eval's logged samples, when asked for


def evaluate(model_dir: Path, settings: LmEvalSettings, batch_size: int, device: str,
             dtype: str, mlp_impl: str | None, eval_dir: Path, data_dir: str | None = None,
             twell_mode: str | None = None, allow_partial: bool = False) -> tuple[dict[str, Any], LmEvalOutput]:
    """Run lm-eval on the settings' tasks; returns the eval.json dict (without writing it) and lm-eval's output."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no GPU is visible; use --device cpu")
    torch_dtype = getattr(torch, dtype)
    model, tok, tok_src = load_model(model_dir, device, torch_dtype, mlp_impl, data_dir, twell_mode, allow_partial)
    rec = NnzRecorder(model)

    class RecordingHFLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            rec.set_valid(valid_mask_right_padded(inps))
            try:
                return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            finally:
                rec.set_valid(None)

    lm = RecordingHFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device=device)
    t0 = time.time()
    run = _run_lm_eval(lm, settings, eval_dir)
    out_tasks = run.tasks
    wall = time.time() - t0
    rec.remove()
    accs = [v["acc"] for v in out_tasks.values() if v["acc"] is not None]
    cfg = model.config
    return {
        "provenance": collect(),
        "model": str(model_dir),
        "model_type": cfg.model_type,
        "mlp_impl": getattr(cfg, "mlp_impl", None),
        "twell_mode": (getattr(cfg, "kernel_config", None) or {}).get("mode"),
        "tokenizer": tok_src,
        "limit": settings.limit,
        "num_fewshot": settings.num_fewshot,
        "log_samples": settings.log_samples,
        "batch_size": batch_size,
        "device": device,
        "dtype": dtype,
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "tasks": out_tasks,
        "mean_acc": sum(accs) / len(accs) if accs else None,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        **rec.summary(),
        "wall_s": round(wall, 1),
        "per_doc": run.per_doc,
    }, run


# lm-eval's standard errors: for acc / acc_norm (mean aggregation) it uses the closed form
# sample std / sqrt(n), so any value > 0 costs nothing; 0 would switch the standard errors off.
STDERR_BOOTSTRAP_ITERS = 1000


def _stderr(v: Any) -> float | None:
    """lm-eval's stderr entry as a float (it writes the string "N/A" when there is none)."""
    return float(v) if isinstance(v, (int, float)) else None


def _run_lm_eval(lm: Any, settings: LmEvalSettings, eval_dir: Path) -> LmEvalOutput:
    """simple_evaluate over the repo's task YAMLs (written by sfl.data.lm_tasks.write_tasks, the same writer as
    the lm-eval CLI's include dir) -> per-task metrics, per-document 0/1 scores, and the samples if asked for.
    lm-eval always logs samples here (cheap: tens of MB at most for the full 7 tasks): the per-doc scores come
    from them."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="sfl_tasks_") as td:
        write_tasks(eval_dir, Path(td), settings.tasks)
        tm = TaskManager(include_path=td, include_defaults=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=[lm_eval_name(t) for t in settings.tasks], task_manager=tm,
                                      limit=settings.limit, num_fewshot=settings.num_fewshot,
                                      bootstrap_iters=STDERR_BOOTSTRAP_ITERS, log_samples=True)
    out: dict[str, Any] = {}
    per_doc: dict[str, Any] = {}
    for t in settings.tasks:
        name = lm_eval_name(t)
        r = res["results"][name]
        n = res["n-samples"][name]["effective"]
        out[t] = {"acc": r.get("acc,none"), "acc_norm": r.get("acc_norm,none"), "n": int(n),
                  "acc_stderr": _stderr(r.get("acc_stderr,none")),
                  "acc_norm_stderr": _stderr(r.get("acc_norm_stderr,none")), "split": TASK_SPLITS[t],
                  "version": res.get("versions", {}).get(name)}
        per_doc[t] = per_doc_scores(res["samples"][name], int(n))
    samples = {t: res["samples"][lm_eval_name(t)] for t in settings.tasks} if settings.log_samples else None
    return LmEvalOutput(tasks=out, per_doc=per_doc, samples=samples)


def per_doc_scores(samples: list[dict], n: int) -> dict[str, Any]:
    """lm-eval's logged samples of one task -> {"acc": "0110...", "acc_norm": ... | None, "docs_sha256"}:
    character i is document i's 0/1 score. docs_sha256 hashes each document's doc, prompt (few-shot context
    included) and target hashes in order, so two eval.json files can be checked to hold the same requests."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    if [s["doc_id"] for s in rows] != list(range(n)):
        raise RuntimeError(f"lm-eval logged doc ids {[s['doc_id'] for s in rows][:10]}... for {n} documents; "
                           "expected 0..n-1 (per-document scores are stored by position)")

    def bits(key: str) -> str | None:
        if key not in rows[0]:
            return None
        vals = [float(s[key]) for s in rows]
        if any(v not in (0.0, 1.0) for v in vals):
            raise RuntimeError(f"per-document {key} is not 0/1: {sorted(set(vals))[:5]}")
        return "".join("1" if v else "0" for v in vals)

    h = hashlib.sha256()
    for s in rows:
        h.update(f"{s['doc_hash']} {s['prompt_hash']} {s['target_hash']}\n".encode())
    return {"acc": bits("acc"), "acc_norm": bits("acc_norm"), "docs_sha256": h.hexdigest()}


def write_samples(out: Path, samples: dict[str, list[dict]]) -> list[Path]:
    """lm-eval's logged samples, one JSON line per document, as the lm-eval CLI's samples_<task>_*.jsonl."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    from lm_eval.utils import handle_non_serializable

    files = []
    for t, rows in samples.items():
        f = out / f"samples_{lm_eval_name(t)}.jsonl"
        tmp = f.with_name(f.name + ".tmp")
        with open(tmp, "w") as fh:
            for row in sorted(rows, key=lambda r: r["doc_id"]):
                fh.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
        tmp.replace(f)
        files.append(f)
    return files


def vocab_digest(tok: Any) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id): the export and the scorer must share it."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _split_lm(kind: str, model: torch.nn.Module, tok: Any, table: dict | None = None) -> Any:
    """An HFLM whose `_loglikelihood_tokens` records (export) or answers from `table` (replay).

    Everything before that call -- the tasks' requests, lm-eval's own tokenisation (trailing spaces moved
    into the continuation, the empty-context prefix token) -- is lm-eval's unchanged code."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    from lm_eval.models.huggingface import HFLM

    class SplitHFLM(HFLM):
        pairs: list[tuple[list[int], list[int]]]  # set per instance below

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            if kind == "export":
                self.pairs.extend((list(c), list(x)) for _, c, x in requests)
                return [(0.0, False)] * len(requests)
            out = []
            for _, c, x in requests:
                hit = table.get((tuple(c), tuple(x)))
                if hit is None:
                    raise RuntimeError("a request lm-eval built here is not in the scored requests file: the "
                                       "tasks, --limit, --num-fewshot, eval data, task templates (CommonsenseQA "
                                       "is cloze since its task version 2.0) or tokenizer differ from the "
                                       "export. Export again with the same settings and score that file.")
                out.append(hit)
            return out

    lm = SplitHFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    lm.pairs = []
    return lm


def export_requests(model_dir: Path, settings: LmEvalSettings, eval_dir: Path, path: Path,
                    data_dir: str | None = None) -> dict[str, Any]:
    """Split eval, step 1: every loglikelihood request of the tasks, tokenised by lm-eval's HFLM."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    import lm_eval

    # only the tokenizer and config are used here, so weights that do not fit the config do not matter
    model, tok, tok_src = load_model(model_dir, "cpu", torch.float32, None, data_dir, allow_partial=True)
    lm = _split_lm("export", model, tok)
    _run_lm_eval(lm, settings, eval_dir)
    meta = {"tasks": settings.tasks, "limit": settings.limit, "num_fewshot": settings.num_fewshot,
            "model": str(model_dir), "tokenizer": tok_src,
            "vocab_digest": vocab_digest(tok), "max_length": int(lm.max_length),
            "lm_eval_version": getattr(lm_eval, "__version__", None), "provenance": collect(),
            "n_pairs_asked": len(lm.pairs)}
    return save_requests(path, lm.pairs, meta).meta


def score(model_dir: Path, requests_path: Path, out: Path, device: str, dtype: str, mlp_impl: str | None,
          max_tokens: int, data_dir: str | None = None, twell_mode: str | None = None,
          allow_partial: bool = False) -> dict[str, Any]:
    """Split eval, step 2 (no lm-eval): score the requests with the model; writes scores.npz/.json."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no GPU is visible; use --device cpu")
    reqs = load_requests(requests_path)
    rmeta = reqs.meta
    model, tok, tok_src = load_model(model_dir, device, getattr(torch, dtype), mlp_impl, data_dir, twell_mode,
                                     allow_partial)
    if vocab_digest(tok) != rmeta["vocab_digest"]:
        raise SystemExit(f"the tokenizer of {model_dir} ({tok_src}) is not the one {requests_path} was exported "
                         f"with ({rmeta['tokenizer']}); export the requests with this model's tokenizer")
    rec = NnzRecorder(model)
    cfg = model.config
    t0 = time.time()
    ll, greedy = score_requests(model, reqs, device, rmeta["max_length"], max_tokens=max_tokens, recorder=rec)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    rec.remove()
    meta = {"provenance": collect(), "model": str(model_dir), "model_type": cfg.model_type,
            "mlp_impl": getattr(cfg, "mlp_impl", None),
            "twell_mode": (getattr(cfg, "kernel_config", None) or {}).get("mode"),
            "tokenizer": tok_src, "device": device, "dtype": dtype,
            "intermediate_size": getattr(cfg, "intermediate_size", None), "requests_digest": rmeta["digest"],
            "requests_meta": rmeta, "n_requests": len(reqs), "max_length": rmeta["max_length"],
            "max_tokens_per_batch": max_tokens, "score_wall_s": round(wall, 1),
            "nonfinite_ll": int((~np.isfinite(ll)).sum()), **rec.summary()}
    out.mkdir(parents=True, exist_ok=True)
    save_scores(out / "scores.npz", ll, greedy, meta)
    atomic_write_text(out / "scores.json", json.dumps({k: v for k, v in meta.items() if k != "requests_meta"},
                                                      indent=1) + "\n")
    return meta


def replay(scores_path: Path, requests_path: Path, model_dir: Path | None, eval_dir: Path,
           data_dir: str | None = None, log_samples: bool = False) -> tuple[dict[str, Any], LmEvalOutput]:
    """Split eval, step 3: lm-eval's metrics from scored requests; returns the eval.json dict and lm-eval's
    output (tasks, limit and num_fewshot are the export's)."""
    # optional dependency (the eval extra): lm-eval is imported by the modes that run it
    import lm_eval

    reqs = load_requests(requests_path)
    ll, greedy, smeta = load_scores(scores_path)
    if smeta.get("requests_digest") != reqs.meta["digest"] or len(ll) != len(reqs):
        raise SystemExit(f"{scores_path} scored another requests file than {requests_path} (digest mismatch)")
    table = {k: (float(a), bool(g)) for k, a, g in zip(reqs.keys(), ll, greedy)}
    settings = LmEvalSettings(tasks=reqs.meta["tasks"], limit=reqs.meta["limit"],
                              num_fewshot=int(reqs.meta.get("num_fewshot", 0)), log_samples=log_samples)
    model_dir = model_dir or resolve_model_dir(reqs.meta["model"])
    # only the tokenizer and config are used here, so weights that do not fit the config do not matter
    model, tok, tok_src = load_model(model_dir, "cpu", torch.float32, None, data_dir, allow_partial=True)
    if vocab_digest(tok) != reqs.meta["vocab_digest"]:
        raise SystemExit(f"the tokenizer of {model_dir} differs from the export's; pass --model with the "
                         f"tokenizer the requests were exported with ({reqs.meta['tokenizer']})")
    lm = _split_lm("replay", model, tok, table)
    run = _run_lm_eval(lm, settings, eval_dir)
    out_tasks = run.tasks
    accs = [v["acc"] for v in out_tasks.values() if v["acc"] is not None]
    keep = ("nnz_per_token_mean", "nnz_per_token_per_layer", "nnz_per_token_max_per_layer", "nnz_source",
            "nnz_tokens_counted")
    return {
        "provenance": smeta.get("provenance"),  # where the model ran; the replay's own is below
        "model": smeta.get("model"), "model_type": smeta.get("model_type"), "mlp_impl": smeta.get("mlp_impl"),
        "twell_mode": smeta.get("twell_mode"),
        "tokenizer": smeta.get("tokenizer"), "limit": settings.limit, "num_fewshot": settings.num_fewshot,
        "log_samples": log_samples, "batch_size": None,
        "device": smeta.get("device"), "dtype": smeta.get("dtype"),
        "lm_eval_version": getattr(lm_eval, "__version__", None), "tasks": out_tasks,
        "mean_acc": sum(accs) / len(accs) if accs else None,
        "intermediate_size": smeta.get("intermediate_size"), **{k: smeta.get(k) for k in keep},
        "wall_s": smeta.get("score_wall_s"),
        "split_eval": {"requests_digest": reqs.meta["digest"], "n_requests": len(reqs),
                       "requests_lm_eval_version": reqs.meta.get("lm_eval_version"),
                       "max_length": smeta.get("max_length"), "nonfinite_ll": smeta.get("nonfinite_ll"),
                       "replay_provenance": collect()},
        "per_doc": run.per_doc,
    }, run


def format_table(result: dict[str, Any]) -> str:
    rows = [f"{'task':<16}{'split':<12}{'n':>6}{'acc':>9}{'± se':>8}{'acc_norm':>10}{'± se':>8}"]
    for t, v in result["tasks"].items():
        an = "-" if v["acc_norm"] is None else f"{v['acc_norm']:.4f}"
        se = "-" if v.get("acc_stderr") is None else f"{v['acc_stderr']:.4f}"
        sen = "-" if v.get("acc_norm_stderr") is None else f"{v['acc_norm_stderr']:.4f}"
        rows.append(f"{t:<16}{v['split']:<12}{v['n']:>6}{v['acc']:>9.4f}{se:>8}{an:>10}{sen:>8}")
    rows.append(f"{'mean acc':<34}{result['mean_acc']:>9.4f}")
    nnz = result["nnz_per_token_mean"]
    rows.append(f"mean non-zeros per token ({result['nnz_source']}): "
                + ("n/a" if nnz is None else f"{nnz:.1f} of {result['intermediate_size']}")
                + f"   wall {result['wall_s']}s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    try:
        tasks = parse_tasks(a.tasks)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if a.limit is not None and a.limit <= 0:
        raise SystemExit("--limit must be positive")
    if a.num_fewshot < 0:
        raise SystemExit("--num-fewshot must be >= 0")
    if a.replay and a.num_fewshot:
        raise SystemExit("--replay takes --num-fewshot from the exported requests; pass it to --export-requests")
    settings = LmEvalSettings(tasks=tasks, limit=a.limit, num_fewshot=a.num_fewshot, log_samples=a.log_samples)
    eval_dir = Path(a.eval_dir) if a.eval_dir else paths(a.data_dir).eval
    out = Path(a.out)
    if a.requests is not None and a.replay is None:
        raise SystemExit("--requests goes with --replay")
    if a.model is None and a.replay is None:
        raise SystemExit("--model is required (except with --replay)")
    if not a.score:  # every mode but --score reads the eval files: check them before loading a model
        try:
            check_eval_files(eval_dir.resolve(), tasks)
        except (EvalDataError, DataNotPrepared, FileNotFoundError) as e:
            raise SystemExit(f"error: {e}") from None
    if a.export_requests:
        meta = export_requests(resolve_model_dir(a.model), settings, eval_dir, Path(a.export_requests),
                               a.data_dir)
        print(f"wrote {a.export_requests}: {meta['n_requests']:,} unique requests ({meta['n_pairs_asked']:,} asked), "
              f"{meta['n_tokens']:,} tokens, tasks {', '.join(tasks)}, limit {a.limit}")
        return 0
    if a.score:
        meta = score(resolve_model_dir(a.model), Path(a.score), out, a.device, a.dtype, a.mlp_impl, a.max_tokens,
                     a.data_dir, a.twell_mode, a.allow_partial)
        nnz = meta["nnz_per_token_mean"]
        print(f"scored {meta['n_requests']:,} requests in {meta['score_wall_s']}s ({a.device}, {a.dtype}, "
              f"mlp_impl {meta['mlp_impl']}); non-zeros per token {'n/a' if nnz is None else f'{nnz:.1f}'}; "
              f"wrote {out / 'scores.npz'}")
        return 0
    if a.replay:
        if a.requests is None:
            raise SystemExit("--replay needs --requests (the file that was scored)")
        result, run = replay(Path(a.replay), Path(a.requests), resolve_model_dir(a.model) if a.model else None,
                             eval_dir, a.data_dir, a.log_samples)
    else:
        result, run = evaluate(resolve_model_dir(a.model), settings, a.batch_size, a.device, a.dtype,
                               a.mlp_impl, eval_dir, a.data_dir, a.twell_mode, a.allow_partial)
    out.mkdir(parents=True, exist_ok=True)
    if run.samples is not None:
        for f in write_samples(out, run.samples):
            print(f"wrote {f}")
    atomic_write_text(out / "eval.json", json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"wrote {out / 'eval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
