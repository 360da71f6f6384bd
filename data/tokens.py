"""Tokenise cleaned documents and write uint16 memmap shards + meta.json (layout in data/README.md)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from .manifest import atomic_write_text

DTYPE = np.uint16
# Per-shard checksum recorded in meta.json at preparation and checked where the shard is used
# (experiments/trainer/data_loader.py): SHA-1 of the whole file, the fastest full-file hash hashlib has here
# (~1.5 GB/s with the CPU's SHA extensions: 0.03 s for the 36 MB of the offline stream). Integrity, not security.
CHECKSUM = "sha1"
_SCAN_CHUNK = 1 << 24  # bytes per read (even: whole uint16 tokens)


def scan_shard(path: Path) -> tuple[str, int, int]:
    """(checksum of the file, largest token id in it or -1 if empty, number of bytes), in one read."""
    h = hashlib.new(CHECKSUM)
    top, size, carry = -1, 0, b""
    with open(path, "rb") as f:
        while True:
            b = f.read(_SCAN_CHUNK)
            if not b:
                break
            h.update(b)
            size += len(b)
            b = carry + b
            whole = len(b) - len(b) % 2
            carry = b[whole:]
            if whole:
                top = max(top, int(np.frombuffer(b[:whole], dtype="<u2").max()))
    return h.hexdigest(), top, size


def doc_order_key(doc_id: str) -> bytes:
    """Documents are ordered by a hash of their id: a fixed shuffle that mixes the sources, so a
    prefix of the stream (--max-train-tokens, or a short run reading sequentially) is representative."""
    return hashlib.sha256(b"order:" + doc_id.encode("utf-8")).digest()


def read_docs(jsonl_files: Sequence[Path], split: str) -> list[tuple[str, str]]:
    docs = []
    for f in jsonl_files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                if r["split"] == split:
                    docs.append((r["id"], r["text"]))
    docs.sort(key=lambda d: doc_order_key(d[0]))
    return docs


def encode_stream(tokenizer: Any, docs: Sequence[tuple[str, str]], eos_id: int, max_tokens: int | None,
                  batch_docs: int = 1000, desc: str = "tokenize",
                  doc_tokens: list[int] | None = None) -> tuple[np.ndarray, int]:
    """Encode docs (no special tokens added) and join them, each followed by EOS.

    `tokenizer` is a `tokenizers.Tokenizer` (the fast Rust backend: batches run on all cores).
    Returns (tokens, number of documents used); `doc_tokens`, if given, receives each used document's
    token count (EOS included). With max_tokens the stream is cut at exactly
    max_tokens (the last document may be partial)."""
    parts: list[np.ndarray] = []
    total = 0
    used = 0
    with tqdm(total=len(docs), desc=desc, unit="doc", mininterval=1.0) as bar:
        for i in range(0, len(docs), batch_docs):
            batch = docs[i:i + batch_docs]
            encs = tokenizer.encode_batch([t for _, t in batch], add_special_tokens=False)
            for enc in encs:
                ids = enc.ids
                arr = np.empty(len(ids) + 1, dtype=np.int64)
                arr[:-1] = ids
                arr[-1] = eos_id
                parts.append(arr)
                if doc_tokens is not None:
                    doc_tokens.append(arr.size)
                total += arr.size
                used += 1
                if max_tokens is not None and total >= max_tokens:
                    break
            bar.update(len(batch))
            if max_tokens is not None and total >= max_tokens:
                break
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if max_tokens is not None:
        out = out[:max_tokens]
    if out.size and (out.min() < 0 or out.max() > np.iinfo(DTYPE).max):
        raise ValueError(f"token id out of uint16 range (max {out.max()}); this layout needs vocab <= 65536")
    return out.astype(DTYPE), used


def write_shards(tokens: np.ndarray, out_dir: Path, prefix: str, shard_tokens: int,
                 first_index: int = 0) -> list[dict[str, Any]]:
    """Write tokens as <prefix>_000.bin, ... (raw uint16, little-endian; numbered from first_index) atomically;
    return meta entries {"file", "tokens", "sha1"} (the checksum is verified by the training data loader)."""
    if shard_tokens <= 0:
        raise ValueError("shard_tokens must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    n_shards = max(1, -(-tokens.size // shard_tokens))
    for s in range(n_shards):
        chunk = tokens[s * shard_tokens:(s + 1) * shard_tokens].astype("<u2", copy=False)
        name = f"{prefix}_{first_index + s:03d}.bin"
        tmp = out_dir / f".{name}.tmp{os.getpid()}"
        chunk.tofile(tmp)
        os.replace(tmp, out_dir / name)
        entries.append({"file": name, "tokens": int(chunk.size), CHECKSUM: scan_shard(out_dir / name)[0]})
    return entries


def write_meta(out_dir: Path, meta: dict[str, Any]) -> Path:
    p = out_dir / "meta.json"
    atomic_write_text(p, json.dumps(meta, indent=1) + "\n")
    return p


def load_split(tokens_dir: Path, split: str) -> list[np.memmap]:
    """Open the shards of a split as read-only uint16 memmaps (what training code uses)."""
    meta = json.loads((tokens_dir / "meta.json").read_text())
    if meta["dtype"] != "uint16":
        raise ValueError(f"unexpected dtype {meta['dtype']}")
    return [np.memmap(tokens_dir / e["file"], dtype=np.uint16, mode="r", shape=(e["tokens"],)) for e in meta[split]]
