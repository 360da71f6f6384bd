"""Token windows from the prepared uint16 memmaps (<data_dir>/tokens/{meta.json, *.bin}).

Training batches are contiguous seq_len+1 windows that are a pure function of (seed, step, rank): no
sampler state has to be carried, and a resumed run draws exactly the batches the uninterrupted run would
have drawn. A step's global batch depends on (seed, step) only and every rank reads its own block of it,
so the data order does not change with the number of ranks. Validation uses fixed sequential windows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


class TokenData:
    """Memmapped train/val token streams described by meta.json (see the team brief's data layout)."""

    def __init__(self, tokens_dir: str | Path, seq_len: int, order: str = "random", world: int = 1) -> None:
        self.dir = Path(tokens_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{meta_path} not found: prepare the data first (see data/README.md) or set data_dir / "
                "$SFL_DATA_DIR to a prepared data dir")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        if self.meta.get("dtype", "uint16") != "uint16":
            raise ValueError(f"{meta_path}: dtype {self.meta.get('dtype')!r} unsupported (expected uint16)")
        self.vocab_size = int(self.meta["vocab_size"])
        self.seq_len = seq_len
        self.train = self._open(self.meta["train"], "train")
        self.val = self._open(self.meta["val"], "val")
        # Valid window starts per train file; windows never cross file boundaries.
        self._starts = np.array([len(a) - seq_len for a in self.train], dtype=np.int64)
        if (self._starts <= 0).all():
            raise ValueError(f"every train file in {self.dir} is shorter than seq_len+1={seq_len + 1} tokens")
        self._starts = np.maximum(self._starts, 0)
        self._cum = np.cumsum(self._starts)
        self.n_val_windows = sum(max(0, (len(a) - 1) // seq_len) for a in self.val)
        if order not in ("random", "disjoint"):
            raise ValueError(f"data order {order!r}: must be random or disjoint")
        self.order, self.world = order, world
        # order "disjoint": window i of a file starts at token i*seq_len (the val split's layout)
        self._win_cum = np.cumsum([max(0, (len(a) - 1) // seq_len) for a in self.train])
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _open(self, entries: list[dict[str, Any]], split: str) -> list[np.memmap]:
        arrays = []
        for e in entries:
            path = self.dir / e["file"]
            arr = np.memmap(path, dtype=np.uint16, mode="r")
            if "tokens" in e and int(e["tokens"]) != len(arr):
                raise ValueError(f"{path}: meta.json says {e['tokens']} tokens, file has {len(arr)}")
            arrays.append(arr)
        if not arrays:
            raise ValueError(f"{self.dir}/meta.json lists no {split} files")
        return arrays

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
        rows = [self.train[f][o:o + self.seq_len + 1] for f, o in zip(file_idx, offs)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

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
        if n > self.n_val_windows:
            raise ValueError(f"val split has {self.n_val_windows} windows of seq_len+1={self.seq_len + 1} "
                             f"tokens but {n} were requested: lower eval_batches or micro_batch_size")
        rows: list[np.ndarray] = []
        for arr in self.val:
            k = (len(arr) - 1) // self.seq_len
            for i in range(k):
                if len(rows) == n:
                    break
                rows.append(arr[i * self.seq_len:i * self.seq_len + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data a checkpoint was trained on (checked on resume)."""
        return {"train": [(e["file"], int(e.get("tokens", 0))) for e in self.meta["train"]],
                "vocab_size": self.vocab_size}
