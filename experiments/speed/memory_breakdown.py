"""What one training step keeps for backward, by module: dense vs sparse FFNs . Runs on the GPU (the CUDA training op) and on a CPU (its torch backend:
the same saved layout, so the accounting carries over).

    python -m sfl.experiments.speed.memory_breakdown --layers 28 --micro-batch 8 --out lab/speed/memory_breakdown.jsonl

Per side, one step as experiments/trainer/train.py runs it (forward with the L1 loss under bf16 autocast, backward):
- saved bytes by owner: every tensor autograd saves is attributed to the module running when it was saved
  (ffn, attention, norm, embedding; lm_head + loss after the decoder), counted once per storage; parameters
  saved as they are are counted apart (they are held anyway), autocast's weight casts are counted with the module;
- on CUDA: memory allocated before the step, at the end of the forward (what backward will consume) and the
  step's peak, from torch.cuda's allocator counters;
- the FFN path each layer took and what the dispatch decided it from (the training dispatch is per layer: a layer
  above train_dense_above, above train_backup_dense_above, or with fewer than train_sparse_min_m rows runs dense).
Sides: "dense" (the model's dense MLP with its L1 term and statistics), "dense L1=0" (the paper's baseline: no
penalty, no statistics), "sparse auto" (mlp_impl cuda, the model's KernelConfig) and "sparse forced" (train_mode
sparse, train_sparse_min_m 1).
"""
from __future__ import annotations

import argparse
import contextlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch

from ..trainer.provenance import collect
from .bench import PAPER_NNZ, build_paper_model, calibrate_paper_model, paper_profile
from .train_throughput import as_side, ffn_dispatch, ffn_paths

CATEGORIES = ("ffn", "attention", "norm", "embedding", "lm_head+loss", "parameters")


def _category(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if last == "mlp":
        return "ffn"
    if last == "self_attn":
        return "attention"
    if last.endswith("norm"):
        return "norm"
    if last == "embed_tokens":
        return "embedding"
    return None


@contextlib.contextmanager
def saved_bytes(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the tensors autograd saves inside the block, by CATEGORIES (one count per storage)."""
    owner: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        cat = _category(name)
        if cat is None:
            continue
        handles.append(mod.register_forward_pre_hook(lambda _m, _a, c=cat: owner.append(c) and None))
        handles.append(mod.register_forward_hook(lambda _m, _a, _o: owner.pop() and None))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[tuple[int, str]] = set()
    out: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key not in seen and st.nbytes() > 0:
            seen.add(key)
            cat = "parameters" if st.data_ptr() in params else (owner[-1] if owner else "lm_head+loss")
            out[cat] += st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield out
    finally:
        for h in handles:
            h.remove()


def one_step(model, ids: torch.Tensor, l1_coeff: float) -> dict[str, Any]:
    """Forward (bf16 autocast, L1 loss) + backward; saved bytes by owner and, on CUDA, the allocator's view."""
    dev = ids.device
    cuda = dev.type == "cuda"
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with saved_bytes(model) as saved, torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids[:, :-1], shift_labels=ids[:, 1:], l1_coeff=l1_coeff).loss
    row: dict[str, Any] = {f"saved_{c}_bytes": int(saved.get(c, 0)) for c in CATEGORIES}
    row["saved_activation_bytes"] = sum(v for c, v in saved.items() if c != "parameters")
    if cuda:
        torch.cuda.synchronize()
        row["after_forward_bytes"] = torch.cuda.memory_allocated() - before
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        row["peak_over_start_bytes"] = torch.cuda.max_memory_allocated() - before
    row["ffn_paths"] = ffn_paths(model)
    row["ffn_dispatch"] = ffn_dispatch(model)  # what auto decided from: measured activity, backup fraction per layer
    row["ffn_rows"] = int(ids[:, :-1].numel())   # the FFN's M (train_sparse_min_m applies to it)
    model.zero_grad(set_to_none=True)
    return row


# this tool's side names -> train_throughput.as_side's
SIDES = {"dense": "dense L1", "dense L1=0": "dense L1=0", "sparse auto": "sparse", "sparse forced": "sparse forced"}


def measure(model, ids: torch.Tensor, warmup: int = 2) -> list[dict[str, Any]]:
    """Every side: `warmup` steps (the auto dispatch measures its layers), then the accounted step."""
    rows = []
    model.train()
    for name, side in SIDES.items():
        with as_side(model, side, float(model.config.l1_coeff) or 2e-5) as coeff:
            for _ in range(warmup):
                one_step(model, ids, coeff)
            rows.append({"side": name, "l1_coeff": coeff, **one_step(model, ids, coeff)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--nnz-mean", type=float, default=None, help="default: the paper's value for the shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("lab/speed/memory_breakdown.jsonl"))
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    model = build_paper_model(a.layers, dev, torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), generator=g).to(dev)
    nnz = a.nnz_mean or PAPER_NNZ.get(a.layers, 29.0)
    heavy = torch.randperm(vocab, generator=g)[: max(1, vocab // 100)]
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        calibrate_paper_model(model, paper_profile(a.layers, nnz), ids[:, :-1], heavy_ids=heavy)
    base = {"layers": a.layers, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "target_nnz_mean": nnz,
            "kernel_config": model.config.get_kernel_config().to_dict(), **collect()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for r in measure(model, ids):
            f.write(json.dumps({**base, **r}) + "\n")
            gb = {k: round(v / 2**30, 2) for k, v in r.items() if k.endswith("_bytes")}
            print(r["side"], gb, "sparse layers:", r["ffn_paths"].count("sparse"), "/", len(r["ffn_paths"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
