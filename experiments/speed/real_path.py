"""Model-level speed through the paths users run: HF's own LlamaForCausalLM against SparseLlamaForCausalLM
(mlp_impl="cuda"), the same weights, one process, interleaved. GPU only.

    python -m sfl.experiments.speed.real_path --layers 28 --out results/speed/real_path_h100.jsonl

The model: the paper's 1.5B shape by default (hidden 2048, N 5632, 28 layers), random weights whose gates are
calibrated (bench.calibrate_paper_model) to the paper's activity profile (29 non-zeros per token on average, a
heavy tail of frequent tokens). The dense side is HF's `LlamaForCausalLM` with hidden_act="relu" holding the very
same weights: the baseline a user has.

What is timed (CUDA events or a synchronised wall clock, after warm-up; sides alternate A B B A per block; medians)
- prefill: `model.model(input_ids)` (decoder core) and `model(input_ids)` (lm_head included, logits of every
  position) at batch 1, 4, 16 x 2048 tokens;
- generate: `generate()` of 64 new tokens after a 128-token prompt, greedy, at batch 1, 8, 32; eager (dynamic
  cache) and with the static cache, which transformers compiles by itself (its supported way), on both sides; each
  side's GPU time of one more call (hf_gpu_s, ours_gpu_s: the profiler's kernel time) beside its wall time;
- graph: the same greedy decoding through decode_loop.py, the prompt eagerly and every further token one CUDA graph
  replay, which shows what the model itself gives once generate()'s host work per token is gone.
Every row records the measured sparsity, the effective KernelConfig and provenance.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from sfl.kernels.config import KernelConfig
from sfl.models.hot_cold import calibrate_hot_neurons_

from ..trainer.provenance import collect
from .bench import build_paper_model, calibrate_paper_model, paper_profile, require_cuda
from .decode_loop import StaticGreedyDecoder


def dense_twin(sparse) -> torch.nn.Module:
    """HF's LlamaForCausalLM (ReLU) with the sparse model's weights."""
    c = sparse.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                      rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
                      hidden_act="relu", mlp_bias=False, attention_bias=False, rms_norm_eps=c.rms_norm_eps)
    with torch.device("meta"):
        dense = LlamaForCausalLM(cfg)
    dense.load_state_dict(sparse.state_dict(), strict=True, assign=True)
    dense.model.rotary_emb = type(dense.model.rotary_emb)(config=cfg, device=sparse.device)
    return dense.to(sparse.device).eval()


def _timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def gpu_seconds(fn: Callable[[], Any], top: int = 0, label: str = "") -> float:
    """Summed device time of the kernels and copies one call runs (CUDA-graph replays included), from the profiler:
    beside the wall time it shows how much of a generate() step is host work that both sides pay. top > 0 also
    prints that many kernels by device time (lab/speed/profile_static.py)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if top:
        print(f"==== {label}: kernels by device time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90))
    return sum(e.self_device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA) * 1e-6


def interleaved(sides: dict[str, Callable[[], Any]], blocks: int, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each side: warm-up, then blocks in the order A B B A A B ... of `reps` calls each."""
    names = list(sides)
    for n in names:
        for _ in range(warmup):
            sides[n]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        order = names if b % 2 == 0 else names[::-1]
        for n in order:
            out[n] += [_timed(sides[n]) for _ in range(reps)]
    return out


def row(kind: str, times: dict[str, list[float]], tokens: int, **extra: Any) -> dict[str, Any]:
    hf, ours = statistics.median(times["hf"]), statistics.median(times["ours"])
    return {"kind": kind, "hf_s": hf, "ours_s": ours, "speedup": hf / ours, "tokens": tokens,
            "hf_tokens_per_s": tokens / hf, "ours_tokens_per_s": tokens / ours,
            "hf_all_s": times["hf"], "ours_all_s": times["ours"], **extra}


@torch.inference_mode()
def prefill_rows(hf, ours, vocab: int, batches: list[int], seq: int, blocks: int, reps: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(1)
    for b in batches:
        ids = torch.randint(0, vocab, (b, seq), generator=g).to(ours.device)
        for what, pick in (("prefill model.model", lambda m: m.model), ("prefill with lm_head", lambda m: m)):
            sides = {"hf": lambda: pick(hf)(input_ids=ids), "ours": lambda: pick(ours)(input_ids=ids)}
            rows.append(row(what, interleaved(sides, blocks, reps, warmup=2), b * seq, batch=b, seq_len=seq))
            print(f"{what:24s} batch {b:2d}: {rows[-1]['speedup']:.3f}x", flush=True)
    return rows


def generate_rows(hf, ours, vocab: int, batches: list[int], prompt: int, new: int, static: bool,
                  blocks: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(2)
    kw: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    for b in batches:
        ids = torch.randint(1, vocab, (b, prompt), generator=g).to(ours.device)
        mask = torch.ones_like(ids)
        sides = {"hf": lambda: hf.generate(input_ids=ids, attention_mask=mask, **kw),
                 "ours": lambda: ours.generate(input_ids=ids, attention_mask=mask, **kw)}
        with torch.inference_mode():
            same = torch.equal(sides["hf"](), sides["ours"]())
        t = interleaved(sides, blocks, reps=1, warmup=2)
        with torch.inference_mode():
            gpu = {f"{k}_gpu_s": gpu_seconds(f) for k, f in sides.items()}
        path = "generate static cache (transformers compiles)" if static else "generate eager"
        rows.append(row(path, t, b * new, batch=b, prompt_len=prompt, new_tokens=new, greedy_tokens_equal=same,
                        **gpu))
        print(f"{path:46s} batch {b:2d}: {rows[-1]['speedup']:.3f}x (tokens equal: {same})", flush=True)
    return rows


def graph_rows(hf, ours, vocab: int, batches: list[int], prompt: int, new: int, blocks: int) -> list[dict]:
    """The same greedy decoding as generate_rows, through decode_loop.StaticGreedyDecoder: the prompt eagerly, then
    every token one CUDA graph replay (no transformers loop), each side with its own decoder and static cache."""
    rows = []
    g = torch.Generator(device="cpu").manual_seed(2)
    for b in batches:
        ids = torch.randint(1, vocab, (b, prompt), generator=g).to(ours.device)
        decoders = {k: StaticGreedyDecoder(m, b, prompt + new, graph=True) for k, m in (("hf", hf), ("ours", ours))}
        sides = {k: (lambda d=d: d(ids, new)) for k, d in decoders.items()}
        same = torch.equal(sides["hf"](), sides["ours"]())  # also captures each side's graph
        t = interleaved(sides, blocks, reps=1, warmup=2)
        rows.append(row("decode loop, one CUDA graph per token", t, b * new, batch=b, prompt_len=prompt,
                        new_tokens=new, greedy_tokens_equal=same))
        print(f"{'decode loop (CUDA graph per token)':46s} batch {b:2d}: {rows[-1]['speedup']:.3f}x "
              f"(tokens equal: {same})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--nnz-mean", type=float, default=29.0)
    ap.add_argument("--prefill-batches", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--generate-batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="prefill,eager,static,graph",
                    help="comma list of prefill, eager, static, graph (decode_loop.py: one CUDA graph per token)")
    ap.add_argument("--no-stats", action="store_true", help="our model without its device statistics "
                    "(config.track_sparsity_stats=False)")
    ap.add_argument("--heavy-frac", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="KernelConfig fields for our model (e.g. up_list_min_m=0), logged in kernel_config")
    ap.add_argument("--hot-cold", action="store_true",
                    help="after the parts, order our layers' neurons and choose their hot counts (models/hot_cold.py, "
                         "timed on the calibration batch) and run the prefill part again")
    ap.add_argument("--out", type=Path, default=Path("results/speed/real_path.jsonl"))
    a = ap.parse_args(argv)
    dev = require_cuda()
    ours = build_paper_model(a.layers, dev, torch.bfloat16, seed=a.seed)
    vocab = ours.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    heavy = torch.randperm(vocab, generator=g)[: max(1, int(a.heavy_frac * vocab))]
    calib = torch.randint(0, vocab, (max(a.prefill_batches), a.seq_len), generator=g).to(dev)
    targets = paper_profile(a.layers, a.nnz_mean)
    achieved = calibrate_paper_model(ours, targets, calib, heavy_ids=heavy)
    hf = dense_twin(ours)
    ours.set_mlp_impl("cuda")
    if a.kernel:
        env = {f"SFL_KERNEL_{k.upper()}": v for k, v in (kv.split("=", 1) for kv in a.kernel)}
        ours.set_kernel_config(KernelConfig.from_env(ours.config.get_kernel_config(), environ=env))
    parts = set(a.parts.split(","))
    with torch.inference_mode():
        ours.reset_sparsity_stats()
        ours.model(input_ids=calib[:4])
        st = ours.sparsity_stats()
    base = {"model": f"paper-shape {a.layers} layers", "num_hidden_layers": a.layers, "hidden": 2048,
            "intermediate": 5632, "target_nnz_mean": a.nnz_mean, "calibration_nnz_mean": sum(achieved) / len(achieved),
            "measured_nnz_mean": st["nnz_mean"], "measured_nnz_max": st["nnz_max"],
            "kernel_config": ours.config.get_kernel_config().to_dict(), "dense_side": "transformers LlamaForCausalLM",
            "sparse_side": "SparseLlamaForCausalLM(mlp_impl='cuda')", **collect()}
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def log(rows: list[dict]) -> None:  # appended as each part finishes: a later failure keeps what was measured
        # the W_d copies our layers' plans hold (0 with W_d stored neuron-major, kernels/layout.py)
        copies = sum(mlp.plan.info().get("down_copy_bytes", 0) for mlp in ours.sparse_mlps())
        with a.out.open("a") as f:
            for r in rows:
                f.write(json.dumps({**base, "ours_down_copy_bytes": copies, **r}) + "\n")

    ours.config.track_sparsity_stats = not a.no_stats
    base["track_sparsity_stats"] = not a.no_stats
    if "prefill" in parts:
        log(prefill_rows(hf, ours, vocab, a.prefill_batches, a.seq_len, a.blocks, a.reps))
    if "eager" in parts:
        log(generate_rows(hf, ours, vocab, a.generate_batches, 128, 64, False, a.blocks))
    if "static" in parts:
        try:
            log(generate_rows(hf, ours, vocab, a.generate_batches, 128, 64, True, a.blocks))
        except Exception as e:  # recorded, not hidden: the static-cache path is a target of its own
            log([{"kind": "generate static cache (transformers compiles)", "error": repr(e)[:2000]}])
            print(f"static-cache generate failed: {e!r}", flush=True)
    if "graph" in parts:
        try:
            log(graph_rows(hf, ours, vocab, a.generate_batches, 128, 64, a.blocks))
        except Exception as e:  # recorded, not hidden, like the static-cache part
            log([{"kind": "decode loop, one CUDA graph per token", "error": repr(e)[:2000]}])
            print(f"graph decode loop failed: {e!r}", flush=True)
    if a.hot_cold:  # the same model with hot/cold layers (the same function), against the same dense twin

        hot = calibrate_hot_neurons_(ours, [calib[:4]], calib)
        base["hot_neurons"] = hot
        base["kernel_config"] = ours.config.get_kernel_config().to_dict()
        print(f"hot neurons per layer: {hot}", flush=True)
        log(prefill_rows(hf, ours, vocab, a.prefill_batches, a.seq_len, a.blocks, a.reps))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
