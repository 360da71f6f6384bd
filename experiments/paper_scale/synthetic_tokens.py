"""Uniform random token ids in the prepared-data layout (uint16 shards, meta.json with checksums), for measuring
paper-scale throughput where no corpus is at hand: the speed of a training step does not depend on which tokens it
reads, only the activity does, and paper_init calibrates that on the same kind of ids.

    python -m sfl.experiments.paper_scale.synthetic_tokens DATA_DIR [--train-tokens 40000000] [--vocab 49152]

Writes DATA_DIR/tokens_synthetic/ (--subdir); DATA_DIR/tokenizer must be a prepared tokenizer (it is copied into saved models).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from sfl.data.tokens import write_meta, write_shards

SHARD_TOKENS = 1 << 26


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--train-tokens", type=int, default=40_000_000)
    ap.add_argument("--val-tokens", type=int, default=2_000_000)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--subdir", default="tokens_synthetic", help="the folder under DATA_DIR to write")
    a = ap.parse_args()
    out = a.data_dir / a.subdir
    rng = np.random.default_rng(a.seed)
    def ids(n: int):
        return rng.integers(0, a.vocab, n, dtype=np.uint16)

    meta = {"vocab_size": a.vocab, "eos_id": 0, "dtype": "uint16", "source": "uniform random ids (throughput only)",
            "train": write_shards(ids(a.train_tokens), out, "train", SHARD_TOKENS),
            "val": write_shards(ids(a.val_tokens), out, "val", SHARD_TOKENS)}
    write_meta(out, meta)
    print(f"{out}: {a.train_tokens} train + {a.val_tokens} val tokens, vocab {a.vocab}")


if __name__ == "__main__":
    main()
