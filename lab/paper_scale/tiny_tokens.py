"""A tiny uniform-random token set (vocab 512) for the device smoke run: DATA_DIR/tokens_tiny/."""
import sys
from pathlib import Path

import numpy as np

from sfl.data.tokens import write_meta, write_shards

out = Path(sys.argv[1]) / "tokens_tiny"
rng = np.random.default_rng(0)
write_meta(out, {"vocab_size": 512, "eos_id": 0, "dtype": "uint16",
                 "train": write_shards(rng.integers(0, 512, 200_000, dtype=np.uint16), out, "train", 1 << 20),
                 "val": write_shards(rng.integers(0, 512, 20_000, dtype=np.uint16), out, "val", 1 << 20)})
