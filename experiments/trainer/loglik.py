"""Loglikelihood requests as a file, scored without lm-eval: the GPU half of a split evaluation.

The GPU machine has no lm-eval (and cannot install it), so a full 7-task evaluation is split in three:

1. ``evaluate.py --export-requests R`` (CPU, lm-eval): lm-eval builds every request of the tasks, lm-eval's
   own HFLM tokenises each (context, continuation) pair, and the token ids are written to ``R``.
2. ``evaluate.py --score R`` (GPU, no lm-eval; this module): the model scores each pair exactly as HFLM's
   ``_loglikelihood_tokens`` would -- left truncation to max_length + 1, sum of the continuation's log-probs,
   and whether greedy decoding reproduces it -- and writes ``scores.npz`` + ``scores.json``.
3. ``evaluate.py --replay scores.npz --requests R`` (CPU, lm-eval): lm-eval runs again with an LM that answers
   from the scores, so lm-eval computes every metric itself.

A requests file is an ``.npz`` holding ``tokens`` (the pairs' ids back to back, context then continuation),
``offsets`` (n + 1), ``cont_len`` (n) and ``meta`` (JSON). Pairs are unique; lm-eval asks for the same pair
more than once only when tasks repeat a prompt, and the replay answers every copy from the one score.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from .rundir import tmp_name

FORMAT_VERSION = 1


@dataclass
class Requests:
    tokens: np.ndarray      # int64 [total]: every pair's context ids then continuation ids
    offsets: np.ndarray     # int64 [n + 1]
    cont_len: np.ndarray    # int64 [n]
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.cont_len)

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        seq = self.tokens[self.offsets[i]:self.offsets[i + 1]].tolist()
        c = int(self.cont_len[i])
        return seq[:-c], seq[-c:]

    def keys(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        out = []
        for i in range(len(self)):
            ctx, cont = self.pair(i)
            out.append((tuple(ctx), tuple(cont)))
        return out


def _digest(tokens: np.ndarray, offsets: np.ndarray, cont_len: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in (tokens, offsets, cont_len):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def save_requests(path: str | Path, pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
                  meta: dict[str, Any]) -> Requests:
    """Write unique (context ids, continuation ids) pairs, in first-seen order."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    flat: list[int] = []
    offsets = [0]
    cont_len: list[int] = []
    for ctx, cont in pairs:
        key = (tuple(int(t) for t in ctx), tuple(int(t) for t in cont))
        if key in seen:
            continue
        if not key[0] or not key[1]:
            raise ValueError("a request has an empty context or continuation; lm-eval never sends those to "
                             "_loglikelihood_tokens (empty contexts get the prefix token)")
        seen.add(key)
        flat.extend(key[0])
        flat.extend(key[1])
        offsets.append(len(flat))
        cont_len.append(len(key[1]))
    tokens = np.asarray(flat, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    cl = np.asarray(cont_len, dtype=np.int64)
    vmax = int(tokens.max()) if tokens.size else 0
    store = tokens.astype(np.uint16 if vmax < 2 ** 16 else np.int32)  # SmolLM2's 49,152 ids fit uint16
    meta = {**meta, "format": FORMAT_VERSION, "n_requests": len(cl), "n_tokens": int(tokens.size),
            "digest": _digest(tokens, off, cl)}
    _atomic_savez(Path(path), tokens=store, offsets=off, cont_len=cl,
                  meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return Requests(tokens, off, cl, meta)


def load_requests(path: str | Path) -> Requests:
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: requests format {meta.get('format')}, this code reads {FORMAT_VERSION}; "
                             f"export it again with `python -m sfl.experiments.trainer.evaluate --export-requests`")
        r = Requests(z["tokens"].astype(np.int64), z["offsets"].astype(np.int64), z["cont_len"].astype(np.int64),
                     meta)
    if _digest(r.tokens, r.offsets, r.cont_len) != meta["digest"]:
        raise ValueError(f"{path}: contents do not match the digest in its meta (truncated or edited?)")
    return r


# ----------------------------------------------------------------------------------------- scoring

def _batches(lengths: np.ndarray, max_tokens: int, max_rows: int) -> list[np.ndarray]:
    """Longest first, each batch padded to its first (longest) row and at most max_tokens in all."""
    order = np.argsort(-lengths, kind="stable")
    out, i = [], 0
    while i < len(order):
        rows = max(1, min(max_rows, max_tokens // max(1, int(lengths[order[i]]))))
        out.append(order[i:i + rows])
        i += rows
    return out


@torch.no_grad()
def score_requests(model: torch.nn.Module, reqs: Requests, device: str | torch.device, max_length: int,
                   max_tokens: int = 32768, max_rows: int = 256, recorder: Any = None,
                   progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(sum of continuation log-probs, greedy match) per request, HFLM's `_loglikelihood_tokens` semantics.

    Each pair is truncated from the left to max_length + 1 tokens and its last token dropped; the logits
    at the continuation's positions are log-softmaxed in float32 (HFLM uses the logits' dtype by default,
    so float32 is at least as exact). Rows are right-padded with id 0, as HFLM pads: causal attention
    makes the padding invisible to the real positions. `recorder` (an evaluate.NnzRecorder) counts
    non-zeros over the real positions only.
    """
    n = len(reqs)
    seqs_len = np.minimum(reqs.offsets[1:] - reqs.offsets[:-1], max_length + 1) - 1  # model input lengths
    if (reqs.cont_len > max_length).any():
        raise ValueError(f"a continuation is longer than max_length={max_length} (HFLM asserts the same)")
    if (seqs_len < 1).any():
        raise ValueError("a request has fewer than 2 tokens")
    ll = np.zeros(n, dtype=np.float64)
    greedy = np.zeros(n, dtype=bool)
    tok = torch.from_numpy(reqs.tokens)
    batches = _batches(seqs_len, max_tokens, max_rows)
    for idx in tqdm(batches, desc="score", unit="batch", disable=not progress, mininterval=5):
        L = int(seqs_len[idx[0]])
        inp = torch.zeros(len(idx), L, dtype=torch.long)
        valid = torch.zeros(len(idx), L, dtype=torch.bool)
        rows, cols, targets, owner = [], [], [], []
        for r, i in enumerate(idx.tolist()):
            full = tok[reqs.offsets[i]:reqs.offsets[i + 1]][-(max_length + 1):]
            x, y = full[:-1], full[1:]
            inp[r, :len(x)] = x
            valid[r, :len(x)] = True
            c = int(reqs.cont_len[i])
            pos = torch.arange(len(x) - c, len(x))
            rows.append(torch.full((c,), r))
            cols.append(pos)
            targets.append(y[-c:])
            owner.append(torch.full((c,), i))
        rows_t, cols_t = torch.cat(rows), torch.cat(cols)
        tgt, own = torch.cat(targets).to(device), torch.cat(owner)
        if recorder is not None:
            recorder.set_valid(valid.to(device))
        logits = model(input_ids=inp.to(device)).logits
        if recorder is not None:
            recorder.set_valid(None)
        sel = logits[rows_t.to(device), cols_t.to(device)].float().log_softmax(-1)  # [positions, V]
        lp = sel.gather(1, tgt[:, None]).squeeze(1).double().cpu()
        hit = (sel.argmax(-1) == tgt).cpu()
        uniq, inv = torch.unique(own, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, lp)
        misses = torch.zeros(len(uniq), dtype=torch.long).index_add_(0, inv, (~hit).long())
        ll[uniq.numpy()] = sums.numpy()
        greedy[uniq.numpy()] = (misses == 0).numpy()
    return ll, greedy


def _atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    """np.savez_compressed into a temp file renamed over path: a kill never leaves a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(tmp_name(path.name))
    try:
        with open(tmp, "wb") as fh:  # file object: np.savez would append .npz to a bare name
            np.savez_compressed(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_scores(path: str | Path, ll: np.ndarray, greedy: np.ndarray, meta: dict[str, Any]) -> None:
    _atomic_savez(Path(path), ll=ll.astype(np.float64), greedy=np.packbits(greedy.astype(bool)),
                  n=np.asarray([len(ll)]), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


def load_scores(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    with np.load(path) as z:
        n = int(z["n"][0])
        return (z["ll"].astype(np.float64), np.unpackbits(z["greedy"])[:n].astype(bool),
                json.loads(z["meta"].tobytes().decode()))
