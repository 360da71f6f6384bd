"""A paper-shape starting checkpoint whose FFN activity is already the paper's, for `init_from` in paper_scale.

    python -m sfl.experiments.speed.paper_init --layers 8 --out runs/paper_init/0p5b        # 0.5B, 39 non-zeros
    python -m sfl.experiments.speed.paper_init --layers 28 --out runs/paper_init/1p5b --data-dir .data

A model trained from scratch fires about half of its FFN neurons for its first thousand steps, so a short
paper-scale run measures the sparse op at its dense fallback. This writes the paper's shape (bench.py's
build_paper_model: random weights) with every layer's gates calibrated to the paper's per-layer activity profile
(bench.calibrate_paper_model: mean non-zeros per token at L1 = 2e-5, a dead fraction, a heavy tail of tokens) on
the calibration tokens: random token ids by default (what a synthetic throughput corpus holds), or the val windows
of --data-dir. Saved in fp32 with save_pretrained, plus paper_init.json (targets, achieved activity, seed).

The gates fit their calibration sample: on other tokens of the same kind the model fires more, the more so the
smaller the sample (the mean is carried by the heavy tail). Calibrated on 8 sequences of 2048 tokens, the throughput
runs measured 46.9 non-zeros per token at 0.5B (target 39) and 41.4 at 1.5B (target 29); hence 64 sequences by
default, and paper_init.json records the activity on --check-seqs held-out sequences too.

The activity holds only while the weights stay as calibrated: a run at lr > 0 drifts from it within steps. The
throughput runs that start from it (experiments/paper_scale/README.md) therefore train at lr = 1e-12: AdamW does its
whole update, which moves no fp32 weight by even one rounding step, and every step logs the measured activity.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..trainer.provenance import collect
from .bench import PAPER_NNZ, activity, build_paper_model, calibrate_paper_model, paper_profile, require_cuda, val_ids


def calibration_ids(vocab: int, n_seq: int, seq_len: int, data_dir: str | None, seed: int, skip: int = 0
                    ) -> torch.Tensor:
    """[n_seq, seq_len] token ids: the val windows of data_dir after the first `skip`, or uniform random ids."""
    if data_dir is not None:
        return val_ids(skip + n_seq, seq_len, data_dir)[skip:, :-1]
    return torch.randint(0, vocab, (n_seq, seq_len), generator=torch.Generator().manual_seed(seed + 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True, help="8 / 18 / 28 / 38: the paper's 0.5B / 1B / 1.5B / 2B")
    ap.add_argument("--out", type=Path, required=True, help="the save_pretrained folder to write")
    ap.add_argument("--nnz-mean", type=float, default=None,
                    help="mean non-zeros per token (default: the paper's value for the size; 1B: our interpolation)")
    ap.add_argument("--calib-seqs", type=int, default=64,
                    help="calibration sequences: the gates fit this sample, and fresh tokens fire more the smaller it is")
    ap.add_argument("--check-seqs", type=int, default=8, help="held-out sequences the activity is measured on")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--data-dir", default=None, help="calibrate on this prepared data's val windows")
    ap.add_argument("--heavy-frac", type=float, default=0.01, help="share of the vocabulary that fires heavily")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.out.exists() and any(a.out.iterdir()):
        raise SystemExit(f"--out {a.out} is not empty: choose another folder or remove it")
    dev = require_cuda()
    mean_nnz = a.nnz_mean if a.nnz_mean is not None else PAPER_NNZ.get(a.layers, 30.0)
    targets = paper_profile(a.layers, mean_nnz)
    model = build_paper_model(a.layers, dev, torch.bfloat16, seed=a.seed)
    vocab = model.config.vocab_size
    heavy = torch.randperm(vocab, generator=torch.Generator().manual_seed(a.seed))[: max(1, int(a.heavy_frac * vocab))]
    ids = calibration_ids(vocab, a.calib_seqs, a.seq_len, a.data_dir, a.seed).to(dev)
    t0 = time.time()
    achieved = calibrate_paper_model(model, targets, ids, heavy_ids=heavy, seed=a.seed)
    # what a run on other tokens of the same kind sees (a throughput run's batches): above the targets, since the
    # gates were fitted to the calibration sample
    check = calibration_ids(vocab, a.check_seqs, a.seq_len, a.data_dir, a.seed + 1, skip=a.calib_seqs).to(dev)
    held_out = activity(model, check)
    model.float().save_pretrained(a.out)
    info = {"num_hidden_layers": a.layers, "target_nnz_mean": mean_nnz, "target_nnz_per_layer": targets,
            "achieved_nnz_per_layer": achieved, "achieved_nnz_mean": sum(achieved) / len(achieved),
            "held_out_nnz_per_layer": held_out["nnz_mean_per_layer"], "held_out_nnz_mean": held_out["nnz_mean"],
            "held_out_seqs": a.check_seqs,
            "calibration_tokens": "val windows of " + a.data_dir if a.data_dir else "random token ids",
            "calibration_seqs": a.calib_seqs, "seq_len": a.seq_len, "heavy_frac": a.heavy_frac, "seed": a.seed,
            "calibration_s": round(time.time() - t0, 1), "provenance": collect()}
    (a.out / "paper_init.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{a.out}: {a.layers} layers, mean non-zeros {info['achieved_nnz_mean']:.1f} on the calibration tokens "
          f"(target {mean_nnz:.1f}), {info['held_out_nnz_mean']:.1f} on held-out ones; calibrated in "
          f"{info['calibration_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
