"""Token windows from the prepared uint16 memmaps (<data_dir>/tokens/{meta.json, *.bin}).

Training batches are contiguous seq_len+1 windows that are a pure function of (seed, step, rank): no
sampler state has to be carried, and a resumed run draws exactly the batches the uninterrupted run would
have drawn. A step's global batch depends on (seed, step) only and every rank reads its own block of it,
so the data order does not change with the number of ranks. Validation uses fixed sequential windows.

Data are checked where they are used, and every failure is a DataError naming the file and the fix:
- at open: meta.json parses and has its keys, every shard exists with exactly 2 bytes per recorded token;
- `verify()` (training start and resume): each shard's checksum equals the one recorded in meta.json at
  preparation, and no token id is >= vocab_size (one read of every shard);
- every batch: its largest token id is < vocab_size (one max over the batch);
- `changed_since_verified()` (every log line and checkpoint): each shard is still the file verified at start
  (inode, size, mtime), so a shard rewritten while the run reads it is caught.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sfl.data.tokens import CHECKSUM, scan_shard


def _identity(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class DataError(ValueError):
    """Prepared data that are missing, malformed or changed; the message names the file and the fix."""


def rebuild_hint(tokens_dir: Path) -> str:
    """The command that rebuilds the token shards of this data dir."""
    root = tokens_dir.parent
    if tokens_dir.name != "tokens":  # a corpus of the user's own (prepare --corpus)
        return (f"rebuild them with `python -m sfl.data.prepare --corpus SOURCE --out-subdir {tokens_dir.name} "
                f"--data-dir {root}` and the other arguments that made them (meta.json's stats name the source)")
    return (f"rebuild them with `python -m sfl.data.prepare --only tokens --data-dir {root}` "
            "(add --force if the manifest still calls them up to date)")


class TokenData:
    """Memmapped train/val token streams described by meta.json (see data/README.md for the layout)."""

    def __init__(self, tokens_dir: str | Path, seq_len: int, order: str = "random", world: int = 1) -> None:
        self.dir = Path(tokens_dir)
        self.meta: dict[str, Any] = self._read_meta()
        self.vocab_size = int(self.meta["vocab_size"])
        self.seq_len = seq_len
        self.train = self._open(self.meta["train"], "train")
        self.val = self._open(self.meta["val"], "val")
        # Valid window starts per train file; windows never cross file boundaries.
        self._starts = np.array([len(a) - seq_len for a in self.train], dtype=np.int64)
        if (self._starts <= 0).all():
            raise DataError(f"every train file in {self.dir} is shorter than seq_len+1={seq_len + 1} tokens: "
                            "lower seq_len, or prepare more train tokens (data/README.md)")
        self._starts = np.maximum(self._starts, 0)
        self._cum = np.cumsum(self._starts)
        self.n_val_windows = sum(max(0, (len(a) - 1) // seq_len) for a in self.val)
        if order not in ("random", "disjoint"):
            raise ValueError(f"data order {order!r}: must be random or disjoint")
        self.order, self.world = order, world
        # order "disjoint": window i of a file starts at token i*seq_len (the val split's layout)
        self._win_cum = np.cumsum([max(0, (len(a) - 1) // seq_len) for a in self.train])
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._digests: dict[str, str] | None = None
        self._stats: dict[str, tuple[int, int, int]] = {}  # file -> (inode, size, mtime) when verified

    # ------------------------------------------------------------------------------------- opening
    def _read_meta(self) -> dict[str, Any]:
        path = self.dir / "meta.json"
        if not path.is_file():
            raise DataError(f"{path} not found: prepare the data first (see data/README.md) or set data_dir / "
                            "$SFL_DATA_DIR to a prepared data dir")
        try:
            meta = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path} is not valid JSON ({e}): it was cut short or edited; "
                            f"{rebuild_hint(self.dir)}") from None
        missing = [k for k in ("vocab_size", "train", "val") if not isinstance(meta, dict) or k not in meta]
        if missing:
            raise DataError(f"{path} lacks {', '.join(missing)}: not a meta.json of data.prepare; "
                            f"{rebuild_hint(self.dir)}")
        for split in ("train", "val"):
            entries = meta[split]
            if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("file"), str)
                                                        for e in entries):
                raise DataError(f"{path}: every {split} entry must be an object with a \"file\" name (and "
                                f"\"tokens\"); the file was edited or cut short; {rebuild_hint(self.dir)}")
        if meta.get("dtype", "uint16") != "uint16":
            raise DataError(f"{path}: dtype {meta.get('dtype')!r} unsupported (expected uint16); "
                            f"{rebuild_hint(self.dir)}")
        return meta

    def _open(self, entries: list[dict[str, Any]], split: str) -> list[np.memmap]:
        arrays = []
        for e in entries:
            path = self.dir / e["file"]
            if not path.is_file():
                raise DataError(f"{path} (listed in meta.json) is missing; {rebuild_hint(self.dir)}")
            size = path.stat().st_size
            if "tokens" in e and size != 2 * int(e["tokens"]):
                raise DataError(f"{path} has {size} bytes but meta.json records {e['tokens']} uint16 tokens "
                                f"({2 * int(e['tokens'])} bytes): the file is truncated or was changed; "
                                f"{rebuild_hint(self.dir)}")
            if size % 2:
                raise DataError(f"{path} has an odd number of bytes ({size}): not uint16 tokens, it is truncated "
                                f"or corrupt; {rebuild_hint(self.dir)}")
            arrays.append(np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16))
        if not arrays:
            raise DataError(f"{self.dir}/meta.json lists no {split} files; {rebuild_hint(self.dir)}")
        return arrays

    # ------------------------------------------------------------------------------------- verification
    def verify(self) -> dict[str, str]:
        """Checksum and range-check every shard (one read of each); return {file: checksum}.

        A checksum differing from the one meta.json recorded at preparation, or a token id >= vocab_size,
        raises DataError naming the file. meta.json files written before checksums were recorded have none:
        then only the range is checked (and the digests still guard a resume).
        """
        if self._digests is not None:
            return self._digests
        digests, unrecorded = {}, []
        for e in self.meta["train"] + self.meta["val"]:
            path = self.dir / e["file"]
            self._stats[e["file"]] = _identity(path)  # before the read: a change during it is seen later
            digest, top, _ = scan_shard(path)
            want = e.get(CHECKSUM)
            if want is None:
                unrecorded.append(e["file"])
            elif digest != want:
                raise DataError(f"{path} changed since it was prepared: its {CHECKSUM} is {digest}, meta.json "
                                f"records {want}; {rebuild_hint(self.dir)}")
            if top >= self.vocab_size:
                raise DataError(f"{path} holds token id {top} >= vocab_size {self.vocab_size} of meta.json: the "
                                f"shard is corrupt or from another tokenizer; {rebuild_hint(self.dir)}")
            digests[e["file"]] = digest
        if unrecorded:
            print(f"note: {self.dir}/meta.json records no checksum for {len(unrecorded)} shard(s) (prepared by an "
                  f"older data.prepare), so a change since preparation cannot be detected; "
                  f"{rebuild_hint(self.dir)} to record them", file=sys.stderr)
        self._digests = digests
        return digests

    def changed_since_verified(self) -> str | None:
        """None if every shard is the file `verify()` read (same inode, size and mtime: a cheap stat per shard,
        run at every log line and checkpoint), else which one was replaced or rewritten."""
        for name, was in self._stats.items():
            path = self.dir / name
            try:
                now = _identity(path)
            except OSError:
                return f"{path} was removed"
            if now != was:
                what = "replaced by another file" if now[0] != was[0] else "rewritten in place"
                return f"{path} was {what} (size {was[1]} -> {now[1]} bytes, mtime changed: {now[2] != was[2]})"
        return None

    def _check_ids(self, batch: np.ndarray, what: str) -> None:
        if batch.size and int(batch.max()) >= self.vocab_size:
            raise DataError(f"{what} holds token id {int(batch.max())} >= vocab_size {self.vocab_size}: a shard in "
                            f"{self.dir} is corrupt or was changed during the run; {rebuild_hint(self.dir)}")

    # ------------------------------------------------------------------------------------- windows
    def train_batch(self, seed: int, step: int, rank: int, n: int) -> torch.Tensor:
        """int64 [n, seq_len+1]: rank `rank`'s n windows of optimizer step `step` (deterministic).

        The step's global batch is one sequence of windows that depends on (seed, step) only; rank r takes its
        r-th block of n. So ranks read disjoint parts of it, and a run resumed on another number of ranks (same
        global batch) reads the same windows. order "random": random start offsets (windows may overlap);
        order "disjoint": the non-overlapping windows of the corpus, reshuffled every epoch."""
        if self.order == "random":
            # Generator.integers draws element by element: the first (rank+1)*n draws of one stream per step.
            rng = np.random.default_rng([seed, 0, step])
            pos = rng.integers(0, self._cum[-1], size=(rank + 1) * n)[rank * n:]
            file_idx = np.searchsorted(self._cum, pos, side="right")
            offs = pos - np.concatenate([[0], self._cum[:-1]])[file_idx]
        else:
            if not 0 <= rank < self.world:
                raise ValueError(f"rank {rank} outside world size {self.world}")
            g = (step * self.world + rank) * n + np.arange(n, dtype=np.int64)  # global sample indices
            total = int(self._win_cum[-1])
            ids = np.empty(n, dtype=np.int64)
            for epoch in np.unique(g // total):
                sel = g // total == epoch
                ids[sel] = self._epoch_perm(seed, int(epoch))[g[sel] % total]
            file_idx = np.searchsorted(self._win_cum, ids, side="right")
            offs = (ids - np.concatenate([[0], self._win_cum[:-1]])[file_idx]) * self.seq_len
        rows = np.stack([self.train[f][o:o + self.seq_len + 1] for f, o in zip(file_idx, offs)])
        self._check_ids(rows, f"the train batch of step {step}")
        return torch.from_numpy(rows.astype(np.int64))

    def _epoch_perm(self, seed: int, epoch: int) -> np.ndarray:
        """The order of the non-overlapping train windows in `epoch` (cached: a step reads one or two)."""
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([seed, 1, epoch]).permutation(int(self._win_cum[-1]))
        return self._perms[key]

    def val_windows(self, n: int) -> torch.Tensor:
        """int64 [n, seq_len+1]: the first n sequential, non-overlapping windows of the val split
        (window i starts at token i*seq_len, sharing one token with the next: all targets used)."""
        if self.n_val_windows == 0:
            files = ", ".join(str(self.dir / e["file"]) for e in self.meta["val"])
            raise DataError(f"the val split ({files}) has {sum(len(a) for a in self.val)} tokens: not one window "
                            f"of seq_len+1={self.seq_len + 1} tokens to evaluate on; lower seq_len, or prepare more "
                            "val tokens (data/README.md)")
        if n > self.n_val_windows or n < 1:
            raise DataError(f"val split has {self.n_val_windows} windows of seq_len+1={self.seq_len + 1} "
                            f"tokens but {n} were requested: lower eval_batches or micro_batch_size")
        rows: list[np.ndarray] = []
        for arr in self.val:
            k = (len(arr) - 1) // self.seq_len
            for i in range(k):
                if len(rows) == n:
                    break
                rows.append(arr[i * self.seq_len:i * self.seq_len + self.seq_len + 1])
        out = np.stack(rows)
        self._check_ids(out, "the val windows")
        return torch.from_numpy(out.astype(np.int64))

    # ------------------------------------------------------------------------------------- resume
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data a run used: names, token counts and content checksums of the train shards
        (checked on resume) and of the val shards (the val CE's data), with vocab_size; recorded in every
        checkpoint and in the training log's header."""
        digests = self.verify()

        def shards(split: str) -> list[tuple[str, int, str]]:
            return [(e["file"], int(e.get("tokens", 0)), digests[e["file"]]) for e in self.meta[split]]

        return {"train": shards("train"), "val": shards("val"), "vocab_size": self.vocab_size}

    def fingerprint_mismatch(self, saved: dict[str, Any]) -> str | None:
        """None if `saved` (a checkpoint's fingerprint) matches these data, else a message naming what changed
        and the fix. Fingerprints of older checkpoints (no checksums) are compared on names and counts."""
        now = self.fingerprint()
        if saved.get("vocab_size") != now["vocab_size"]:
            return (f"vocab_size of {self.dir}/meta.json is {now['vocab_size']}, the checkpoint's data had "
                    f"{saved.get('vocab_size')}")
        for split in ("train", "val"):
            if split not in saved:  # fingerprints of older checkpoints have no val shards
                continue
            diff = self._split_mismatch(split, saved[split], now[split])
            if diff is not None:
                why = " (the log's val_ce would mix two val sets)" if split == "val" else ""
                return (f"{diff}{why}: {rebuild_hint(self.dir)} as they were, restore the files, or start a new "
                        "out_dir")
        return None

    def _split_mismatch(self, split: str, saved: list, now: list) -> str | None:
        old = {t[0]: tuple(t[1:]) for t in saved}
        new = {t[0]: tuple(t[1:]) for t in now}
        for name in sorted(old.keys() | new.keys()):
            if name not in new:
                return f"{split} shard {self.dir / name} of the checkpoint's data is no longer in meta.json"
            if name not in old:
                return f"{split} shard {self.dir / name} is new since the checkpoint"
            o, n = old[name], new[name][:len(old[name])]
            if o[0] != n[0]:
                return f"{split} shard {self.dir / name} has {n[0]} tokens, the checkpoint's had {o[0]}"
            if o != n:
                return f"{split} shard {self.dir / name} changed since the checkpoint ({CHECKSUM} {n[1]}, was {o[1]})"
        return None
